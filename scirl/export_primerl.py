"""`scirl export prime-rl`: everything needed to train on scirl's task with vanilla prime-rl.

The output directory holds
- ``sciknoweval/``: the verifiers taskset package, to drop at
  ``deps/prime-envs/environments/science/sciknoweval`` in a prime-rl checkout;
- ``grpo.toml``: the run guide's config (step 7), with a free NCCL
  weight-broadcast port set on both the trainer and the orchestrator;
- ``README.md``: the exact install and launch commands.

The package's files ship inside scirl (``scirl/assets/prime_rl/sciknoweval`` is
a link to ``packages/sciknoweval`` in a checkout, and setuptools copies the
files into the wheel), so an installed scirl exports the same files as a checkout.
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

import tomli_w

PACKAGE_NAME = "sciknoweval"
DROP_PATH = "deps/prime-envs/environments/science/sciknoweval"
CONFIG_PATH = "examples/basic/sciknoweval/grpo.toml"
DEFAULT_MODEL = "PrimeIntellect/Qwen3-8B"
# Every extra spelled out: a uv sync without one silently uninstalls it (guide, gotcha 1).
UV_SYNC = "uv sync --all-packages --extra flash-attn --extra disagg"
# The line in the package's pyproject that `export` rewrites for the target machine.
SCIRL_SOURCE_LINE = 'scirl = { path = "../..", editable = true }'
SKIPPED_NAMES = {"__pycache__", ".pytest_cache", "build", "dist"}


def plugin_files() -> Traversable:
    """The taskset package's directory, from a checkout or an installed scirl alike."""
    root = resources.files("scirl") / "assets" / "prime_rl" / PACKAGE_NAME
    if not (root / "pyproject.toml").is_file():
        raise FileNotFoundError(
            f"the prime-rl plug-in is missing from this scirl install ({root}); "
            "reinstall scirl from a checkout that has packages/sciknoweval"
        )
    return root


def scirl_checkout() -> Path | None:
    """The source checkout this scirl runs from, if it runs from one (editable install)."""
    import scirl

    root = Path(scirl.__file__).resolve().parent.parent
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and 'name = "scirl"' in pyproject.read_text(encoding="utf-8"):
        return root
    return None


def free_port(requested: int | None = None) -> int:
    """A TCP port nothing listens on here: the requested one, checked, or one the OS picks.

    The bind is on all interfaces and without SO_REUSEADDR, so a port still in
    TIME_WAIT from a previous run also counts as taken (guide, gotcha 5).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", requested or 0))
        except OSError as e:
            raise ValueError(f"port {requested} is not free on this machine ({e.strerror}); pick another") from e
        return sock.getsockname()[1]


def toml_string(value: str) -> str:
    """``value`` as a TOML string literal, escaped by tomli_w."""
    return tomli_w.dumps({"k": value}).split("=", 1)[1].strip()


def scirl_source_entry(scirl_source: str | None) -> str | None:
    """The `[tool.uv.sources]` line that tells uv where scirl is (it is not on PyPI)."""
    if scirl_source is None:
        return None
    if scirl_source.endswith(".whl"):
        return f"scirl = {{ path = {toml_string(scirl_source)} }}"
    return f"scirl = {{ path = {toml_string(scirl_source)}, editable = true }}"


def copy_package(dest: Path, scirl_source: str | None) -> list[Path]:
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
    entry = scirl_source_entry(scirl_source)
    if entry is None:
        text = text.replace(SCIRL_SOURCE_LINE, "# scirl = { path = \"/path/to/scirl\", editable = true }  # set this")
    else:
        text = text.replace(SCIRL_SOURCE_LINE, entry)
    pyproject.write_text(text, encoding="utf-8")
    return written


def grpo_toml(port: int, data: str | None = None, model: str = DEFAULT_MODEL) -> str:
    """The run guide's step-7 config, with the NCCL weight-broadcast port pinned on both sides."""
    data_line = f"data = {toml_string(data)}\n" if data is not None else ""
    return f"""\
# GRPO on SciKnowEval MCQ with prime-rl: the run guide's config (step 7), written by `scirl export prime-rl`.
max_steps = 400
seq_len = 4096

[deployment]
num_train_gpus = 2
num_infer_gpus = 6

[model]
name = {toml_string(model)}

[trainer.model]
attn = "flash_attention_2"        # FA2 nodes; FA3 nodes can drop this

[trainer.optim]
lr = 5e-6

# The NCCL weight-broadcast rendezvous defaults to port 29501, which collides
# between back-to-back runs. The port below was free when exported; `type` must
# be set beside it, on both sides, or a different union variant is resolved.
[trainer.weight_broadcast]
type = "nccl"
port = {port}

[monitors.wandb]
project = "sciknoweval-scratch"
name = "qwen3-8b-grpo-scratch"

[orchestrator]
batch_size = 128
group_size = 16                   # 8 questions x 16 rollouts per step

[orchestrator.weight_broadcast]   # the same port as the trainer's
type = "nccl"
port = {port}

# Monitor degenerate all-zero groups instead of aborting on them.
[[orchestrator.post_batch_filters]]
type = "gibberish"

[[orchestrator.post_batch_filters]]
type = "repetition"

[[orchestrator.post_batch_filters]]
type = "zero_advantage"
enforce = false

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

[inference.vllm]
data_parallel_size = 6             # must equal num_infer_gpus
"""


