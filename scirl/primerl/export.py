"""`scirl export prime-rl`: everything needed to train on scirl's task with vanilla prime-rl.

The output directory holds
- ``sciknoweval/``: the verifiers taskset package, to drop at
  ``deps/prime-envs/environments/science/sciknoweval`` in a prime-rl checkout;
- ``grpo.toml``: the run guide's config (step 7) for one named prime-rl commit,
  with every port prime-rl opens moved to a block that was free when exported;
- ``README.md``: the exact install, launch and evaluation commands.

prime-rl's config schema changes without aliases, so one TOML cannot serve every
prime-rl: ``TARGETS`` names the commits the config is written for, and
``scripts/check_primerl_config.sh`` validates an export with prime-rl's own
config classes at such a commit.

The package's files ship inside scirl (``scirl/assets/prime_rl/sciknoweval`` is
a link to ``packages/sciknoweval`` in a checkout, and setuptools copies the
files into the wheel), so an installed scirl exports the same files as a checkout.
"""

from __future__ import annotations

import shlex
import socket
import sys
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

import tomli_w

from scirl import algorithms
from scirl.errors import HubUnreachable
from scirl.task import formats
from scirl.task.data import DEFAULT_EVAL_PER_DOMAIN, DEFAULT_SPLIT_METHOD, DEFAULT_SPLIT_SEED, load_splits

PACKAGE_NAME = "sciknoweval"
DROP_PATH = "deps/prime-envs/environments/science/sciknoweval"
CONFIG_PATH = "examples/basic/sciknoweval/grpo.toml"
DEFAULT_MODEL = "PrimeIntellect/Qwen3-8B"
# Every extra spelled out: a uv sync without one silently uninstalls it (guide, gotcha 1).
UV_SYNC = "uv sync --all-packages --extra flash-attn --extra disagg"
# The line in the package's pyproject that `export` rewrites for the target machine.
SCIRL_SOURCE_LINE = 'scirl = { path = "../..", editable = true }'
SKIPPED_NAMES = {"__pycache__", ".pytest_cache", "build", "dist"}
# Train tasks with the default split (content, 200 per domain): 18,670 MCQ rows
# minus skipped rows and dropped duplicates, minus 800 held out.
EXPECTED_TRAIN_TASKS = 17_808
EXPECTED_EVAL_TASKS = 800


@dataclass(frozen=True)
class Target:
    """A prime-rl commit the exported grpo.toml is written for."""

    name: str
    commit: str
    date: str
    verifiers: str
    """The verifiers version that commit's `deps/verifiers` submodule builds as."""
    zero_advantage: str
    """How that commit keeps zero-advantage rollouts: "train_flag" or "post_batch_filters"."""


TARGETS = {
    # main as of this commit: `post_batch_filters` is gone (upstream 61f2448d1), the
    # trainer no longer writes HF weights (upstream PR #3316).
    "main": Target(
        "main", "559b44772e471d1538537b8805cc77f3824a5e64", "2026-08-21", "0.3.1.dev62 (a60a606)", "train_flag"
    ),
    # the commit the run guide was written against (61f2448d1^).
    "guide": Target(
        "guide", "c7a6573de5c7659124a9536ed855939ee4992a2c", "2026-08-18", "0.3.1.dev42 (02cc940)", "post_batch_filters"
    ),
}
DEFAULT_TARGET = "main"

# prime-rl's launcher starts vllm-router with `--prometheus-port <API port + 21000>`
# (src/prime_rl/entrypoints/inference.py at 559b447); it has no config field.
ROUTER_METRICS_OFFSET = 21_000
# Linux's default ephemeral range: outgoing connections take local ports from it,
# so a port there can be taken between export and launch. The training node's range
# is what matters, and it is usually this default, so the rule uses it; a different
# range on the exporting machine only earns a note.
EPHEMERAL_RANGE = DEFAULT_EPHEMERAL_RANGE = (32768, 60999)
# Base ports are searched here: low enough that API + 21000 stays below the ephemeral range.
BASE_PORT_SEARCH = range(10_000, 11_760, 10)
ENV_SERVER_SLOTS = 4  # env servers listen on env_servers + source index (train, then eval sources)


