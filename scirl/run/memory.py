"""The memory plan: each trainer GPU's peak, estimated from the config and the model's shapes before any
weight is loaded, and a run that cannot fit refused in one line with the fixes.

What it models, per trainer GPU (``R`` trainer ranks, ``P`` parameters, compute dtype of ``c`` bytes):

- **state**: float32 master weights ``4P/R`` (FSDP2 shards them; LoRA: the frozen base in the compute
  dtype, unsharded, plus the float32 adapter), float32 gradients ``4P/R``, AdamW's two float32 moments
  ``8P/R``, an algorithm's own state (a float32 EMA teacher: ``4P/R``); one process in bf16 adds its compute copy ``cP`` and,
  at the end of a backward, the copy's gradients ``cP`` (``trainer/mixed_precision.py``);
- **FSDP2's working set**: the root's parameters (embeddings, LM head) gathered in the compute dtype
  from forward to backward, two decoder layers gathered at a time (the current one and the prefetched
  next), and at the end of the backward the root's unsharded gradients plus their float32 reduce-scatter
  buffer; one process instead holds, while a micro-batch's gradient is added into ``.grad``, one
  parameter's fresh gradient (the largest: the embeddings);
- **activations** of a micro-batch of ``B`` rows of ``L`` tokens (right-padded to the longest row),
  counted tensor by tensor as autograd saves them in transformers' Qwen3 layer with SDPA: two RMSNorms
  (their float32 input and compute-dtype output), the q/k norms likewise, q, k and v (k and v repeated to
  every head, which transformers does under a padding mask), the attention output and its contiguous
  copy, the logsumexp, the padding mask SDPA converts per layer (``B L^2`` elements), the MLP's four
  ``[T, intermediate]`` tensors; with activation checkpointing each layer keeps only its input, and the
  backward recomputes one layer at a time;
- **the head** (``head_bytes``): today's full logits over the completion positions, ``[B (C+1), V]``
  in the compute dtype, their float32 copy, the softmax probabilities saved for the backward and the
  float32 product the entropy takes (``trainer/loss.TargetLogprobs``); or a chunked head's float32
  working set, given its chunk size;
- **the engine** on a trainer GPU: a colocated vLLM engine's ``gpu_memory_utilization`` share of the GPU
  (while awake: between train steps, and throughout when ``sleep_level = 0``), a per-rank transformers
  copy under FSDP (``cP``), and the full weights gathered on the device in the compute dtype for a push
  (every rank when colocated, rank 0 for servers);
- **the optimizer step**: on a GPU AdamW's foreach kernels make one float32 temporary of the trained
  parameters' size.

The peak is the largest of three moments: the train step (state, gradients, working set, activations,
head), the optimizer step, and the push (state, the engine awake, the gathered weights).

What it does not model: CUDA's context and the caching allocator's fragmentation (a few GB: the verdict
says "tight" within 10% of the GPU), kernel workspaces (cuBLAS, SDPA's own scratch), NCCL's buffers,
a distilling algorithm's teacher forward (no gradient, before the student's: smaller than the student's step) and its
top-k tensors, and rows of a micro-batch whose prompts differ in length, which widen the head's window
past ``C + 1`` positions. The activations assume the micro-batch's longest row; the run knows that length
only once its data is read: ``--dry-run`` prints the longest row that fits next to ``seq_len`` and refuses only
what cannot fit even with one-token prompts; a run on CUDA checks again with its longest prompt
(``check_rows``), before any weight loads.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field, replace
from io import StringIO
from pathlib import Path

import torch
from huggingface_hub import try_to_load_from_cache
from rich.console import Console
from rich.table import Table

from scirl import algorithms
from scirl.errors import PreflightError
from scirl.run.config import COLOCATED_GPU_SHARE

GIB = 1 << 30
F32 = 4  # bytes of a float32
TIGHT = 0.9  # a peak above this share of the GPU is said to be tight: what the plan leaves out is a few GB


@dataclass(frozen=True)
class ModelShape:
    """A dense decoder's shapes (Qwen3, Llama): what the plan needs of ``config.json``."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, config: dict) -> "ModelShape | None":
        """From a ``config.json``'s fields; None when one the plan needs is missing."""
        try:
            h, heads = config["hidden_size"], config["num_attention_heads"]
            return cls(h, config["num_hidden_layers"], heads, config.get("num_key_value_heads") or heads,
                       config.get("head_dim") or h // heads, config["intermediate_size"], config["vocab_size"],
                       bool(config.get("tie_word_embeddings", False)))
        except (KeyError, TypeError):
            return None

    def layer_parameters(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * h * q + 2 * h * kv + 3 * h * self.intermediate + 2 * h + 2 * self.head_dim  # + norms, q/k norms

    def root_parameters(self) -> int:
        """Outside the decoder layers: embeddings, the LM head unless tied, the final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def parameters(self) -> int:
        return self.layers * self.layer_parameters() + self.root_parameters()


# Published config.json values of the Qwen3 dense models (vocabulary 151936, head dim 128, 8 KV heads), for
# hub ids whose config is neither a local directory nor in the hub cache: the plan downloads nothing.
QWEN3 = {"0.6B": (1024, 28, 16, 3072, True), "1.7B": (2048, 28, 16, 6144, True), "4B": (2560, 36, 32, 9728, True),
         "8B": (4096, 36, 32, 12288, False), "14B": (5120, 40, 40, 17408, False), "32B": (5120, 64, 64, 25600, False)}
KNOWN_SHAPES = {f"qwen3-{size.lower()}": ModelShape(h, layers, heads, 8, 128, inner, 151936, tied)
                for size, (h, layers, heads, inner, tied) in QWEN3.items()}


def model_shape(model: str) -> tuple[ModelShape, str] | None:
    """(shapes, where they came from): a local directory's ``config.json``, the hub cache's, else the table
    of well-known shapes by the id's last part (``Qwen/Qwen3-8B``, ``PrimeIntellect/Qwen3-8B``, ``-Base``).
    None when none of these knows the model."""
    path = Path(model)
    config_file = path / "config.json" if path.is_dir() else None
    if config_file is None:  # the hub cache only: nothing is downloaded
        try:
            cached = try_to_load_from_cache(model, "config.json")
        except ValueError:  # HFValidationError: neither a directory here nor a hub id (a path that does not exist)
            cached = None
        config_file = Path(cached) if isinstance(cached, str) else None
    if config_file is not None and config_file.is_file():
        try:
            shape = ModelShape.from_config(json.loads(config_file.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            shape = None
        if shape is not None:
            return shape, f"{config_file}"
    name = model.rstrip("/").rsplit("/", 1)[-1].lower().removesuffix("-base")
    if name in KNOWN_SHAPES:
        return KNOWN_SHAPES[name], f"the built-in table of published Qwen3 shapes ({name})"
    return None


@dataclass(frozen=True)
class Workload:
    """What one trainer rank does, as far as memory goes (``workload`` builds it from the config)."""

    ranks: int  # FSDP2 shards state over these; 1: a plain module
    compute_bytes: int  # 2: bf16 compute, 4: float32
    micro_batch_tokens: int  # the token budget of a micro-batch's packed row (0: none)
    micro_batch_size: int | None  # sequences per micro-batch at most (None: no bound)
    row_tokens: int  # the longest sequence, prompt + completion
    completion_tokens: int  # the longest completion
    checkpointing: bool
    group_size: int = 1  # completions per prompt (the SDPA path copies a prompt's K/V to each of its completions)
    attention: str = "flex"  # flex (GPUs) or sdpa: what the attention keeps for the backward
    head_block: int | None = None  # None: full logits; else the block-wise head's rows per block
    top_p: float = 1.0
    lora_parameters: int | None = None  # the adapter's, when LoRA trains; None: every parameter trains
    extra_state: int = 0  # bytes per parameter the algorithm keeps beside them (an EMA teacher), sharded
    engine_train: int = 0  # bytes an engine holds on this GPU during the train step
    engine_push: int = 0  # and while it takes new weights
    push_gathers: bool = True  # the push gathers the full weights on this GPU in the compute dtype
    foreach: bool = False  # AdamW's foreach kernels: one float32 temporary of the trained parameters (fused: none)

    @property
    def tokens(self) -> int:
        """The positions of a micro-batch's packed row at most: the token budget (each prompt once) or
        ``micro_batch_size`` sequences of ``row_tokens``, whichever is less; a sequence longer than that alone."""
        bounds = ([self.micro_batch_tokens] if self.micro_batch_tokens else []) + (
            [self.micro_batch_size * self.row_tokens] if self.micro_batch_size else [])
        return max(min(bounds), self.row_tokens)


@dataclass
class MemoryPlan:
    shape: ModelShape
    source: str  # where the shapes came from
    work: Workload
    terms: dict[str, int] = field(default_factory=dict)  # bytes per trainer GPU, by name
    phases: dict[str, int] = field(default_factory=dict)  # peak bytes of each moment

    @property
    def peak(self) -> int:
        return max(self.phases.values())


def head_bytes(positions: int, vocab: int, compute_bytes: int, block: int | None = None, top_p: float = 1.0) -> int:
    """The LM head's forward bytes over ``positions`` [tokens]. ``block`` None: full logits (the compute-dtype
    logits, their float32 copy unless already float32, the float32 probabilities saved for the backward and
    the float32 product the entropy sums; top-p adds its boolean nucleus mask). A block size (the trainer's
    ``head_block_tokens``, ``scirl/trainer/head.py``): one block of rows over the vocabulary at a time (its
    logits in the compute dtype, a float32 copy and its exponentials, the nucleus mask under top-p) plus a
    few float32 numbers per position; nothing of the vocabulary's width is kept for the backward."""
    if block is not None:  # the block's logits (a float32 copy of them unless computed in float32), exponentials
        rows = min(block, positions)
        copy = compute_bytes if compute_bytes != F32 else 0
        return rows * vocab * (copy + 2 * F32 + (1 if top_p < 1 else 0)) + positions * 4 * F32
    per_element = compute_bytes + 3 * F32 - (compute_bytes if compute_bytes == F32 else 0)
    return positions * vocab * (per_element + (1 if top_p < 1 else 0))


