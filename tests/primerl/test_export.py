"""The prime-rl plug-in's `scirl export prime-rl`: the grpo.toml prime-rl validated (recorded fixtures), its ports,
the package, config and README it writes, its check command, and an export from an installed scirl wheel."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
import verifiers.v1 as vf
from sciknoweval import SciKnowEvalConfig

from helpers.taskset import EVAL_PER_DOMAIN, PACKAGE_DIR, REPO, load
from scirl.cli import main as cli_main
from scirl.primerl.export import (
    BASE_PORT_SEARCH,
    DEFAULT_EPHEMERAL_RANGE,
    DEFAULT_MODEL,
    DEFAULT_TARGET,
    DROP_PATH,
    EXPECTED_TRAIN_TASKS,
    TARGETS,
    UV_SYNC,
    Ports,
    choose_ports,
    grpo_toml,
    port_is_free,
)
from scirl.synth.questions import write_jsonl

# prime-rl is not on PyPI, so its resolution of the exported grpo.toml is recorded
# by scripts/check_primerl_config.sh (prime-rl's own RLConfig, at the commit named in
# each fixture) and checked here. A change to the export fails these tests until the
# fixtures are recorded again against prime-rl.

FIXTURES = {
    path.stem: json.loads(path.read_text())
    for path in sorted((REPO / "tests" / "helpers" / "fixtures").glob("primerl_*.json"))
}
# Where prime-rl took each resolved value from, in the exported TOML (checked against the fixtures below).
FACT_SOURCES = {
    "trainer.weight_broadcast.port": "weight_broadcast.port",
    "orchestrator.weight_broadcast.port": "weight_broadcast.port",
    "inference.server.port": "inference.server.port",
    "inference.backend_port": "inference.backend_port",
    "inference.vllm.data_parallel_rpc_port": "inference.vllm.data_parallel_rpc_port",
    "trainer.rollout_transport.port": "rollout_transport.port",
    "orchestrator.rollout_transport.port": "rollout_transport.port",
    "orchestrator.env_server_base_port": "orchestrator.env_server_base_port",
    "orchestrator.model.client.base_url": "orchestrator.model.client.base_url",
}
PORT_FACTS = [
    "trainer.weight_broadcast.port",
    "inference.server.port",
    "inference.backend_port",
    "router_metrics_port",
    "inference.vllm.data_parallel_rpc_port",
    "orchestrator.rollout_transport.port",
    "rollout_ready_port",
]


def lookup(table: dict, dotted: str):
    for key in dotted.split("."):
        table = table[key]
    return table


def without(table: dict, dotted_paths) -> dict:
    table = json.loads(json.dumps(table))
    for dotted in dotted_paths:
        *parents, last = dotted.split(".")
        lookup(table, ".".join(parents)).pop(last) if parents else table.pop(last)
    return table


def exported_toml(base: int, ref: str) -> dict:
    return tomllib.loads(grpo_toml(Ports(base), target=TARGETS[ref]))


def test_export_with_shuffle_and_a_control_reward(data_file, tmp_path):
    out = tmp_path / "export"
    assert (
        cli_main(
            [
                "export",
                "prime-rl",
                "--out",
                str(out),
                "--data",
                str(data_file),
                "--shuffle-options",
                "epoch",
                "--reward-mode",
                "format",
            ]
        )
        == 0
    )
    cfg = tomllib.loads((out / "grpo.toml").read_text())
    taskset = cfg["orchestrator"]["train"]["source"][0]["env"]["taskset"]
    assert taskset == {
        "id": "sciknoweval",
        "split": "train",
        "data": str(data_file.resolve()),
        "shuffle_options": "epoch",
        "reward_mode": "format",
    }
    config = SciKnowEvalConfig.model_validate(taskset)
    tasks = list(vf.load_taskset(config.model_copy(update={"eval_per_domain": EVAL_PER_DOMAIN})))
    assert tasks and all(t.data.option_order is not None and t.data.reward_mode == "format" for t in tasks)
    # only the taskset differs from the default export, which prime-rl validated (fixtures)
    base = cfg["inference"]["server"]["port"]
    assert without(cfg, ["orchestrator.train.source"]) == without(
        exported_toml(base, "main"), ["orchestrator.train.source"]
    )


def test_fixtures_cover_every_target_at_its_commit():
    assert sorted((f["prime_rl_ref"], f["prime_rl_commit"]) for f in FIXTURES.values()) == sorted(
        (t.name, t.commit) for t in TARGETS.values()
    )
    assert TARGETS[DEFAULT_TARGET].name == "main"


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_export_is_the_config_prime_rl_validated(name):
    fixture = FIXTURES[name]
    assert exported_toml(fixture["base_port"], fixture["prime_rl_ref"]) == fixture["exported"]


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_every_key_written_is_a_field_of_prime_rl_at_the_target_commit(name):
    fixture = FIXTURES[name]
    fields = fixture["fields"]

    def walk(table: dict, path: str) -> None:
        for key, value in table.items():
            if path:
                assert key in fields[path], f"{path}.{key} is not a field at prime-rl {fixture['prime_rl_commit'][:9]}"
            if path.endswith(".env") and key == "taskset":
                continue  # validated by our own config class
            if isinstance(value, list) and value and isinstance(value[0], dict):
                for item in value:
                    walk(item, f"{path}.{key}" if path else key)
            elif isinstance(value, dict):
                walk(value, f"{path}.{key}" if path else key)

    walk(exported_toml(10_500, fixture["prime_rl_ref"]), "")
    # the guide's filter list is no field any more at main, and main's flag was none at the guide's commit
    if fixture["prime_rl_ref"] == "main":
        assert "post_batch_filters" not in fields["orchestrator"]
        assert "filter_zero_advantages" in fields["orchestrator.train"]
    else:
        assert "filter_zero_advantages" not in fields["orchestrator.train"]


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_prime_rl_resolves_every_port_to_the_exported_block(name):
    fixture = FIXTURES[name]
    resolved, defaults, exported = fixture["resolved"], fixture["defaults"], fixture["exported"]
    ports = Ports(fixture["base_port"])
    # prime-rl took each port from the top-level / per-component setting the export writes
    for fact, source in FACT_SOURCES.items():
        assert resolved[fact] == lookup(exported, source), fact
    # so another base port moves the same settings and nothing else
    other = Ports(fixture["base_port"] + 500)
    moved = exported_toml(other.base, fixture["prime_rl_ref"])
    assert without(moved, set(FACT_SOURCES.values())) == without(exported, set(FACT_SOURCES.values()))
    assert [
        lookup(moved, s)
        for s in ("weight_broadcast.port", "inference.server.port", "orchestrator.model.client.base_url")
    ] == [other.nccl, other.api, other.base_url]

    # the NCCL port is the exported one on both sides, not the 29501 default
    assert resolved["trainer.weight_broadcast.port"] == resolved["orchestrator.weight_broadcast.port"] == ports.nccl
    assert resolved["trainer.weight_broadcast.type"] == resolved["orchestrator.weight_broadcast.type"] == "nccl"
    assert defaults["trainer.weight_broadcast.port"] == 29501
    # every port prime-rl opens is moved off its default, distinct, outside the ephemeral range
    opened = [resolved[f] for f in PORT_FACTS] + resolved["env_server_ports"]
    assert opened == [
        ports.nccl,
        ports.api,
        ports.backend,
        ports.router_metrics,
        ports.dp_rpc,
        ports.rollout,
        ports.rollout + 1,
        ports.env_servers,
    ]
    assert (
        resolved["router_metrics_port"]
        == resolved["inference.server.port"] + fixture["launcher_constants"]["router_metrics_offset"]
    )
    assert all(resolved[f] != defaults[f] for f in PORT_FACTS)
    assert len(set(opened)) == len(opened)
    low, high = DEFAULT_EPHEMERAL_RANGE
    assert not any(low <= p <= high for p in opened)
    assert set(opened) <= set(ports.all().values())
    # the client talks to the router's port and its admin calls go to the engine
    assert resolved["orchestrator.model.client.base_url"] == f"http://localhost:{ports.api}/v1"
    assert resolved["orchestrator.model.client.admin_base_url"] == [f"http://localhost:{ports.backend}/v1"]


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_prime_rl_resolves_the_guides_run(name):
    resolved, defaults = FIXTURES[name]["resolved"], FIXTURES[name]["defaults"]
    assert (
        resolved["trainer.model.name"]
        == resolved["orchestrator.model.name"]
        == resolved["inference.vllm.model"]
        == DEFAULT_MODEL
    )
    assert (resolved["orchestrator.batch_size"], resolved["orchestrator.group_size"]) == (128, 16)
    assert resolved["trainer.optim.lr"] == 5e-6
    assert resolved["seq_len"] == [4096, 4096]
    assert resolved["orchestrator.train.sampling.max_completion_tokens"] == 256
    assert resolved["deployment"] == [2, 6] and resolved["inference.vllm.data_parallel_size"] == 6
    assert resolved["max_steps"] == [30, 30]  # the README's --max-steps 30 over the file's 400
    assert resolved["taskset"] == "SciKnowEvalConfig"
    # zero-advantage rollouts are trained on, as in the guide, where prime-rl's default drops them
    if FIXTURES[name]["prime_rl_ref"] == "main":
        assert resolved["orchestrator.train.filter_zero_advantages"] is False
        assert defaults["orchestrator.train.filter_zero_advantages"] is True
    else:
        filters = resolved["orchestrator.post_batch_filters"]
        assert [f["type"] for f in filters] == ["gibberish", "repetition", "zero_advantage"]
        assert filters[2] == {"type": "zero_advantage", "enforce": False}
        assert defaults["orchestrator.post_batch_filters"][2] == {"type": "zero_advantage", "enforce": True}


def test_package_accepts_prime_rls_own_verifiers_and_the_pypi_releases():
    from packaging.requirements import Requirement

    deps = tomllib.loads((PACKAGE_DIR / "pyproject.toml").read_text())["project"]["dependencies"]
    [spec] = [Requirement(d).specifier for d in deps if Requirement(d).name == "verifiers"]
    versions = {f["prime_rl_ref"]: f["verifiers"] for f in FIXTURES.values()}
    assert versions == {"main": "0.3.1.dev62", "guide": "0.3.1.dev42"}  # as prime-rl's submodule builds them
    for version in [*versions.values(), "0.4.0", "0.4.7"]:
        assert spec.contains(version, prereleases=True), version
    assert not spec.contains("0.5.0", prereleases=True)


def test_export_writes_package_config_and_readme(data_file, tmp_path):
    out = tmp_path / "export"
    assert cli_main(["export", "prime-rl", "--out", str(out), "--data", str(data_file)]) == 0

    for rel in ("sciknoweval/__init__.py", "sciknoweval/taskset.py", "README.md"):
        assert (out / "sciknoweval" / rel).read_bytes() == (PACKAGE_DIR / rel).read_bytes()
    assert not list((out / "sciknoweval").rglob("__pycache__"))
    package_text = (out / "sciknoweval" / "pyproject.toml").read_text()
    package_toml = tomllib.loads(package_text)
    assert package_toml["project"]["name"] == "sciknoweval"
    # uv takes scirl from deps/scirl in the prime-rl checkout: no path of the exporting machine
    drop = Path("/prime-rl") / DROP_PATH
    scirl_source = package_toml["tool"]["uv"]["sources"]["scirl"]
    assert (drop / scirl_source["path"]).resolve() == Path("/prime-rl/deps/scirl")
    assert str(REPO) not in package_text and str(tmp_path) not in package_text

    cfg = tomllib.loads((out / "grpo.toml").read_text())
    [source] = cfg["orchestrator"]["train"]["source"]
    assert source["env"]["taskset"] == {"id": "sciknoweval", "split": "train", "data": str(data_file.resolve())}
    SciKnowEvalConfig.model_validate(source["env"]["taskset"])
    base = cfg["inference"]["server"]["port"]
    assert without(cfg, ["orchestrator.train.source"]) == without(
        exported_toml(base, "main"), ["orchestrator.train.source"]
    )
    ports = Ports(base)
    assert all(port_is_free(p) for p in ports.all().values())
    assert "559b44772e471d1538537b8805cc77f3824a5e64" in (out / "grpo.toml").read_text()

    text = (out / "README.md").read_text()
    for needed in (
        UV_SYNC,
        "uv run --no-sync rl",
        "--max-steps 30",
        DROP_PATH,
        "WANDB_API_KEY",
        "559b447",
        f"{EXPECTED_TRAIN_TASKS:,} train tasks",
        "scirl dcp-to-hf",
        "vllm serve",
        "scirl eval",
        "install scirl first",
        "--no-deps",
        "deps/scirl",
        "uv` and package-index access",
    ):
        assert needed in text, needed
    for port in ports.all().values():
        assert str(port) in text

    # a second export refuses to overwrite unless told to
    assert cli_main(["export", "prime-rl", "--out", str(out)]) == 2
    assert cli_main(["export", "prime-rl", "--out", str(out), "--force", "--prime-rl-ref", "guide"]) == 0
    guide = tomllib.loads((out / "grpo.toml").read_text())
    assert "data" not in guide["orchestrator"]["train"]["source"][0]["env"]["taskset"]
    assert "post_batch_filters" in guide["orchestrator"] and "c7a6573" in (out / "README.md").read_text()


def test_export_base_port_is_checked(tmp_path, capsys):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        # a block whose NCCL port is taken
        if 1024 <= taken - 2 and taken + 21000 - 2 <= 65535 and not DEFAULT_EPHEMERAL_RANGE[0] <= taken + 21000 - 2:
            assert cli_main(["export", "prime-rl", "--out", str(tmp_path / "a"), "--base-port", str(taken - 2)]) == 2
            assert "not free" in capsys.readouterr().err
        # ports in the ephemeral range, or past 65535, are refused whether free or not
        for base in (40000, 20000, 60000):
            assert cli_main(["export", "prime-rl", "--out", str(tmp_path / "a"), "--base-port", str(base)]) == 2
            err = capsys.readouterr().err
            assert err.startswith("scirl export: base port") and err.count("\n") == 1
        assert not (tmp_path / "a" / "grpo.toml").exists()
    chosen = choose_ports()
    assert cli_main(["export", "prime-rl", "--out", str(tmp_path / "b"), "--base-port", str(chosen.base)]) == 0
    cfg = tomllib.loads((tmp_path / "b" / "grpo.toml").read_text())
    assert cfg["weight_broadcast"] == {"type": "nccl", "port": chosen.nccl}
    assert cfg["inference"]["server"]["port"] == chosen.api


def test_export_default_ports_skip_a_taken_block(tmp_path):
    first = choose_ports()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("", first.rollout))
        busy.listen()
        assert choose_ports().base > first.base
    assert first.base in BASE_PORT_SEARCH


@pytest.mark.slow
def test_readme_check_command_keeps_a_hostile_data_path_literal(data_file, tmp_path):
    """The README's check line runs `$(...)` from --data nowhere: quoted for the shell and for Python."""
    hostile = tmp_path / "$(touch pwned)" / "it's `here`"
    hostile.mkdir(parents=True)
    rows = hostile / "rows.jsonl"
    shutil.copy(data_file, rows)
    out = tmp_path / "export"
    assert cli_main(["export", "prime-rl", "--out", str(out), "--data", str(rows)]) == 0
    [line] = [ln for ln in (out / "README.md").read_text().split("```bash\n")[3].split("\nuv run --no-sync rl")[:1]]
    assert line.startswith("uv run --no-sync python3 -c ")
    # run it as pasted, with `uv run --no-sync python3` standing for this interpreter
    script = f'uv() {{ shift 3; {shlex.quote(sys.executable)} "$@"; }}\n{line}\n'
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE_DIR), str(REPO)])}
    result = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert not list(tmp_path.rglob("pwned"))
    expected = len(list(vf.load_taskset(SciKnowEvalConfig(id="sciknoweval", data=str(rows)))))
    assert result.stdout.strip() == f"{expected} train tasks"


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PRIME_RL_CHECKOUT"), reason="set PRIME_RL_CHECKOUT to a prime-rl checkout")
def test_check_script_against_a_prime_rl_checkout():
    """CI with a prime-rl checkout: validate a fresh export with prime-rl's own config classes."""
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "check_primerl_config.sh"), os.environ["PRIME_RL_CHECKOUT"]],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAIL" not in result.stdout