def readme(port: int, data: str | None, scirl_source: str | None) -> str:
    data_note = f"The taskset reads its questions from `{data}`." if data else (
        "The taskset reads its questions from the hub (set `data` under "
        "`[orchestrator.train.source.env.taskset]` to use local files)."
    )
    data_arg = f", data={data!r}" if data else ""
    source_note = (
        f"The package's `pyproject.toml` tells uv to take scirl from `{scirl_source}`; "
        "that path must exist on the training node (re-export with `--scirl-source` otherwise)."
        if scirl_source
        else "**Set scirl's location first:** scirl is not on PyPI, so edit the `[tool.uv.sources]` "
        "line in `sciknoweval/pyproject.toml` to point at a scirl checkout or wheel on the training node."
    )
    return f"""\
# scirl's task in prime-rl

Written by `scirl export prime-rl`. It follows the run guide's steps 3-8, with scirl's
data, split, prompt and reward inside the taskset, so results compare question for
question with `scirl train` and `scirl eval`.

- `sciknoweval/`: the verifiers v1 taskset package (`id = "sciknoweval"`).
- `grpo.toml`: the guide's config; NCCL weight broadcast on port {port}, set on both sides.

{source_note} {data_note}

## Install (in the prime-rl checkout)

```bash
mkdir -p ~/prime-rl/{DROP_PATH} && cp -r sciknoweval/. ~/prime-rl/{DROP_PATH}/
mkdir -p ~/prime-rl/{Path(CONFIG_PATH).parent} && cp grpo.toml ~/prime-rl/{CONFIG_PATH}
cd ~/prime-rl
{UV_SYNC}
```

Always re-specify every extra: a bare `uv sync` silently uninstalls flash-attn and vllm-router.

Check it:

```bash
uv run --no-sync python3 -c "
import verifiers.v1 as vf
from sciknoweval import SciKnowEvalConfig, SciKnowEvalTaskset
print(len(SciKnowEvalTaskset(SciKnowEvalConfig(task=vf.TaskConfig(){data_arg})).load()), 'train tasks')"
```

## Launch

```bash
ss -ltnp | grep -w {port} || echo "port {port} is free"
timeout --kill-after=60 1500 uv run --no-sync rl \\
    @ {CONFIG_PATH} \\
    --max-steps 30 \\
    --output-dir outputs/sciknoweval-grpo \\
    --run.name grpo-cold-start
```

The port was checked free on the machine that ran the export. If that is not the
training node, check it there (the line above), or override it on both sides:
`--trainer.weight-broadcast.type nccl --trainer.weight-broadcast.port N
--orchestrator.weight-broadcast.type nccl --orchestrator.weight-broadcast.port N`.

Keep `--max-steps` well inside the timeout: the final checkpoint of an 8B model takes
about 10 minutes, and a timeout during it leaves an unloadable checkpoint.
"""


@dataclass
class Export:
    out: Path
    port: int
    files: list[Path]


def export(
    out: str | Path,
    *,
    data: str | None = None,
    port: int | None = None,
    scirl_source: str | None = None,
    model: str = DEFAULT_MODEL,
    force: bool = False,
) -> Export:
    """Write the package, grpo.toml and README.md under ``out``.

    ``data`` that names an existing local path is made absolute (the orchestrator
    runs from the prime-rl checkout). ``scirl_source`` defaults to the checkout
    this scirl runs from, if any.
    """
    out = Path(out)
    targets = [out / PACKAGE_NAME, out / "grpo.toml", out / "README.md"]
    existing = [str(t) for t in targets if t.exists()]
    if existing and not force:
        raise FileExistsError(f"already exported here: {', '.join(existing)} (pass force=True / --force to overwrite)")
    if data is not None and Path(data).expanduser().exists():
        data = str(Path(data).expanduser().resolve())
    if scirl_source is None:
        checkout = scirl_checkout()
        scirl_source = str(checkout) if checkout is not None else None
    chosen = free_port(port)
    out.mkdir(parents=True, exist_ok=True)
    files = copy_package(out / PACKAGE_NAME, scirl_source)
    for path, text in ((out / "grpo.toml", grpo_toml(chosen, data, model)), (out / "README.md", readme(chosen, data, scirl_source))):
        path.write_text(text, encoding="utf-8")
        files.append(path)
    if scirl_source is None:
        print("warning: scirl runs from no checkout; set its location in "
              f"{out / PACKAGE_NAME / 'pyproject.toml'} before `uv sync` (see README.md)", file=sys.stderr)
    return Export(out=out, port=chosen, files=files)