def head_backward_bytes(positions: int, shape: "ModelShape", compute_bytes: int, block: int | None) -> int:
    """The head's backward beyond what the forward kept. Full logits: the probabilities and their gradient.
    Blocks: one block's logits recomputed (in float32, turned into their gradient in place), the float32
    accumulator of the head weight's gradient and the gradient of the hidden states."""
    if block is None:
        return positions * shape.vocab * 2 * F32
    rows = min(block, positions)
    copy = compute_bytes if compute_bytes != F32 else 0  # the recomputed logits turn into their gradient in place
    return (rows * shape.vocab * (copy + F32) + F32 * shape.vocab * shape.hidden
            + compute_bytes * positions * shape.hidden)


def activation_bytes(shape: ModelShape, work: "Workload", c: int) -> tuple[int, int]:
    """(what autograd keeps from a micro-batch's forward of ``work.tokens`` packed positions, what one decoder
    layer's backward adds to it): the module docstring lists the tensors."""
    s, tokens = shape, work.tokens
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    cast = F32 if c != F32 else 0  # the norms' float32 copy of their input (none when it already is float32)
    per_layer = ((cast + c) * (2 * s.hidden + q + kv)  # the four RMSNorms: float32 input, compute-dtype output
                 + c * (q + 2 * kv)  # q, k, v after the rotary embedding (grouped K/V heads, not repeated)
                 + 2 * c * q  # the attention output and its contiguous copy (o_proj's input)
                 + F32 * s.heads  # the attention's logsumexp
                 + 4 * c * s.intermediate)  # gate, SiLU(gate), up, their product
    copies = 0
    if work.attention == "sdpa":  # the gathers: q, k, v by group and row, the outputs before they are scattered
        prompt = max(work.row_tokens - work.completion_tokens, 1)
        rows = tokens / (work.completion_tokens + prompt / max(work.group_size, 1))
        copies = c * (q + 2 * kv + q) * tokens + 2 * c * kv * int(rows * prompt)
    outside = (cast + c) * s.hidden + 2 * c * s.head_dim  # the final norm; rotary cos and sin
    backward = 2 * c * s.intermediate + 2 * c * s.hidden  # a layer's gradients in flight (the MLP's, the stream's)
    if not work.checkpointing:
        return tokens * (s.layers * per_layer + outside) + s.layers * copies, tokens * backward
    # each layer keeps its input; the backward recomputes one layer's tensors at a time
    return tokens * (s.layers * c * s.hidden + outside), tokens * (per_layer + backward) + copies


