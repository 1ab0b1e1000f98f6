"""Parse `scirl export prime-rl`'s grpo.toml with prime-rl's own RLConfig and check what it resolves to.

Run by scripts/check_primerl_config.sh inside a venv that holds prime-rl's config
package, its verifiers, scirl and the sciknoweval package. It exports (or reads
``--export DIR``), parses ``rl @ grpo.toml --max-steps 30 ...`` exactly as prime-rl's
``rl`` entrypoint does (``pydantic_config.cli(RLConfig)``), applies the launcher's
own base_url check, prints the resolved ports and settings, and exits 1 if any
check fails. ``--record FILE`` writes what prime-rl resolved (plus its defaults and
field names) as the fixture tests/primerl/test_export.py checks the export against.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from urllib.parse import urlparse

import tomli_w
import tomllib

from scirl.primerl.export import EPHEMERAL_RANGE, ROUTER_METRICS_OFFSET, TARGETS, Ports, export

# The flags the exported README launches with.
LAUNCH_ARGS = ["--max-steps", "30", "--run.name", "grpo-cold-start"]
# Settings the export moves off prime-rl's defaults; removed to see those defaults.
OVERRIDDEN_KEYS = [
    ("orchestrator", "train", "filter_zero_advantages"),
    ("orchestrator", "post_batch_filters"),
    ("weight_broadcast",),
    ("rollout_transport",),
    ("orchestrator", "env_server_base_port"),
    ("orchestrator", "model"),
    ("inference", "backend_port"),
    ("inference", "server"),
    ("inference", "vllm", "data_parallel_rpc_port"),
]


def git(checkout: Path, *args: str) -> str | None:
    try:
        return subprocess.run(
            ["git", "-C", str(checkout), *args], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def parse(toml_path: Path, output_dir: Path):
    """RLConfig from ``rl @ grpo.toml <launch flags>``, as prime-rl's entrypoint parses it."""
    from prime_rl.configs.rl import RLConfig
    from pydantic_config import cli

    config = cli(RLConfig, args=["@", str(toml_path), *LAUNCH_ARGS, "--output-dir", str(output_dir)])
    # src/prime_rl/entrypoints/rl.py (rl_local): the launcher refuses a client on another port.
    if config.inference is not None:
        client_port = urlparse(config.orchestrator.model.client.base_url).port
        if client_port != config.inference.server.port:
            raise ValueError(
                f"orchestrator.model.client.base_url port ({client_port}) does not match "
                f"inference.server.port ({config.inference.server.port}) (launcher check)"
            )
    return config


def resolved_facts(config) -> dict:
    """What a run of this config opens and trains with, read from prime-rl's resolved objects."""
    orch, trainer, inference = config.orchestrator, config.trainer, config.inference
    train = orch.train
    # the addresses the launcher binds env servers at (OrchestratorConfig.env_addresses)
    env_ports = [urlparse(address.replace("tcp://", "http://")).port for address in orch.env_addresses.values()]
    facts = {
        "trainer.weight_broadcast.type": trainer.weight_broadcast.type,
        "trainer.weight_broadcast.port": trainer.weight_broadcast.port,
        "orchestrator.weight_broadcast.type": orch.weight_broadcast.type,
        "orchestrator.weight_broadcast.port": orch.weight_broadcast.port,
        "inference.weight_broadcast.type": inference.weight_broadcast.type,
        "inference.server.port": inference.server.port,
        "inference.backend_port": inference.backend_port,
        "router_metrics_port": inference.server.port + ROUTER_METRICS_OFFSET,
        "inference.vllm.data_parallel_rpc_port": inference.vllm.data_parallel_rpc_port,
        "trainer.rollout_transport.port": trainer.rollout_transport.port,
        "orchestrator.rollout_transport.port": orch.rollout_transport.port,
        "rollout_ready_port": orch.rollout_transport.port + 1,
        "orchestrator.env_server_base_port": orch.env_server_base_port,
        "env_server_ports": env_ports,
        "orchestrator.model.client.base_url": orch.model.client.base_url,
        "orchestrator.model.client.admin_base_url": orch.model.client.admin_base_url,
        "trainer.model.name": trainer.model.name,
        "orchestrator.model.name": orch.model.name,
        "inference.vllm.model": inference.vllm.model,
        "max_steps": [trainer.max_steps, orch.max_steps],
        "seq_len": [trainer.model.seq_len, orch.seq_len],
        "orchestrator.batch_size": orch.batch_size,
        "orchestrator.group_size": orch.group_size,
        "trainer.optim.lr": trainer.optim.lr,
        "orchestrator.train.sampling.max_completion_tokens": train.sampling.max_completion_tokens,
        "deployment": [config.deployment.num_train_gpus, config.deployment.num_infer_gpus],
        "inference.vllm.data_parallel_size": inference.vllm.data_parallel_size,
        "taskset": type(orch.train.source[0].env.taskset).__name__,
    }
    if "filter_zero_advantages" in type(train).model_fields:
        facts["orchestrator.train.filter_zero_advantages"] = train.filter_zero_advantages
    if "post_batch_filters" in type(orch).model_fields:
        facts["orchestrator.post_batch_filters"] = [
            {"type": f.type, "enforce": f.enforce} for f in orch.post_batch_filters
        ]
    return facts


