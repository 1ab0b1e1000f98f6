"""Checks made before a deployment starts anything: packages, GPUs, disk (the servers' weight-transfer
support is asked once they are up, in ``launch``). Each failure is a ``PreflightError``: one line
ending with the fix.

A failure found here costs a second; found by the trainer after the servers took minutes to load, or
by a checkpoint write hours in, it costs the run.

torch is imported inside the checks that ask it about GPUs, not at the top: the launcher of a CPU run (and
every launcher until it asks) never needs its ~2.5 s of import.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from scirl import algorithms, extras, hub
from scirl.errors import PreflightError

BUSY_GPU_MIB = 2048  # more memory in use than a driver and an idle context take: another job holds the GPU
CHECKPOINT_BYTES_PER_PARAM = 4 + 8  # the trainer state: float32 master weights + AdamW's two float32 moments
BROADCAST_BYTES_PER_PARAM = 2  # filesystem weight sync: one bfloat16 copy per published step
BROADCAST_DIRS = 2  # the step the servers load while the next one is written
WRITE_BYTES_PER_S = 200e6  # a conservative local-disk write rate, for the checkpoint's time budget


@dataclass(frozen=True)
class GpuPlan:
    infer: list[str]  # CUDA_VISIBLE_DEVICES entries for the servers
    train: list[str]  # and for the trainer


def on_cuda(device: str) -> bool:
    if device == "cpu":
        return False
    import torch

    available = torch.cuda.is_available()
    if device.startswith("cuda") and not available:
        raise PreflightError(
            f"device {device}: no CUDA device is available here; fix: --device cpu, or run on a GPU machine"
        )
    return available


def check_model(model: str) -> None:
    """A model that is not there, refused before anything loads: a local directory must exist and hold an HF model
    (its config.json); a name that is neither one nor a hub id (``owner/name``) is refused. A hub id is left to the
    loader (the hub or its cache), unless its first part is a directory here: then it is a path that is missing."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise PreflightError(
                f"model {model}: the directory holds no config.json, so no Hugging Face model; "
                "fix: --model DIR with a model saved by save_pretrained, or a hub id"
            )
        return
    if path.exists():
        raise PreflightError(f"model {model} is a file; fix: --model a model directory or a hub id")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    where = "" if path.is_absolute() else f" (from {Path.cwd()})"
    try:
        validate_repo_id(model)
    except HFValidationError:
        raise PreflightError(
            f"model {model}: no such directory{where}, and not a hub id (owner/name); "
            "fix: --model an existing model directory or a hub id"
        ) from None
    if Path(model.split("/")[0]).is_dir():
        raise PreflightError(
            f"model {model}: no such directory{where}; fix: --model an existing model directory, or a hub id"
        )


def check_hub_model(model: str) -> None:
    """A hub model id that the hub cannot give now, refused in seconds: without this the loaders retry for a minute
    before failing (``scirl.hub``). Under ``HF_HUB_OFFLINE`` the local cache alone answers, and nothing is asked."""
    if Path(model).expanduser().exists():
        return
    cached = hub_model_config(model, download=False) is not None
    if hub.offline():
        problem = None if cached else "its config.json is not there"
    else:
        problem = hub.probe(f"models/{model}")
    if problem is not None:
        raise PreflightError(
            hub.unreachable(
                f"model {model!r}",
                problem,
                "--model a local model directory (one saved by save_pretrained)",
                cached=cached,
            )
        )