def estimate(shape: ModelShape, work: Workload, source: str = "") -> MemoryPlan:
    """Every term and each moment's peak, in bytes per trainer GPU (rank 0's, the busiest)."""
    w, c, P, R = work, work.compute_bytes, shape.parameters(), work.ranks
    trained = w.lora_parameters if w.lora_parameters is not None else P
    copy = R == 1 and c != F32 and w.lora_parameters is None
    saved, layer_backward = activation_bytes(shape, w, c)
    positions = w.tokens  # the head's: every completion token of the row at most
    terms = {
        "weights": c * P + F32 * trained if w.lora_parameters is not None else F32 * P // R,
        "gradients": F32 * trained // R,
        "optimizer": 2 * F32 * trained // R,
        "algorithm state": w.extra_state * trained // R,
        "compute copy": c * P if copy else 0,
        "activations": saved,
        "backward": layer_backward,
        "head": head_bytes(positions, shape.vocab, c, w.head_block, w.top_p),
        "engine": max(w.engine_train, w.engine_push),
    }
    state = sum(terms[k] for k in ("weights", "optimizer", "algorithm state", "compute copy"))
    base = state + terms["gradients"] + w.engine_train
    gathered, head_grad, at_end = gradient_working_set(shape, w, copy)
    head_backward = head_backward_bytes(positions, shape, c, w.head_block)
    terms["gathered"] = gathered
    phases = {
        "forward's end": base + gathered + saved + terms["head"],
        "head's backward": base + gathered + saved + head_backward + head_grad,
        "a layer's backward": base + gathered + saved + layer_backward + (head_grad if R > 1 or copy else 0),
        "backward's end": base + at_end,
        "optimizer step": base + (F32 * trained // R if w.foreach else 0),
        "weight push": state + w.engine_push + (c * P if w.push_gathers else 0),
    }
    return MemoryPlan(shape, source, w, terms, phases)


def gradient_working_set(shape: ModelShape, w: Workload, copy: bool) -> tuple[int, int, int]:
    """(parameters FSDP2 holds gathered through a micro-batch, the LM head's fresh gradient, what the end of
    the backward holds beyond the state and gradients)."""
    c, root, largest = w.compute_bytes, shape.root_parameters(), shape.vocab * shape.hidden
    if w.ranks > 1:
        # the root gathered from forward to backward, two layers at a time; the root's unsharded gradients
        # wait for its reduce-scatter at the backward's end, into a float32 buffer
        return c * root + 2 * c * shape.layer_parameters(), c * largest, c * root + c * root + F32 * root
    if w.lora_parameters is not None:
        return 0, 0, 0  # the frozen base has no gradient; the adapter's are small
    if copy:  # the bf16 copy's gradients pile up through the backward, then go into the float32 .grad
        return 0, c * largest, c * shape.parameters()
    return 0, F32 * largest, F32 * largest  # a fresh gradient before it is added into .grad: the head's, the embeddings'


# ---- from the config ----------------------------------------------------------------------------------


def lora_parameters(shape: ModelShape, rank: int, targets: list[str]) -> int:
    """The adapter's parameters: ``rank x (in + out)`` for each targeted linear of each layer."""
    h, q, kv, inner = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    sizes = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h,
             "gate_proj": h + inner, "up_proj": h + inner, "down_proj": inner + h}
    return shape.layers * rank * sum(sizes.get(name, 0) for name in targets)


