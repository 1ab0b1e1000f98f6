"""An HF model directory from a prime-rl trainer checkpoint, or from the trainer state of a scirl checkpoint (both
torch.distributed.checkpoint, "DCP").

prime-rl's main branch writes only DCP checkpoints (it stopped writing HF
``weights/step_N`` in upstream PR #3316). Its trainer saves
``{"app": AppState(model, optimizers, scheduler, progress)}`` with
``dcp.save`` into ``<run>/checkpoints/step_N/trainer/`` (``src/prime_rl/trainer/ckpt.py``
at 559b447), so the model's tensors sit under ``app.model.<HF name>``: for dense
models such as Qwen3, prime-rl's names are the HF names (``Qwen3PreTrainedModel``'s
converters are the identity). The optimizer state (twice the model, in fp32) is
never read.

scirl's own checkpoints (``scirl/run/checkpoint.py``) keep their trainer state in
``weights/step_N/trainer_state/``, the model's float32 tensors under ``model.<HF name>``; the step
directory beside it holds the run's config and tokenizer, the default base. Its serving weights are an HF
model already; this gives the weights in another dtype (float32: the masters themselves).

The output is what prime-rl's removed HF export wrote: weights in bf16 (by
default) as safetensors, plus the base model's config, generation config and
tokenizer, so ``vllm serve`` and ``scirl eval`` load it. It is written to a
temporary directory and renamed into place, so a cut-short conversion leaves no
half-written model.
"""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

MODEL_PREFIX = "app.model."  # prime-rl's
SCIRL_PREFIX = "model."  # scirl's trainer state
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_SHARD_BYTES = 5 * 1024**3


class ConvertError(ValueError):
    """The checkpoint or the base model cannot make an HF directory; the message says why."""


def checkpoint_dir(path: str | Path) -> Path:
    """The DCP directory for ``path``: a prime-rl ``step_N`` directory or its ``trainer/``, a scirl ``weights/step_N``
    or its ``trainer_state/``, or a DCP directory itself."""
    path = Path(path)
    if not path.is_dir():
        raise ConvertError(f"{path}: no such checkpoint directory")
    candidates = (path, path / "trainer", path / "trainer_state")
    for candidate in candidates:
        if (candidate / ".metadata").is_file():
            return candidate
    for candidate in candidates:
        if any(candidate.glob("*.distcp")):
            raise ConvertError(
                f"{candidate}: shard files but no .metadata: the checkpoint write was cut short "
                "(e.g. a timeout during the final save); use an earlier step"
            )
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        raise ConvertError(
            f'{path}: serving weights without a trainer state (a ckpt.final = "weights" checkpoint, '
            "or its trainer state was not written): it is an HF model already; serve it as it is"
        )
    raise ConvertError(
        f"{path}: not a prime-rl checkpoint (step_N/trainer/ with .metadata and *.distcp) nor a scirl "
        "one (weights/step_N/trainer_state/)"
    )


def base_from_run(ckpt: Path) -> str | None:
    """The model a run trained: a scirl checkpoint's own step directory (its config and tokenizer, beside its trainer
    state), else a prime-rl run's resolved ``configs/trainer.json``, if it is there."""
    if ckpt.name == "trainer_state" and (ckpt.parent / "config.json").is_file():
        return str(ckpt.parent)
    # <run>/checkpoints/step_N/trainer -> <run>/configs/trainer.json
    for parent in ckpt.parents:
        config = parent / "configs" / "trainer.json"
        if config.is_file():
            try:
                return json.loads(config.read_text(encoding="utf-8"))["model"]["name"]
            except (ValueError, KeyError, TypeError):
                return None
    return None


def model_prefix(ckpt: Path) -> str:
    """Where the checkpoint keeps the model's tensors: prime-rl's ``app.model.``, else scirl's ``model.``."""
    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    return MODEL_PREFIX if any(key.startswith(MODEL_PREFIX) for key in keys) else SCIRL_PREFIX