@dataclass(frozen=True)
class Ports:
    """Every port prime-rl's `rl` opens on the node, laid out from one base port."""

    base: int

    @property
    def api(self) -> int:
        """inference.server.port: vllm-router, the orchestrator's client `base_url`."""
        return self.base

    @property
    def backend(self) -> int:
        """inference.backend_port: the vLLM engine behind the router (admin calls)."""
        return self.base + 1

    @property
    def nccl(self) -> int:
        """weight_broadcast.port: the NCCL rendezvous of trainer rank 0 and the vLLM workers."""
        return self.base + 2

    @property
    def dp_rpc(self) -> int:
        """inference.vllm.data_parallel_rpc_port."""
        return self.base + 3

    @property
    def rollout(self) -> int:
        """rollout_transport.port: ZMQ rollouts to the trainer; the ready socket takes port + 1."""
        return self.base + 4

    @property
    def env_servers(self) -> int:
        """orchestrator.env_server_base_port: the source at index i listens on this + i."""
        return self.base + 6

    @property
    def router_metrics(self) -> int:
        return self.api + ROUTER_METRICS_OFFSET

    @property
    def base_url(self) -> str:
        return f"http://localhost:{self.api}/v1"

    def all(self) -> dict[str, int]:
        """Every port a run opens, by what opens it."""
        ports = {
            "api": self.api,
            "backend": self.backend,
            "nccl": self.nccl,
            "dp_rpc": self.dp_rpc,
            "rollout": self.rollout,
            "rollout_ready": self.rollout + 1,
        }
        ports.update({f"env_server_{i}": self.env_servers + i for i in range(ENV_SERVER_SLOTS)})
        ports["router_metrics"] = self.router_metrics
        return ports


def local_ephemeral_range() -> tuple[int, int]:
    """This machine's ephemeral port range (Linux), else the Linux default."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE


def port_is_free(port: int) -> bool:
    """Nothing listens on ``port`` here, and no socket still holds it.

    The bind is on all interfaces and without SO_REUSEADDR, so a port still in
    TIME_WAIT from a previous run also counts as taken (guide, gotcha 5).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
        return True


def check_ports(ports: Ports) -> None:
    """Raise ValueError naming the first port of the block that is out of range, ephemeral or taken."""
    low, high = EPHEMERAL_RANGE
    for use, port in ports.all().items():
        if not 1024 <= port <= 65535:
            raise ValueError(
                f"base port {ports.base} puts the {use} port at {port}, outside 1024-65535; "
                f"pick a base port in {BASE_PORT_SEARCH.start}-{BASE_PORT_SEARCH.stop}"
            )
        if low <= port <= high:
            raise ValueError(
                f"base port {ports.base} puts the {use} port at {port}, inside the ephemeral range "
                f"{low}-{high}, where outgoing connections can take it; the router metrics port is "
                f"API + {ROUTER_METRICS_OFFSET}, so pick a base port below {low - ROUTER_METRICS_OFFSET}"
            )
        if not port_is_free(port):
            raise ValueError(
                f"base port {ports.base}: the {use} port {port} is not free on this machine; pick another base port"
            )


def choose_ports(base: int | None = None) -> Ports:
    """The requested block, checked, or the first free block of ``BASE_PORT_SEARCH``."""
    if base is not None:
        ports = Ports(base)
        check_ports(ports)
        return ports
    for candidate in BASE_PORT_SEARCH:
        try:
            ports = Ports(candidate)
            check_ports(ports)
            return ports
        except ValueError:
            continue
    raise ValueError(
        f"no free block of ports with a base in {BASE_PORT_SEARCH.start}-{BASE_PORT_SEARCH.stop}; pass --base-port"
    )


def plugin_files() -> Traversable:
    """The taskset package's directory, from a checkout or an installed scirl alike."""
    root = resources.files("scirl") / "assets" / "prime_rl" / PACKAGE_NAME
    if not (root / "pyproject.toml").is_file():
        raise FileNotFoundError(
            f"the prime-rl plug-in is missing from this scirl install ({root}); "
            "reinstall scirl from a checkout that has packages/sciknoweval"
        )
    return root


def toml_string(value: str) -> str:
    """``value`` as a TOML string literal, escaped by tomli_w."""
    return tomli_w.dumps({"k": value}).split("=", 1)[1].strip()