def workload(cfg, shape: ModelShape, *, ranks: int, gpu_bytes: int | None, row_tokens: int | None = None,
             vllm: bool = False) -> Workload:
    """One trainer rank's ``Workload`` under ``cfg`` (a ``TrainConfig``). ``row_tokens``: the micro-batch's
    longest row (None: ``seq_len``); ``vllm``: whether a colocated ``auto`` backend gets vLLM (installed)."""
    c = F32 if cfg.dtype == "float32" else 2  # "auto" trains in bf16 on a GPU
    colocated = cfg.deployment.num_infer_gpus == 0 and not cfg.inference.urls
    engine_train = engine_push = 0
    push_gathers = True  # servers: rank 0 gathers the full weights for the push
    if colocated and (cfg.inference.backend == "vllm" or (cfg.inference.backend == "auto" and vllm)):
        share = int((cfg.inference.gpu_memory_utilization or COLOCATED_GPU_SHARE) * (gpu_bytes or 0))
        engine_train, engine_push = (share if cfg.inference.sleep_level == 0 else 0), share
    elif colocated:  # transformers: one process samples from the trained module; under FSDP a per-rank copy
        engine_train = engine_push = c * shape.parameters() if ranks > 1 else 0
        push_gathers = ranks > 1
    lora = lora_parameters(shape, cfg.lora.rank, cfg.lora.target_modules) if cfg.lora.enabled else None
    row = row_tokens or cfg.seq_len
    gpu = cfg.device.startswith("cuda") or (cfg.device == "auto" and gpu_bytes is not None)
    attention = cfg.attention if cfg.attention != "auto" else ("flex" if gpu else "sdpa")
    return Workload(ranks=ranks, compute_bytes=c, micro_batch_tokens=cfg.micro_batch_tokens,
                    micro_batch_size=cfg.micro_batch_size, row_tokens=row, completion_tokens=cfg.max_completion_tokens,
                    checkpointing=cfg.activation_checkpointing, group_size=cfg.group_size, attention=attention,
                    head_block=cfg.head_block_tokens, top_p=cfg.top_p, lora_parameters=lora,
                    extra_state=algorithms.state_bytes_per_param(cfg), engine_train=engine_train,
                    engine_push=engine_push, push_gathers=push_gathers)