def model_tensors(ckpt: Path, prefix: str = MODEL_PREFIX) -> dict[str, object]:
    """HF name -> DCP tensor metadata of every model tensor in the checkpoint (under ``prefix``)."""
    metadata = FileSystemReader(str(ckpt)).read_metadata()
    tensors = {
        key[len(prefix) :]: meta
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not tensors:
        prefixes = sorted(
            {
                key.split(".", 2)[0] + "." + key.split(".", 2)[1]
                for key in metadata.state_dict_metadata
                if key.count(".") >= 2
            }
        )
        raise ConvertError(f"{ckpt}: no model tensors under {prefix!r} (found {', '.join(prefixes[:5]) or 'none'})")
    if any(".lora_" in name for name in tensors):
        raise ConvertError(
            f"{ckpt}: a LoRA run's trainer state holds the adapter alone; its serving weights (the step "
            "directory) are the merged model"
        )
    return tensors


def expected_tensors(config) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the weights ``save_pretrained`` writes for ``config``, built on the meta device."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if tied(config):
        shapes.pop("lm_head.weight", None)
    return shapes


def tied(config) -> bool:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text_config, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))


def shard_plan(names: list[str], sizes: dict[str, int], shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for name in names:
        if shards[-1] and used + sizes[name] > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    return shards


def write_weights(
    ckpt: Path,
    out: Path,
    tensors: dict,
    shards: list[list[str]],
    files: list[str],
    dtype: torch.dtype,
    total_size: int,
    prefix: str = MODEL_PREFIX,
) -> None:
    """Read the model tensors one shard at a time and write them as safetensors (plus an index if sharded)."""
    reader = FileSystemReader(str(ckpt))
    weight_map = {}
    for shard, filename in zip(shards, files):
        state = {prefix + n: torch.empty(tensors[n].size, dtype=tensors[n].properties.dtype) for n in shard}
        with warnings.catch_warnings():
            # one process reads the whole checkpoint, which is what we want
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp_load(state, storage_reader=reader, no_dist=True)
        save_file(
            {n: state[prefix + n].to(dtype).contiguous() for n in shard}, str(out / filename), metadata={"format": "pt"}
        )
        weight_map.update(dict.fromkeys(shard, filename))
        del state
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


@dataclass
class Converted:
    out: Path
    base: str
    tensors: int
    shards: int
    dtype: str


def convert(
    checkpoint: str | Path,
    out: str | Path,
    *,
    base: str | None = None,
    dtype: str = "bfloat16",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    force: bool = False,
) -> Converted:
    """Write an HF model directory at ``out`` from the DCP checkpoint at ``checkpoint`` (prime-rl's, or a scirl
    checkpoint's trainer state).

    ``base`` (a local HF directory or a hub id) gives the config, generation
    config and tokenizer; by default a scirl checkpoint's own step directory, or the prime-rl run's
    ``configs/trainer.json``'s model.
    Tensors are read a shard at a time, so memory holds about one shard.
    """
    if dtype not in DTYPES:
        raise ConvertError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    out = Path(out)
    if out.exists() and not force:
        raise ConvertError(f"{out} already exists (pass --force to replace it)")
    ckpt = checkpoint_dir(checkpoint)
    base = base or base_from_run(ckpt)
    if base is None:
        raise ConvertError(f"{ckpt}: no run config names the base model; pass --base MODEL (its config and tokenizer)")
    try:
        config = AutoConfig.from_pretrained(base)
    except (OSError, ValueError) as e:
        raise ConvertError(f"cannot load the base model's config from {base!r}: {str(e).splitlines()[0]}") from e

    prefix = model_prefix(ckpt)
    tensors = model_tensors(ckpt, prefix)
    if tied(config):
        tensors.pop("lm_head.weight", None)  # save_pretrained leaves the tied copy out too
    expected = expected_tensors(config)
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ConvertError(
            f"the checkpoint's weights do not fit {base!r} ({config.model_type}): "
            f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}"
        )
    wrong = [n for n in expected if tuple(tensors[n].size) != expected[n]]
    if wrong:
        n = wrong[0]
        raise ConvertError(f"{n}: shape {tuple(tensors[n].size)} in the checkpoint, {expected[n]} in {base!r}")

    torch_dtype = DTYPES[dtype]
    names = list(expected)  # the model's own order: embeddings, layers in order, norm, head
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    sizes = {n: itemsize * int(torch.Size(tensors[n].size).numel()) for n in names}
    shards = shard_plan(names, sizes, shard_bytes)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_weights(ckpt, tmp, tensors, shards, files, torch_dtype, sum(sizes.values()), prefix)
        if hasattr(config, "dtype"):
            config.dtype = torch_dtype
        else:
            config.torch_dtype = torch_dtype
        config.save_pretrained(tmp)
        try:
            GenerationConfig.from_pretrained(base).save_pretrained(tmp)
        except OSError:
            pass  # the base has no generation config; vLLM and transformers use the model config's
        AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return Converted(out=out, base=base, tensors=len(names), shards=len(shards), dtype=dtype)