def hub_model_config(model: str, download: bool = True) -> Path | None:
    """A hub model's ``config.json``: from the local cache, else (``download``) from the hub when it answers within
    seconds; None when neither has it. A command that only sizes the model (``scirl slurm``) never waits on it."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(model, "config.json")
    except ValueError:  # not a repository id
        return None
    if isinstance(cached, str):
        return Path(cached)
    if not download or hub.offline() or hub.probe(f"models/{model}") is not None:
        return None
    try:
        return Path(hf_hub_download(model, "config.json"))
    except Exception:  # noqa: BLE001 - no such repository, a gated one: the trainer reports the model itself
        return None


def check_backend(cfg) -> None:
    """An in-process vLLM engine (``inference.backend = vllm``) where vLLM is not installed, refused before any work
    (a demo's base evaluation, a model load). Servers are checked by ``check_packages``."""
    if cfg.inference.backend != "vllm" or cfg.inference.urls or cfg.deployment.num_infer_gpus > 0:
        return
    if importlib.util.find_spec("vllm") is None:
        raise PreflightError(
            f"inference.backend = vllm, but vLLM is not installed here; fix: "
            f"{extras.vllm_install_step(cuda=False)} (CPU) or {extras.vllm_install_step(cuda=True)} "
            "(GPU), or --inference.backend hf"
        )


def check_extras(cfg) -> None:
    """The optional packages the config asks for, refused with the rest of the configuration (a W&B run that lacks
    wandb failed only after the data and the model had loaded)."""
    wanted = [
        ("wandb", cfg.wandb.enabled, "wandb.enabled is set", "--wandb.enabled false"),
        ("peft", cfg.lora.enabled, "lora.enabled is set", "--lora.enabled false"),
    ]
    for module, asked, why, instead in wanted:
        if asked and importlib.util.find_spec(module) is None:
            extra = "lora" if module == "peft" else module
            raise PreflightError(
                f"{why}, but {module} is not installed here; fix: {extras.install_step(extra)}, or {instead}"
            )


def check_packages(cuda: bool) -> None:
    """vLLM (for the servers) and torch.distributed (for the trainer). vLLM is looked up, not imported:
    its import takes seconds, and a broken install shows in the server's log within the startup wait."""
    if importlib.util.find_spec("vllm") is None:
        raise PreflightError(
            f"the inference servers need vLLM, which is not installed; fix: {extras.vllm_install_step(cuda)}"
        )
    import torch.distributed

    if not torch.distributed.is_available():
        raise PreflightError(
            "this torch build has no torch.distributed, which the trainer needs; "
            "fix: install a standard torch build (pip install torch)"
        )


def plan_gpus(num_infer: int, num_train: int) -> GpuPlan:
    """The first ``num_infer`` visible GPUs for the servers, the next ``num_train`` for the trainer;
    refused when there are too few or one of them is busy."""
    visible = visible_gpus()
    need = num_infer + num_train
    if len(visible) < need:
        raise PreflightError(
            f"the deployment needs {need} GPUs ({num_infer} inference + {num_train} trainer), "
            f"{len(visible)} are visible; fix: lower deployment.num_infer_gpus / num_train_gpus "
            "or set CUDA_VISIBLE_DEVICES"
        )
    busy = [
        f"GPU {gpu} ({used} MiB in use)" for gpu, used in gpu_memory_used(visible[:need]).items() if used > BUSY_GPU_MIB
    ]
    if busy:
        raise PreflightError(
            f"busy: {', '.join(busy)}; fix: stop the process on it (nvidia-smi shows it) "
            "or leave it out with CUDA_VISIBLE_DEVICES"
        )
    return GpuPlan(visible[:num_infer], visible[num_infer:need])


def visible_gpus() -> list[str]:
    import torch

    count = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(count)]
    return [entry.strip() for entry in listed.split(",") if entry.strip()][:count]