def trainer_ranks(cfg, world_size: str | None) -> int:
    """How many trainer ranks share the state: torchrun's ``WORLD_SIZE`` where it is set, else the
    launcher's ``deployment.num_train_gpus`` when ``scirl train`` starts the servers and torchrun itself,
    else one process (a colocated run without torchrun)."""
    if world_size:
        return int(world_size)
    return cfg.deployment.num_train_gpus if cfg.deployment.num_infer_gpus > 0 and not cfg.inference.urls else 1


def gpu_size(deployment) -> tuple[int, str] | None:
    """(bytes of the smallest visible GPU, where that came from): the device, else
    ``deployment.gpu_memory_gb`` (a login node, a laptop), else None: the plan cannot check the fit."""
    if torch.cuda.is_available() and torch.cuda.device_count():
        sizes = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
        smallest = min(sizes, key=lambda p: p.total_memory)
        return smallest.total_memory, smallest.name
    if deployment.gpu_memory_gb:
        return int(deployment.gpu_memory_gb * GIB), "deployment.gpu_memory_gb"
    return None


# ---- the verdict --------------------------------------------------------------------------------------


def longest_row_that_fits(shape: ModelShape, work: Workload, limit: int) -> int | None:
    """The longest sequence (prompt + completion, at most ``work.row_tokens``) whose peak fits in ``limit``
    bytes; None when not even a full-length completion after a one-token prompt fits."""
    low, high = work.completion_tokens + 1, work.row_tokens
    if estimate(shape, replace(work, row_tokens=low)).peak > limit:
        return None
    while low < high:  # the peak grows with the row length
        mid = (low + high + 1) // 2
        low, high = (mid, high) if estimate(shape, replace(work, row_tokens=mid)).peak <= limit else (low, mid - 1)
    return low