def field_names(config, exported: dict) -> dict[str, list[str]]:
    """For every table the export writes, the field names of prime-rl's class at that path."""
    out: dict[str, list[str]] = {}

    def walk(obj, table: dict, path: str) -> None:
        if path:
            out[path] = sorted(type(obj).model_fields)
        for key, value in table.items():
            if isinstance(value, list) and value and isinstance(value[0], dict):
                value, child = value[0], getattr(obj, key)[0]
            elif isinstance(value, dict):
                child = getattr(obj, key)
            else:
                continue
            if path.endswith("env") and key == "taskset":
                continue  # our own class, not prime-rl's
            walk(child, value, f"{path}.{key}" if path else key)

    walk(config, exported, "")
    return out


def checks(facts: dict, ports: Ports, target_name: str) -> list[tuple[bool, str]]:
    low, high = EPHEMERAL_RANGE
    opened = [
        facts["inference.server.port"],
        facts["inference.backend_port"],
        facts["router_metrics_port"],
        facts["trainer.weight_broadcast.port"],
        facts["inference.vllm.data_parallel_rpc_port"],
        facts["orchestrator.rollout_transport.port"],
        facts["rollout_ready_port"],
        *facts["env_server_ports"],
    ]
    api = facts["inference.server.port"]
    result = [
        (
            facts["trainer.weight_broadcast.port"] == facts["orchestrator.weight_broadcast.port"] == ports.nccl
            and facts["trainer.weight_broadcast.type"] == facts["orchestrator.weight_broadcast.type"] == "nccl",
            f"NCCL weight broadcast on the exported port {ports.nccl}, trainer and orchestrator",
        ),
        (all(not low <= p <= high for p in opened), f"no port in the ephemeral range {low}-{high}"),
        (len(set(opened)) == len(opened), "every port distinct"),
        (
            api == ports.api
            and facts["inference.backend_port"] == ports.backend
            and facts["inference.vllm.data_parallel_rpc_port"] == ports.dp_rpc
            and facts["trainer.rollout_transport.port"] == facts["orchestrator.rollout_transport.port"] == ports.rollout
            and facts["orchestrator.env_server_base_port"] == ports.env_servers,
            "every other port at the exported block",
        ),
        (
            facts["orchestrator.model.client.base_url"] == f"http://localhost:{api}/v1"
            and facts["orchestrator.model.client.admin_base_url"] == [f"http://localhost:{ports.backend}/v1"],
            "client base_url on the API port, admin calls on the backend port",
        ),
        (
            facts.get("orchestrator.train.filter_zero_advantages") is False
            or {"type": "zero_advantage", "enforce": False} in facts.get("orchestrator.post_batch_filters", []),
            "zero-advantage rollouts kept (the guide's monitor-only filter)",
        ),
        (
            facts["trainer.model.name"] == facts["orchestrator.model.name"] == facts["inference.vllm.model"]
            and facts["orchestrator.batch_size"] == 128
            and facts["orchestrator.group_size"] == 16
            and facts["trainer.optim.lr"] == 5e-6
            and facts["seq_len"] == [4096, 4096]
            and facts["orchestrator.train.sampling.max_completion_tokens"] == 256
            and facts["deployment"] == [2, 6]
            and facts["inference.vllm.data_parallel_size"] == 6
            and facts["max_steps"] == [30, 30],
            "the guide's model, batch 128 / group 16, lr 5e-6, seq_len 4096, 256 tokens, 2 + 6 GPUs, DP 6",
        ),
    ]
    if target_name == "guide":
        result.append(
            (
                [f["type"] for f in facts.get("orchestrator.post_batch_filters", [])]
                == ["gibberish", "repetition", "zero_advantage"],
                "the guide's filter list: gibberish, repetition, zero_advantage",
            )
        )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", type=Path, required=True, help="the prime-rl checkout (for its commit)")
    parser.add_argument(
        "--ref",
        choices=sorted(TARGETS),
        default=None,
        help="the export's prime-rl target; default: the one whose commit the checkout is at, else main",
    )
    parser.add_argument("--base-port", type=int, default=None, help="passed to the export")
    parser.add_argument("--export", type=Path, default=None, help="check this export instead of making one")
    parser.add_argument("--record", type=Path, default=None, help="write the fixture JSON here")
    args = parser.parse_args()

    commit = git(args.checkout, "rev-parse", "HEAD") or "unknown"
    ref = args.ref or next((t.name for t in TARGETS.values() if t.commit == commit), "main")
    target = TARGETS[ref]
    print(
        f"prime-rl checkout at {commit} ({git(args.checkout, 'log', '-1', '--format=%cs') or '?'}); "
        f"export target: {ref} = {target.commit}"
    )
    if commit != target.commit:
        print(f"warning: the checkout is not at the target commit {target.commit}")

    from packaging.requirements import Requirement

    verifiers_version = metadata.version("verifiers")
    [req] = [Requirement(r) for r in metadata.requires("sciknoweval") if Requirement(r).name == "verifiers"]
    print(
        f"verifiers {verifiers_version} (from the checkout's deps/verifiers: "
        f"{git(args.checkout / 'deps' / 'verifiers', 'describe', '--tags') or '?'}); "
        f"sciknoweval requires {req}"
    )
    results = [
        (
            req.specifier.contains(verifiers_version, prereleases=True),
            "the sciknoweval package accepts prime-rl's own verifiers",
        )
    ]

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.export is None:
            made = export(tmp / "export", ref=ref, base_port=args.base_port)
            export_dir, ports = made.out, made.ports
        else:
            export_dir = args.export
            ports = Ports(tomllib.loads((export_dir / "grpo.toml").read_text())["inference"]["server"]["port"])
        exported = tomllib.loads((export_dir / "grpo.toml").read_text())
        try:
            config = parse(export_dir / "grpo.toml", tmp / "outputs")
        except (Exception, SystemExit) as e:  # noqa: BLE001 - report whatever prime-rl raised
            print(f"FAIL prime-rl's RLConfig rejects the export: {e}")
            return 1
        print("PASS prime-rl's RLConfig accepts the export (rl @ grpo.toml " + " ".join(LAUNCH_ARGS) + ")")
        facts = resolved_facts(config)
        bare = copy.deepcopy(exported)
        for path in OVERRIDDEN_KEYS:
            table = bare
            for key in path[:-1]:
                table = table.get(key, {})
            table.pop(path[-1], None)
        (tmp / "bare.toml").write_text(tomli_w.dumps(bare))
        defaults = resolved_facts(parse(tmp / "bare.toml", tmp / "outputs"))
        fields = field_names(config, exported)

    print("\nresolved by prime-rl (exported / prime-rl default):")
    for key, value in facts.items():
        default = defaults[key]
        print(f"  {key:52} {value!r}" + (f"   (default {default!r})" if default != value else ""))
    print()
    results += checks(facts, ports, ref)
    for ok, what in results:
        print(("PASS " if ok else "FAIL ") + what)

    if args.record is not None:
        fixture = {
            "about": "prime-rl's own resolution of `scirl export prime-rl`'s grpo.toml, recorded by "
            "scripts/check_primerl_config.sh; tests/primerl/test_export.py checks the export against it",
            "prime_rl_commit": commit,
            "prime_rl_ref": ref,
            "verifiers": verifiers_version,
            "base_port": ports.base,
            "launch_args": LAUNCH_ARGS,
            "exported": exported,
            "resolved": facts,
            "defaults": defaults,
            "launcher_constants": {
                "router_metrics_offset": ROUTER_METRICS_OFFSET,
                "router_metrics_source": "src/prime_rl/entrypoints/inference.py: --prometheus-port server.port + 21000",
                "rollout_ready_offset": 1,
                "rollout_ready_source": "transports/rollouts/zmq.py: ready socket on rollout_transport.port + 1",
            },
            "fields": fields,
        }
        args.record.write_text(json.dumps(fixture, indent=1, sort_keys=True) + "\n")
        print(f"\nrecorded {args.record}")
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