def gpu_memory_used(gpus: list[str]) -> dict[str, int]:
    """MiB in use on each GPU (by index or UUID): nvidia-smi where there is one, else torch in a child
    process (a context made here would stay on every GPU for the whole run)."""
    if shutil.which("nvidia-smi"):
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,uuid,memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode == 0:
            rows = [[field.strip() for field in line.split(",")] for line in done.stdout.splitlines() if line.strip()]
            by_id = {key: int(used) for index, uuid, used in rows for key in (index, uuid)}
            return {gpu: by_id[gpu] for gpu in gpus if gpu in by_id}
    code = (
        "import json, torch; print(json.dumps([(t - f) >> 20 for f, t in "
        "(torch.cuda.mem_get_info(i) for i in range(torch.cuda.device_count()))]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return {}  # nothing to read it with: the servers' own memory check is the last word
    return dict(zip(gpus, json.loads(done.stdout.strip().splitlines()[-1])))


def parameter_count(model: str) -> int | None:
    """The model's parameter count: exact from a local directory's safetensors headers, else worked out
    from its ``config.json`` (dense decoder: Qwen, Llama). None when neither can be read."""
    path = Path(model)
    if path.is_dir():
        shards = sorted(path.glob("*.safetensors"))
        if shards:
            return sum(safetensors_parameters(shard) for shard in shards)
    config = model_config(model)
    return config_parameters(config) if config is not None else None


def model_config(model: str) -> dict | None:
    """The model's ``config.json``: a local directory's, else the hub's (None when it cannot be read)."""
    path = Path(model)
    if path.is_dir():
        config_file = path / "config.json"
    else:
        config_file = hub_model_config(model)
        if config_file is None:
            return None
    try:
        return json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def serving_bytes_per_param(model: str) -> int:
    """A checkpoint's serving weights per parameter: the model's own dtype, as its config names it (2 for bf16,
    4 for float32; 2, Qwen3's, when it cannot be read)."""
    config = model_config(model) or {}
    dtype = config.get("dtype") or config.get("torch_dtype") or ("float32" if config else "bfloat16")
    return 2 if dtype in ("bfloat16", "float16") else 4


def safetensors_parameters(path: Path) -> int:
    """Sum of the tensor sizes listed in a safetensors header (8-byte length, then JSON): no tensor is read."""
    with path.open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    total = 0
    for name, info in header.items():
        if name != "__metadata__":
            count = 1
            for dim in info["shape"]:
                count *= dim
            total += count
    return total


def config_parameters(config: dict) -> int | None:
    try:
        h, layers, inner, vocab = (
            config[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")
        )
        heads = config["num_attention_heads"]
    except KeyError:
        return None
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    attention = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim  # q, o; k, v
    per_layer = attention + 3 * h * inner + 2 * h + 2 * head_dim  # + gate/up/down, two norms, q/k norms
    embeddings = vocab * h * (1 if config.get("tie_word_embeddings") else 2)
    return layers * per_layer + embeddings + h


def checkpoints_on_disk(max_steps: int, interval: int | None, keep: int | None) -> int:
    """How many checkpoints lie on disk at the worst moment: those kept, plus the one being written."""
    written = len({step for step in range(interval or max_steps, max_steps + 1, interval or max_steps)} | {max_steps})
    return min(written, (keep or written) + 1)


def disk_needed(cfg, weight_sync: str) -> tuple[int, int] | None:
    """(bytes the run will need at most, bytes of one checkpoint); None when the model cannot be sized."""
    params = parameter_count(cfg.model)
    if params is None:
        return None
    one = params * (CHECKPOINT_BYTES_PER_PARAM + algorithm_bytes_per_param(cfg) + serving_bytes_per_param(cfg.model))
    total = one * checkpoints_on_disk(cfg.max_steps, cfg.ckpt.interval, cfg.ckpt.keep)
    if weight_sync == "filesystem":
        total += params * BROADCAST_BYTES_PER_PARAM * BROADCAST_DIRS
    return total, one


def algorithm_bytes_per_param(cfg) -> int:
    """What the algorithm's own checkpointed state adds per parameter (an EMA teacher: a float32 copy)."""
    return algorithms.state_bytes_per_param(cfg)


def free_bytes(path: Path) -> int:
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def check_disk(cfg, weight_sync: str) -> int | None:
    """Refuse a run whose checkpoints (and weight-broadcast copies) cannot fit. Returns one checkpoint's
    size in bytes (None when the model cannot be sized here, and then nothing is refused)."""
    needed = disk_needed(cfg, weight_sync)
    if needed is None:
        print(f"scirl train: note: cannot size model {cfg.model!r} from here; disk check skipped", file=sys.stderr)
        return None
    total, one = needed
    free = free_bytes(Path(cfg.output_dir).resolve())
    if total > free:
        n = checkpoints_on_disk(cfg.max_steps, cfg.ckpt.interval, cfg.ckpt.keep)
        broadcast = " plus the weight-broadcast copies" if weight_sync == "filesystem" else ""
        extra = f" + {cfg.algorithm}'s state" if algorithm_bytes_per_param(cfg) else ""
        raise PreflightError(
            f"disk: the run needs about {gb(total)} in {cfg.output_dir} ({n} checkpoint(s) of {gb(one)}: serving "
            f"weights + float32 weights + AdamW state{extra}{broadcast}), {gb(free)} are free; fix: free space, choose "
            "another --output-dir, "
            "or keep fewer checkpoints (--ckpt.keep 1)"
        )
    return one


def checkpoint_seconds(checkpoint_bytes: int | None) -> float:
    """A generous time for the trainer to write its checkpoint after a stop request."""
    return 120 + (checkpoint_bytes or 0) / WRITE_BYTES_PER_S


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"