def fixes(shape: ModelShape, work: Workload, limit: int, cfg) -> str:
    """The changes to ``cfg`` (a ``TrainConfig``) that each alone make ``work`` fit, as flags; else the
    combination of checkpointing and GPUs that does."""
    fits = lambda w: estimate(shape, w).peak <= limit  # noqa: E731
    checkpointing = "--activation-checkpointing"
    launcher = cfg.deployment.num_infer_gpus > 0 and not cfg.inference.urls
    gpus_flag = "--deployment.num-train-gpus {}" if launcher else "torchrun --nproc-per-node {}"
    found = []
    if not work.checkpointing and fits(replace(work, checkpointing=True)):
        found.append(f"activation checkpointing ({checkpointing})")
    if work.tokens > work.row_tokens and fits(replace(work, micro_batch_tokens=work.row_tokens)):
        low, high = work.row_tokens, work.tokens - 1  # the largest budget that fits
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(replace(work, micro_batch_tokens=mid)) else (low, mid - 1)
        found.append(f"smaller micro-batches (--micro-batch-tokens {low})")
    if work.engine_push:  # the colocated engine's share, as long as it still holds its own weights
        least = work.compute_bytes * shape.parameters() + GIB
        share = next((u / 20 for u in range(19, 0, -1) if u / 20 * limit > least and fits(replace(
            work, engine_push=int(u / 20 * limit), engine_train=int(u / 20 * limit) if work.engine_train else 0))), None)
        if share:
            found.append(f"a smaller engine share (--inference.gpu-memory-utilization {share:g})")
    gpus = next((r for r in range(work.ranks + 1, 257) if fits(replace(work, ranks=r))), None)
    if gpus:
        found.append(f"more trainer GPUs ({gpus_flag.format(gpus)})")
    if found:
        return ", or ".join(found)
    gpus = next((r for r in range(work.ranks, 257) if fits(replace(work, checkpointing=True, ranks=r))), None)
    if gpus is None:
        return "no combination of checkpointing and GPUs fits: a smaller model, or a LoRA adapter (--lora.enabled)"
    together = ([] if work.checkpointing else [checkpointing]) + ([gpus_flag.format(gpus)] if gpus != work.ranks else [])
    return "no one change fits; together: " + " ".join(together)


def check_fit(plan: MemoryPlan, limit: int, where: str, cfg) -> int | None:
    """Raise ``PreflightError`` when even a micro-batch of full-length completions after one-token prompts
    cannot fit in ``limit`` bytes; else return the longest row that fits (None: any row up to seq_len)."""
    if plan.peak <= limit:
        return None
    row = longest_row_that_fits(plan.shape, plan.work, limit)
    if row is not None:
        return row
    short = estimate(plan.shape, replace(plan.work, row_tokens=plan.work.completion_tokens + 1))
    moment = max(short.phases, key=short.phases.get)
    raise PreflightError(f"memory: a trainer GPU needs about {gib(short.peak)} at its peak ({moment}, with micro-batches "
                         f"of {short.work.tokens} tokens), the GPU has {gib(limit)} ({where}); "
                         f"fix: {fixes(plan.shape, short.work, limit, cfg)}")


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


NOTES = {
    "weights": "{weights}", "gradients": "float32{shard}", "optimizer": "AdamW: two float32 moments{shard}",
    "algorithm state": "the algorithm's own (an EMA teacher){shard}", "compute copy": "one process: bf16 copy of the weights",
    "gathered": "FSDP2: root + two layers in the compute dtype", "activations": "kept by the forward ({act})",
    "backward": "one layer's backward{recompute}", "head": "{head}", "engine": "{engine}",
}