def scirl_source_entry(scirl_source: str) -> str:
    """The `[tool.uv.sources]` line that tells uv where scirl is (it is not on PyPI)."""
    if scirl_source.endswith(".whl"):
        return f"scirl = {{ path = {toml_string(scirl_source)} }}"
    return f"scirl = {{ path = {toml_string(scirl_source)}, editable = true }}"


# Where uv takes scirl from unless told otherwise: `deps/scirl` inside the prime-rl
# checkout, relative to the package's drop path, so no machine's path is written.
SCIRL_IN_CHECKOUT = "deps/scirl"
DEFAULT_SCIRL_SOURCE = "../../../../scirl"


def copy_package(dest: Path, scirl_source: str = DEFAULT_SCIRL_SOURCE) -> list[Path]:
    """Copy the taskset package to ``dest``, pointing its uv source for scirl at ``scirl_source``."""
    written: list[Path] = []

    def copy_tree(src: Traversable, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        for entry in sorted(src.iterdir(), key=lambda e: e.name):
            if entry.name in SKIPPED_NAMES or entry.name.endswith((".pyc", ".egg-info")):
                continue
            if entry.is_dir():
                copy_tree(entry, out / entry.name)
                continue
            target = out / entry.name
            target.write_bytes(entry.read_bytes())
            written.append(target)

    copy_tree(plugin_files(), dest)
    pyproject = dest / "pyproject.toml"
    text = pyproject.read_text(encoding="utf-8")
    if SCIRL_SOURCE_LINE not in text:
        raise RuntimeError(f"{pyproject} no longer has the line {SCIRL_SOURCE_LINE!r} that export rewrites")
    pyproject.write_text(text.replace(SCIRL_SOURCE_LINE, scirl_source_entry(scirl_source)), encoding="utf-8")
    return written


def zero_advantage_block(target: Target) -> str:
    """Keep zero-advantage rollouts, as the guide did (it only monitored them)."""
    if target.zero_advantage == "train_flag":
        return """\
[orchestrator.train]
# The guide kept zero-advantage rollouts (a monitor-only filter). This commit has
# no filter list; its nearest setting prunes them by default, so turn it off.
filter_zero_advantages = false
"""
    return """\
# The guide's filters as it wrote them: gibberish and repetition with this
# commit's defaults, zero_advantage monitor-only, so those rollouts are trained on.
[[orchestrator.post_batch_filters]]
type = "gibberish"

[[orchestrator.post_batch_filters]]
type = "repetition"

[[orchestrator.post_batch_filters]]
type = "zero_advantage"
enforce = false
"""


# What the taskset can do of scirl's [data] shuffle_options and [reward] mode. A task's prompt is fixed at
# load time and shared by its group, and the env server knows no step or sample index, so per-rollout
# orders and the random control (both keyed by them) have no equivalent there.
TASKSET_SHUFFLE_OPTIONS = ("none", "epoch")
TASKSET_REWARD_MODES = ("strict", "lenient", "format")


def check_taskset_settings(shuffle_options: str, reward_mode: str, algorithm: str = "grpo") -> None:
    """Raise ValueError for a scirl setting the prime-rl taskset cannot reproduce, saying what it can."""
    if algorithm not in algorithms.names() or not algorithms.exportable(algorithm):
        raise ValueError(
            f"algorithm {algorithm!r} cannot be exported: prime-rl's trainer has no counterpart for its "
            f"loss (the export writes its default loss, scirl's {algorithms.DEFAULT}); train it with scirl train"
        )
    if shuffle_options not in TASKSET_SHUFFLE_OPTIONS:
        raise ValueError(
            f"shuffle_options {shuffle_options!r} cannot be exported: in prime-rl a task has one prompt for "
            "its whole group, so only 'none' and 'epoch' (one order per question) are possible"
        )
    if reward_mode not in TASKSET_REWARD_MODES:
        raise ValueError(
            f"reward mode {reward_mode!r} cannot be exported: the env server knows no step or sample index "
            f"to draw a reproducible coin from; the taskset offers {', '.join(TASKSET_REWARD_MODES)}"
        )


# The taskset's keys that come from scirl's settings (``SciKnowEvalConfig``), with its defaults: scirl eval's flag names
# (--data-format, --split-seed, ...), so an export reads and splits --data as scirl train and scirl eval do.
TASKSET_DEFAULTS = {
    "data": None,
    "data_format": formats.AUTO,
    "data_columns": None,
    "eval_per_domain": DEFAULT_EVAL_PER_DOMAIN,
    "split_method": DEFAULT_SPLIT_METHOD,
    "split_seed": DEFAULT_SPLIT_SEED,
    "shuffle_options": "none",
    "reward_mode": "strict",
}
TASKSET_COMMENTS = {"shuffle_options": "one option order per question (scirl's epoch 0)"}


def taskset_settings(**settings) -> dict:
    """The taskset keys of ``settings`` that differ from its defaults (so the default export is the config
    prime-rl validated), in ``TASKSET_DEFAULTS``' order."""
    unknown = set(settings) - set(TASKSET_DEFAULTS)
    if unknown:
        raise TypeError(f"not taskset keys: {sorted(unknown)}")
    return {key: settings[key] for key, default in TASKSET_DEFAULTS.items() if settings.get(key, default) != default}


def taskset_lines(taskset: dict) -> str:
    """``taskset`` (``taskset_settings``) as TOML lines."""
    lines = ""
    for key, value in taskset.items():
        comment = f"   # {TASKSET_COMMENTS[key]}" if key in TASKSET_COMMENTS else ""
        lines += tomli_w.dumps({key: value}).strip() + comment + "\n"
    return lines


def check_data(
    data: str | None,
    *,
    data_format: str = formats.AUTO,
    data_columns: str | None = None,
    eval_per_domain: int = DEFAULT_EVAL_PER_DOMAIN,
    split_method: str = DEFAULT_SPLIT_METHOD,
    split_seed: int = DEFAULT_SPLIT_SEED,
) -> str | None:
    """Read ``data`` as ``scirl train`` reads it, before anything is written: a source that does not exist, or rows
    the format or columns cannot read, raise ``DataSourceError``, a train split without questions ``ValueError``.
    Returns a line on what the taskset will hold. A known set's hub id is not downloaded (the training node reads
    it), nor another hub id where the hub cannot be reached from here (the line says so)."""
    if data is None or formats.hub_source(data) is not None:
        return None
    try:
        splits = load_splits(
            data,
            eval_per_domain=eval_per_domain,
            split_method=split_method,
            seed=split_seed,
            data_format=data_format,
            columns=data_columns,
        )
    except HubUnreachable:
        return f"note: {data} not checked: the hub cannot be reached from here"
    if not splits.train:
        raise ValueError(
            f"the train split of {data} is empty ({len(splits.eval)} held out, "
            f"{sum(splits.skipped.values())} rows skipped): the taskset would have no task"
        )
    return (
        f"taskset: {len(splits.train)} train and {len(splits.eval)} held-out questions from {data} "
        f"({splits.data_format})"
    )


def grpo_toml(
    ports: Ports, taskset: dict | None = None, model: str = DEFAULT_MODEL, target: Target = TARGETS[DEFAULT_TARGET]
) -> str:
    """The run guide's step-7 config for ``target``, with every port moved to ``ports`` and the taskset's keys
    ``taskset`` (``taskset_settings``)."""
    taskset = taskset or {}
    check_taskset_settings(taskset.get("shuffle_options", "none"), taskset.get("reward_mode", "strict"))
    data_line = taskset_lines(taskset)
    router_metrics = f"its metrics port is this + {ROUTER_METRICS_OFFSET} ({ports.router_metrics})"
    return f"""\
# GRPO on SciKnowEval MCQ with prime-rl: the run guide's config (step 7), written by `scirl export prime-rl`.
# Target: prime-rl {target.name} at commit {target.commit} ({target.date}), verifiers {target.verifiers}.
# prime-rl rejects unknown keys and renames fields without aliases: use it with that commit.
max_steps = 400
seq_len = 4096

[deployment]
num_train_gpus = 2
num_infer_gpus = 6

[model]
name = {toml_string(model)}

# Ports: every port `rl` opens, moved off the defaults as one block (base {ports.base}),
# outside the ephemeral range, and free on the machine that exported this file.
# The NCCL weight broadcast must be set here, at the top level: prime-rl rebuilds
# trainer.weight_broadcast and orchestrator.weight_broadcast from this block, and
# overwrites per-side settings (default nccl on 29501).
[weight_broadcast]
type = "nccl"
port = {ports.nccl}

[rollout_transport]               # ZMQ rollouts to the trainer; the ready socket is port + 1
type = "zmq"
port = {ports.rollout}

[trainer.model]
attn = "flash_attention_2"        # FA2 nodes; FA3 nodes can drop this

[trainer.optim]
lr = 5e-6

[monitors.wandb]
project = "sciknoweval-scratch"
name = "qwen3-8b-grpo-scratch"

[orchestrator]
batch_size = 128
group_size = 16                   # 8 questions x 16 rollouts per step
env_server_base_port = {ports.env_servers}        # source i listens on this + i

[orchestrator.model.client]
base_url = {toml_string(ports.base_url)}   # must name inference.server.port

{zero_advantage_block(target)}
[orchestrator.train.sampling]
max_completion_tokens = 256

[[orchestrator.train.source]]
name = "sciknoweval"

[orchestrator.train.source.env.taskset]
id = "sciknoweval"                # the package at {DROP_PATH}
split = "train"
{data_line}
[orchestrator.train.source.env.agent.harness]
id = "null"

[orchestrator.train.source.env.agent.runtime]
type = "subprocess"

[orchestrator.renderer]
name = "prime-qwen3"

[ckpt]                             # checkpoint at the end of training

[inference]
backend_port = {ports.backend}               # the vLLM engine behind the router

[inference.server]
port = {ports.api}                       # the router; {router_metrics}

[inference.vllm]
data_parallel_size = 6             # must equal num_infer_gpus
data_parallel_rpc_port = {ports.dp_rpc}
"""


def check_command(taskset: dict) -> str:
    """The README's install check: loads the train split by id with the taskset's keys, as prime-rl's
    orchestrator does.

    The keys' values go through shlex.quote for the shell and repr for Python, so a
    path holding ``$(...)``, quotes or spaces stays a literal string.
    """
    args = "".join(f", {key}={value!r}" for key, value in taskset.items())
    code = (
        "import verifiers.v1 as vf\n"
        f"cfg = vf.taskset_config_type('sciknoweval')(id='sciknoweval'{args})\n"
        "print(len(list(vf.load_taskset(cfg))), 'train tasks')"
    )
    return f"uv run --no-sync python3 -c {shlex.quote(code)}"


def readme(ports: Ports, taskset: dict, scirl_source: str | None, target: Target) -> str:
    data = taskset.get("data")
    data_note = (
        f"The taskset reads its questions from `{data}`."
        if data
        else (
            "The taskset reads its questions from the hub; without hub access set `data` under "
            "`[orchestrator.train.source.env.taskset]` in `grpo.toml` to a local copy "
            "(a `raw_data/` directory or one `.jsonl`/`.json`/`.parquet` file)."
        )
    )
    if scirl_source is None:
        source_note = (
            f"scirl is not on PyPI: uv takes it from `{SCIRL_IN_CHECKOUT}` in the prime-rl checkout (the "
            "install below copies a scirl checkout there), or install it first and take the pip route."
        )
    else:
        source_note = (
            f"`sciknoweval/pyproject.toml` tells uv to take scirl from `{scirl_source}`; that path must "
            "exist on the training node."
        )
    scirl_copy = (
        "cp -r /path/to/scirl-checkout ~/prime-rl/" + SCIRL_IN_CHECKOUT + "   # where uv looks for scirl\n"
        if scirl_source is None
        else ""
    )
    port_rows = "\n".join(
        [
            f"| {ports.api} | router API (`inference.server.port`), the orchestrator's `base_url` "
            "| `[inference.server] port` and `[orchestrator.model.client] base_url`, together |",
            f"| {ports.backend} | vLLM engine behind the router; admin calls | `[inference] backend_port` |",
            f"| {ports.router_metrics} | router Prometheus metrics | none: always API port + {ROUTER_METRICS_OFFSET} |",
            f"| {ports.nccl} | NCCL weight broadcast, trainer and inference "
            "| top-level `[weight_broadcast] port` only |",
            f"| {ports.dp_rpc} | vLLM data-parallel RPC | `[inference.vllm] data_parallel_rpc_port` |",
            f"| {ports.rollout}, {ports.rollout + 1} | ZMQ rollout transport and its ready socket "
            "| top-level `[rollout_transport] port` |",
            f"| {ports.env_servers}+ | env servers, one per source (train, then eval) "
            "| `[orchestrator] env_server_base_port` |",
            "| any free | torchrun rendezvous | picked free by the launcher |",
        ]
    )
    return f"""\
# scirl's task in prime-rl

Written by `scirl export prime-rl` for **prime-rl {target.name}, commit `{target.commit[:9]}`
({target.date})**, whose verifiers is {target.verifiers}. prime-rl rejects unknown config
keys, so use this `grpo.toml` with that commit (re-export with `--prime-rl-ref guide` for
the run guide's commit `{TARGETS["guide"].commit[:9]}`, or `main` for `{TARGETS["main"].commit[:9]}`).
It follows the run guide's steps 3-9, with scirl's data, split, prompt and reward inside the
taskset, so results compare question for question with `scirl train` and `scirl eval`.

- `sciknoweval/`: the verifiers v1 taskset package (`id = "sciknoweval"`).
- `grpo.toml`: the guide's config (Qwen3-8B, 2 trainer + 6 inference GPUs, batch 128 = 8 x 16,
  lr 5e-6, 256 completion tokens, zero-advantage rollouts kept), every port moved to the block
  {ports.base}-{ports.base + 9} (+ {ports.router_metrics}).

{source_note} {data_note}

## Fresh node: install (run from this directory)

```bash
git clone --recurse-submodules https://github.com/PrimeIntellect-ai/prime-rl.git ~/prime-rl
cd ~/prime-rl && git checkout {target.commit[:9]} && git submodule update --init --recursive && cd -
{scirl_copy}mkdir -p ~/prime-rl/{DROP_PATH} && cp -r sciknoweval/. ~/prime-rl/{DROP_PATH}/
mkdir -p ~/prime-rl/{Path(CONFIG_PATH).parent} && cp grpo.toml ~/prime-rl/{CONFIG_PATH}
cd ~/prime-rl
{UV_SYNC}
```

Always re-specify every extra: a bare `uv sync` silently uninstalls flash-attn and vllm-router.
The package accepts prime-rl's own verifiers (its range holds both 0.3.1.devN and 0.4.x), so
the sync leaves it in place.

**pip route** (no uv workspace): install scirl first (it is not on PyPI), then the package,
into prime-rl's venv, both without dependencies so nothing of prime-rl's is re-resolved:

```bash
uv pip install --python .venv/bin/python --no-deps -e /path/to/scirl-checkout
uv pip install --python .venv/bin/python --no-deps -e {DROP_PATH}
```

(A plain `pip install ./sciknoweval` without scirl installed first fails with
`No matching distribution found for scirl`.)

Check it (expect {EXPECTED_TRAIN_TASKS:,} train tasks on the full dataset, {EXPECTED_EVAL_TASKS} held out):

```bash
{check_command(taskset)}
uv run --no-sync rl @ {CONFIG_PATH} --dry-run --output-dir /tmp/sciknoweval-dry-run
```

## Before launching

```bash
export WANDB_API_KEY=...      # the config logs to W&B (monitors.wandb); or drop [monitors.wandb]
export HF_TOKEN=...           # recommended: model and dataset downloads
ss -ltn | grep -E ':({"|".join(str(p) for p in ports.all().values())})\\b' || echo "all ports free"
```

The null harness runs its chat program with `uv` inside the env server's subprocess
runtime, so the node needs `uv` and package-index access (or a warm uv cache).

## Ports

The exporting machine checked every port below free; the training node may differ. Check
there (the `ss` line above) and re-export with `--base-port N` to move the whole block.
To move one port by hand, change its setting in `grpo.toml`. For the NCCL port use the
top-level `[weight_broadcast] port` (or `--weight-broadcast.port N`): prime-rl rebuilds both
sides from it and overwrites per-side settings such as `--trainer.weight-broadcast.port`.

| port | what | where to move it |
|---|---|---|
{port_rows}

## Launch

```bash
timeout --kill-after=60 1500 uv run --no-sync rl \\
    @ {CONFIG_PATH} \\
    --max-steps 30 \\
    --output-dir outputs/sciknoweval-grpo \\
    --run.name grpo-cold-start
```

Keep `--max-steps` well inside the timeout: the final checkpoint of an 8B model takes
about 10 minutes, and a timeout during it leaves an unloadable checkpoint.

## Evaluate

{eval_section(target)}
"""


def eval_section(target: Target) -> str:
    convert = """\
```bash
uv run --no-sync scirl dcp-to-hf outputs/sciknoweval-grpo/grpo-cold-start/checkpoints/step_30 \\
    --out outputs/sciknoweval-grpo/hf/step_30
uv run --no-sync vllm serve outputs/sciknoweval-grpo/hf/step_30 --served-model-name grpo-step30 \\
    --port 18000 --max-model-len 4096 &
until curl -s http://localhost:18000/v1/models >/dev/null; do sleep 5; done
uv run --no-sync scirl eval --base-url http://localhost:18000/v1 --model grpo-step30 --out eval-grpo.json
```"""
    if target.zero_advantage == "train_flag":
        return f"""\
This prime-rl writes only distributed (DCP) checkpoints, `checkpoints/step_N/trainer/`;
it no longer writes HF `weights/step_N/` (upstream PR #3316). Convert the final one to an HF
directory that `vllm serve` and `scirl eval` load (config and tokenizer come from the run's
model, `{DEFAULT_MODEL}` unless you changed it; pass `--base MODEL` to name another):

{convert}"""
    return f"""\
This prime-rl writes HF weights to `weights/step_N/` beside the DCP checkpoint: serve them
directly, or convert a DCP checkpoint the same way as for newer prime-rl:

{convert}"""


@dataclass
class Export:
    out: Path
    ports: Ports
    target: Target
    files: list[Path]

    @property
    def port(self) -> int:
        return self.ports.nccl


def export(
    out: str | Path,
    *,
    data: str | None = None,
    base_port: int | None = None,
    scirl_source: str | None = None,
    model: str = DEFAULT_MODEL,
    ref: str = DEFAULT_TARGET,
    force: bool = False,
    shuffle_options: str = "none",
    reward_mode: str = "strict",
    algorithm: str = "grpo",
    **data_settings,
) -> Export:
    """Write the package, grpo.toml and README.md under ``out``.

    ``data`` is read first (``check_data``, with ``data_settings``: data_format, data_columns, eval_per_domain,
    split_method, split_seed, the taskset's keys); one that names an existing local path is made absolute (the
    orchestrator runs from the prime-rl checkout). Unless ``scirl_source`` is given, uv takes scirl from
    ``deps/scirl`` in the prime-rl checkout: this machine's paths mean nothing on the training node.
    """
    if ref not in TARGETS:
        raise ValueError(f"unknown prime-rl ref {ref!r}; expected one of {', '.join(TARGETS)}")
    target = TARGETS[ref]
    check_taskset_settings(shuffle_options, reward_mode, algorithm)  # before anything is written
    out = Path(out)
    targets = [out / PACKAGE_NAME, out / "grpo.toml", out / "README.md"]
    existing = [str(t) for t in targets if t.exists()]
    if existing and not force:
        raise FileExistsError(f"already exported here: {', '.join(existing)} (--force overwrites them)")
    taskset = taskset_settings(data=data, shuffle_options=shuffle_options, reward_mode=reward_mode, **data_settings)
    checked = check_data(data, **data_settings)
    if checked:
        print(checked, file=sys.stderr)
    if data is not None and Path(data).expanduser().exists():
        taskset["data"] = str(Path(data).expanduser().resolve())
    ports = choose_ports(base_port)
    local_low, local_high = local_ephemeral_range()
    inside = [p for p in ports.all().values() if local_low <= p <= local_high]
    if inside:
        print(
            f"note: this machine's ephemeral port range {local_low}-{local_high} holds ports {inside}; "
            f"the export assumes the Linux default {EPHEMERAL_RANGE[0]}-{EPHEMERAL_RANGE[1]} on the training "
            "node (check `sysctl net.ipv4.ip_local_port_range` there)",
            file=sys.stderr,
        )
    out.mkdir(parents=True, exist_ok=True)
    files = copy_package(out / PACKAGE_NAME, scirl_source or DEFAULT_SCIRL_SOURCE)
    for path, text in (
        (out / "grpo.toml", grpo_toml(ports, taskset, model, target)),
        (out / "README.md", readme(ports, taskset, scirl_source, target)),
    ):
        path.write_text(text, encoding="utf-8")
        files.append(path)
    return Export(out=out, ports=ports, target=target, files=files)