@pytest.mark.slow
def test_export_works_from_an_installed_scirl_wheel(data_file, tmp_path):
    """Built as a wheel and installed (unpacked) elsewhere, scirl still ships the plug-in's files."""
    pytest.importorskip("setuptools", minversion="70.1")  # builds wheels without the `wheel` package
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "scirl", src / "scirl", symlinks=True, ignore=ignore)
    shutil.copytree(PACKAGE_DIR, src / "packages" / "sciknoweval", ignore=ignore)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            ".",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
        ],
        cwd=src,
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = (tmp_path / "dist").glob("scirl-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)

    out = tmp_path / "export"
    code = (
        "import sys, scirl; from pathlib import Path\n"
        f"assert Path(scirl.__file__).is_relative_to({str(site)!r}), scirl.__file__\n"
        "from scirl.cli import main\n"
        f"sys.exit(main(['export', 'prime-rl', '--out', {str(out)!r}, '--data', {str(data_file)!r}]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    for rel in ("sciknoweval/__init__.py", "sciknoweval/taskset.py", "README.md"):
        assert (out / "sciknoweval" / rel).read_bytes() == (PACKAGE_DIR / rel).read_bytes()
    tomllib.loads((out / "grpo.toml").read_text())

    # the exported package itself imports and loads tasks
    code = (
        f"import sys; sys.path.insert(0, {str(out / 'sciknoweval')!r})\n"
        "import verifiers.v1 as vf, sciknoweval\n"
        f"assert sciknoweval.__file__.startswith({str(out)!r})\n"
        f"cfg = sciknoweval.SciKnowEvalConfig(id='sciknoweval', data={str(data_file)!r}, eval_per_domain=5)\n"
        "print(len(list(vf.load_taskset(cfg))))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) == len(load(data_file))


def test_export_reads_the_data_as_scirl_train_does_and_passes_its_format_on(tmp_path, capsys):
    """`--data` that does not exist was written into grpo.toml (exit 0); a format or a column mapping could not be
    passed on. Now the export reads --data first (one line, exit 2, nothing written) and the taskset gets the
    format, the columns and the split settings, under scirl eval's names for them."""
    from scirl.synth import other_formats as synthetic_formats

    missing = tmp_path / "missing.jsonl"
    assert cli_main(["export", "prime-rl", "--out", str(tmp_path / "x"), "--data", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("scirl export:") and str(missing) in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()

    arc = write_jsonl(synthetic_formats.generate_format_rows("arc", n=60, seed=1), tmp_path / "arc.jsonl")
    out = tmp_path / "export"
    columns = "question=question,options=choices,answer=answerKey"
    assert (
        cli_main(
            [
                "export",
                "prime-rl",
                "--out",
                str(out),
                "--data",
                str(arc),
                "--data-columns",
                columns,
                "--eval-per-domain",
                str(EVAL_PER_DOMAIN),
                "--split-seed",
                "3",
            ]
        )
        == 0
    )
    assert "taskset:" in capsys.readouterr().err
    taskset = tomllib.loads((out / "grpo.toml").read_text())["orchestrator"]["train"]["source"][0]["env"]["taskset"]
    assert taskset == {
        "id": "sciknoweval",
        "split": "train",
        "data": str(arc.resolve()),
        "data_columns": columns,
        "eval_per_domain": EVAL_PER_DOMAIN,
        "split_seed": 3,
    }
    exported = [t.data.qid for t in vf.load_taskset(SciKnowEvalConfig.model_validate(taskset))]
    assert exported == [t.data.qid for t in load(arc, data_columns=columns, split_seed=3)]
    assert "split_seed=3" in (out / "README.md").read_text()  # the install check loads the same tasks
    assert (
        cli_main(["export", "prime-rl", "--out", str(out), "--force", "--data", str(arc), "--data-format", "arc"]) == 0
    )
    taskset = tomllib.loads((out / "grpo.toml").read_text())["orchestrator"]["train"]["source"][0]["env"]["taskset"]
    assert taskset["data_format"] == "arc" and "data_columns" not in taskset