def render(plan: MemoryPlan, gpu: tuple[int, str] | None, row: int | None) -> str:
    """The plan as text: a table of the terms, each moment's peak, the verdict."""
    w, s = plan.work, plan.shape
    shard = f", sharded over {w.ranks}" if w.ranks > 1 else ""
    weights = "frozen base in the compute dtype + float32 adapter" if w.lora_parameters is not None else f"float32 masters{shard}"
    fill = {"shard": shard, "weights": weights, "act": f"a packed row of {w.tokens} tokens, {w.attention} attention, "
            + ("checkpointed" if w.checkpointing else "no checkpointing"),
            "recompute": ": recomputed, plus its gradients" if w.checkpointing else ": its gradients",
            "head": f"up to {w.tokens} positions x {s.vocab} vocab, "
            + (f"blocks of {w.head_block} tokens" if w.head_block else "full logits"),
            "engine": "on this GPU: colocated sampler (awake)" if w.engine_push else "none on this GPU"}
    table = Table(title=f"memory plan per trainer GPU: {s.parameters() / 1e9:.2f}B parameters, {w.ranks} trainer "
                  f"rank(s), {'bf16' if w.compute_bytes == 2 else 'float32'} compute", title_justify="left")
    for column in ("term", "GiB", "what"):
        table.add_column(column, justify="right" if column == "GiB" else "left")
    for name, value in plan.terms.items():
        if value:
            table.add_row(name, f"{value / GIB:.1f}", NOTES[name].format(**fill))
    for name, value in plan.phases.items():
        table.add_row(f"[b]{name}[/b]" if value == plan.peak else name, f"{value / GIB:.1f}", "peak" if value == plan.peak else "")
    out = StringIO()
    Console(file=out, width=110, color_system=None).print(table)
    lines = [out.getvalue().rstrip(), f"shapes from {plan.source}", verdict(plan, gpu, row)]
    return "\n".join(lines)


def verdict(plan: MemoryPlan, gpu: tuple[int, str] | None, row: int | None) -> str:
    if gpu is None:
        return (f"peak about {gib(plan.peak)}; the GPU's size is unknown here (no CUDA device): "
                "give --deployment.gpu-memory-gb to check the fit")
    size, where = gpu
    if row is not None:
        return (f"fits {gib(size)} ({where}) only while the longest sequence stays under {row} tokens "
                f"(seq_len allows {plan.work.row_tokens}); the run checks its data's longest prompt before loading weights")
    tight = " (tight: CUDA's context and fragmentation take a few GB more)" if plan.peak > TIGHT * size else ""
    return f"fits: peak about {gib(plan.peak)} of {gib(size)} ({where}){tight}"


def plan_run(cfg, *, ranks: int, gpu: tuple[int, str] | None, row_tokens: int | None = None) -> tuple[MemoryPlan, int | None] | str:
    """(the plan of ``cfg``'s trainer GPUs, the longest row that fits when seq_len's does not), or a one-line
    note saying why there is no plan. Raises ``PreflightError`` for a run that cannot fit."""
    found = model_shape(cfg.model)
    if found is None:
        return (f"no memory plan: the shapes of model {cfg.model!r} are unknown here (not a local directory, "
                "not in the hub cache, not a known Qwen3 size)")
    shape, source = found
    vllm = importlib.util.find_spec("vllm") is not None
    work = workload(cfg, shape, ranks=ranks, gpu_bytes=gpu[0] if gpu else None, row_tokens=row_tokens, vllm=vllm)
    plan = estimate(shape, work, source)
    row = check_fit(plan, gpu[0], gpu[1], cfg) if gpu else None
    return plan, row


def check_rows(cfg, longest_prompt: int, ranks: int) -> None:
    """A run on CUDA, once its prompts are known and before any weight loads: refuse (``PreflightError``)
    when micro-batches of its longest prompt plus a full-length completion cannot fit a trainer GPU."""
    row = min(cfg.seq_len, longest_prompt + cfg.max_completion_tokens)
    gpu = gpu_size(cfg.deployment)
    planned = plan_run(cfg, ranks=ranks, gpu=gpu, row_tokens=row)  # refuses what even the shortest rows cannot fit
    if isinstance(planned, str) or planned[1] is None:
        return
    plan, fits_row = planned
    raise PreflightError(
        f"memory: micro-batches of {plan.work.tokens} tokens with sequences of up to {row} tokens (the data's longest prompt, "
        f"{longest_prompt} tokens, + max_completion_tokens) need about {gib(plan.peak)} on a trainer GPU, which has "
        f"{gib(gpu[0])} ({gpu[1]}); rows up to {fits_row} tokens fit; fix: {fixes(plan.shape, plan.work, gpu[0], cfg)}, "
        f"or --seq-len {fits_row} (longer prompts are then left out)")
