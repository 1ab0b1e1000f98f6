"""The memory plan: each trainer GPU's peak, estimated from the config and the model's shapes before any
weight is loaded, and a run that cannot fit refused in one line naming the term to cut and the flag that cuts it.

What it counts, per trainer GPU (rank 0's, the busiest; ``R`` trainer ranks, ``P`` parameters, compute dtype of
``c`` bytes):

- **state**: float32 master weights ``4P/R`` (FSDP2 shards them; LoRA: the frozen base in the compute dtype,
  unsharded, plus the float32 adapter), float32 gradients ``4P/R``, AdamW's two float32 moments ``8P/R`` (torch's
  fused AdamW: no temporary at the step), an algorithm's own state (a float32 EMA teacher: ``4P/R``); one process in
  bf16 adds its compute copy ``cP`` and, through a backward, the copy's gradients (``trainer/mixed_precision.py``);
- **FSDP2's working set**: the root's parameters (embeddings, LM head) gathered from forward to backward; in a
  layer's backward the layer gathered, the next one prefetched, its gradients in the compute dtype and, from the
  second layer on, the float32 reduce-scatter input of the one before; the head weight's gradient, held until the
  root reduces it; at the backward's end the root's gradients and their float32 reduce-scatter input. One process
  holds a parameter's fresh gradient (a tied head's until the embeddings' joins it);
- **activations** of one packed row (``trainer/packing.py``): the largest the trainer cuts from groups of
  full-length completions, or with several ranks its stand-in, as ``trainer/cutting.py`` says (the packer's own
  rule: a token budget, a cap of completions, flex's row lengths). Counted tensor by tensor as autograd keeps them in
  transformers' Qwen3 layer: each RMSNorm its input in float32 and its normalised product (in bf16 the float32
  cast is a new tensor; in float32 the cast is the input itself, which the norm then keeps), the norms' outputs
  the projections read, o_proj's input, the MLP's four ``[tokens, intermediate]`` tensors; the attention's (flex:
  q, k, v with grouped heads, its output and logsumexp; sdpa: the per-group gathers, the prompts' q, k, v and the
  completions' q with k and v over ``prompt + completion`` keys per row, both outputs and logsumexps; the key index
  and the additive mask once per micro-batch, shared by the layers). With checkpointing each layer keeps its input
  and the backward recomputes one layer at a time;
- **the head** (``trainer/head.py``) at the loss tokens only, a block of rows at a time: one block's float32
  logits and exponentials in the forward (compiled, ``kernels = compile``: the block's logits in the compute
  dtype alone); in the backward the gradient of the hidden states, a block recomputed, and the head weight's
  float32 gradient, each block's product added into it by the GEMM itself. The block's rows
  (``head_block_tokens``, 0 by default) are the largest of ``HEAD_BLOCKS`` whose plan fits the GPU;
- **the weight push**, after the optimizer step (gradients freed): one bucket of ``deployment.weight_bucket_mib``
  (or the largest tensor) gathered at a time on every rank, its shard cast first; rank 0's NCCL transport packs a copy
  of it (vLLM's packed broadcast); a colocated engine's ``gpu_memory_utilization`` share awake to take it (also
  through the train step when ``sleep_level = 0``), or a per-rank transformers copy under FSDP (``cP``);
- **outside torch's tensors**: ``CUDA_CONTEXT``, each NCCL communicator's buffers on this rank (FSDP2's among
  the trainer ranks; on rank 0 the weight push's group with the servers when ``deployment.weight_sync`` resolves
  to nccl), and the caching allocator's fragmentation (``ALLOCATOR_RESERVE`` of what changes size with each
  micro-batch's length).

The peak is the largest of six moments: the forward's end, the head's backward, a layer's backward, the
backward's end, the optimizer step and the weight push; the plan is that of rows of any length up to the
longest (``estimate``: a token budget leaves short prompts the most completions, so the head's share peaks
there). A run may plan on ``1 - HEADROOM`` of the GPU; past that it is refused (``check_fit``).

Checked against measurements: on a CPU, float32 and bf16, one process and FSDP2 over 2 gloo ranks, the step's
live tensor bytes land within 10% of the estimate (``tests/run/test_memory_plan*.py``); on a GPU against the allocator's
peak (``tests/run/test_memory_plan.py``, skipped without CUDA: not yet run on one). Not measured: the flex path (torch
has no CPU backward for it), the compiled head (its kernels allocate where the CPU's tracker cannot see), the CUDA
and NCCL figures, fragmentation.

What it does not model: kernel workspaces (cuBLAS, a compiled kernel's scratch: in the headroom), a
distilling algorithm's teacher forward (no gradient, before the student's) and its top-k tensors, the other
micro-batches' masks built with the step's (small), what compiled layers save (``kernels = compile``: the
partitioner recomputes elementwise work rather than keep it, so usually less than eager's), and micro-batches of
many completions shorter than ``max_completion_tokens`` (more rows than full-length ones give: the SDPA path's keys
grow with the rows). A run on CUDA checks again with its data's longest prompt (``check_rows``), before any
weight loads.

The plan as text (the ``--dry-run`` table, the verdict): ``memory_report.py``; a checkpoint's host memory:
``memory_staging.py``.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from huggingface_hub import try_to_load_from_cache

from scirl import algorithms
from scirl.errors import PreflightError
from scirl.run.config import COLOCATED_GPU_SHARE
from scirl.trainer import kernels
from scirl.trainer.attention import FLEX_BLOCK
from scirl.trainer.batching import Batching
from scirl.trainer.cutting import MicroBatchShape, largest_micro_batch, stand_in_shape
from scirl.trainer.head import DEFAULT_BLOCK_TOKENS, SORT_ELEMENTS

GIB = 1 << 30
F32 = 4  # bytes of a float32
# A run may plan on 90% of a GPU: the rest is for what the plan cannot count (cuBLAS's and compiled kernels'
# workspaces, its own error) and for room to spare (issue 42's bound for the 8B guide layout)
HEADROOM = 0.10
# CUDA's context with lazy module loading (CUDA >= 11.7, PyTorch's default) is ~0.3-0.4 GB before a kernel runs
# (PyTorch's maintainers in pytorch/pytorch#107667 and #109888); the kernels a training step loads into it (cuBLAS,
# Triton's compiled kernels, NCCL's) add to it. An allowance, not a measurement: no GPU has checked it here
CUDA_CONTEXT = 768 << 20
# One NCCL communicator's buffers on each rank, within a node: 544 MB for a 2-GPU group and 688 MB for larger ones,
# measured on 4 A100s over NVLink (NVIDIA/nccl#964); they grow with the channels, ~10 MiB per channel and peer (NCCL's
# defaults: Simple 4 MiB, LL128 ~4.7 MiB, LL 0.5 MiB; seen as 10 MiB allocations on H100s in NVIDIA/nccl#1685). 3 or
# more GPUs on an NVSwitch (H100 and after) add NVLink SHARP's 288 MiB a rank (vllm-project/vllm#9699). Used for
# servers on other nodes too (at inference.urls): the network transport's buffers are the same sizes, on fewer channels
NCCL_TWO_RANKS = 544 << 20
NCCL_MORE_RANKS = (688 + 288) << 20
# The caching allocator's fragmentation: GMLake (ASPLOS 2024) removed 15% on average (up to 33%) of it from PyTorch's
# caching allocator in LLM fine-tuning with recomputation and sharding (eight LLMs on A100s of 80 GB). Charged on
# what changes size with each micro-batch (a packed row's length): the state, FSDP2's buffers and the weight-sized
# gradients come back at the same sizes each step and get the blocks they had
ALLOCATOR_RESERVE = 0.15
ROW_STEP = 128  # the prompt lengths the worst row is searched over: every multiple of this, 1 and the longest
# the head's block sizes a GPU run chooses among (``head_block_tokens = 0``): larger blocks, fewer and larger
# kernels; past a few thousand rows the matmuls are as efficient as they get
HEAD_BLOCKS = (512, 1024, 2048, 4096)


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
    serving_bytes: int = 2  # a parameter's bytes in the model's own dtype (its config's): what a checkpoint serves

    @classmethod
    def from_config(cls, config: dict) -> ModelShape | None:
        """From a ``config.json``'s fields; None when one the plan needs is missing."""
        try:
            h, heads = config["hidden_size"], config["num_attention_heads"]
            dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
            return cls(
                h,
                config["num_hidden_layers"],
                heads,
                config.get("num_key_value_heads") or heads,
                config.get("head_dim") or h // heads,
                config["intermediate_size"],
                config["vocab_size"],
                bool(config.get("tie_word_embeddings", False)),
                2 if dtype in ("bfloat16", "float16") else F32,
            )
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
QWEN3 = {
    "0.6B": (1024, 28, 16, 3072, True),
    "1.7B": (2048, 28, 16, 6144, True),
    "4B": (2560, 36, 32, 9728, True),
    "8B": (4096, 36, 32, 12288, False),
    "14B": (5120, 40, 40, 17408, False),
    "32B": (5120, 64, 64, 25600, False),
}
KNOWN_SHAPES = {
    f"qwen3-{size.lower()}": ModelShape(h, layers, heads, 8, 128, inner, 151936, tied)
    for size, (h, layers, heads, inner, tied) in QWEN3.items()
}


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
    micro_batch_size: int | None  # completions per micro-batch at most (None: no bound)
    row_tokens: int  # the longest sequence, prompt + completion
    completion_tokens: int  # the longest completion
    checkpointing: bool
    group_size: int = 1  # completions per prompt, adjacent in a step's samples
    share_prompts: bool = True  # each group's prompt once per micro-batch (False: once per completion)
    attention: str = "flex"  # flex (GPUs) or sdpa: what the attention keeps for the backward
    head_block: int = DEFAULT_BLOCK_TOKENS  # the head's rows per block (``trainer/head.py``)
    fused_head: bool = False  # the head's elementwise work compiled (``kernels = compile``)
    top_p: float = 1.0
    lora_parameters: int | None = None  # the adapter's, when LoRA trains; None: every parameter trains
    extra_state: int = 0  # bytes per parameter the algorithm keeps beside them (an EMA teacher), sharded
    engine_train: int = 0  # bytes an engine holds on this GPU during the train step
    engine_push: int = 0  # and while it takes new weights
    push_bucket: int = 0  # bytes of full weights a push gathers on this GPU at once (0: the push gathers nothing here)
    push_copy: bool = False  # the push's transport copies each bucket on this GPU (vLLM's packed NCCL broadcast)
    cuda: bool = True  # a CUDA GPU: its context, NCCL's buffers, the caching allocator's reserve
    communicators: tuple[tuple[str, int, str], ...] = ()  # NCCL communicators on this GPU: (what for, ranks, transport)

    @property
    def batching(self) -> Batching:
        return Batching(self.micro_batch_tokens, self.micro_batch_size, self.share_prompts, self.attention)

    @property
    def rows(self) -> MicroBatchShape:
        """The largest micro-batch the trainer cuts from groups of full-length completions in rows ``row_tokens``
        long (``cutting.largest_micro_batch``)."""
        completion = max(min(self.completion_tokens, self.row_tokens - 1), 1)
        return largest_micro_batch(
            self.batching,
            self.attention,
            group_size=self.group_size,
            prompt=max(self.row_tokens - completion, 1),
            completion=completion,
        )


@dataclass
class MemoryPlan:
    shape: ModelShape
    source: str  # where the shapes came from
    work: Workload
    # the micro-batch the peak is planned at (the worst row length up to work.row_tokens)
    rows: MicroBatchShape
    moments: dict[str, dict[str, int]] = field(default_factory=dict)  # each moment's bytes per trainer GPU, by term

    @property
    def phases(self) -> dict[str, int]:
        """Each moment's total."""
        return {name: sum(parts.values()) for name, parts in self.moments.items()}

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def peak_moment(self) -> str:
        phases = self.phases
        return max(phases, key=lambda name: phases[name])

    @property
    def terms(self) -> dict[str, int]:
        """Each term at its largest over the moments."""
        out: dict[str, int] = {}
        for parts in self.moments.values():
            for name, value in parts.items():
                out[name] = max(out.get(name, 0), value)
        return out

    @property
    def allocated(self) -> dict[str, int]:
        """Each moment's bytes in tensors: what torch's allocator counts (``torch.cuda.max_memory_allocated``)."""
        return {
            name: sum(v for k, v in parts.items() if k not in OUTSIDE_TORCH) for name, parts in self.moments.items()
        }


TERMS = (
    "weights",
    "gradients",
    "optimizer",
    "algorithm state",
    "compute copy",
    "engine",
    "gathered",
    "gradients in flight",
    "activations",
    "backward",
    "head",
    "head gradient",
    "push bucket",
    "CUDA context",
    "NCCL",
    "allocator reserve",
)  # the plan's terms, in the table's order
OUTSIDE_TORCH = ("CUDA context", "NCCL", "allocator reserve")  # memory a GPU holds beyond torch's live tensors
VARYING_TERMS = ("activations", "backward", "head")  # sized by each micro-batch's length: what fragments the allocator


def rmsnorm_bytes(c: int) -> int:
    """Bytes per normalised element transformers' RMSNorm keeps for its backward: its input in float32 (a cast in
    bf16; in float32 the cast is the input itself, which it then keeps) and the normalised product in the
    compute dtype (its output is kept by whatever reads it, and counted there)."""
    return F32 + c


def layer_bytes(s: ModelShape, rows: MicroBatchShape, w: Workload, c: int) -> tuple[int, int]:
    """(bytes a decoder layer's forward keeps for its backward, those that are copies of its input in float32 runs),
    tensor by tensor as transformers' Qwen3 layer and the packed attention (``trainer/attention.py``) save them."""
    n, q, kv = rows.tokens, s.heads * s.head_dim, s.kv_heads * s.head_dim
    # the two RMSNorms over the stream and their outputs (q/k/v's, gate/up's input); the q and k norms (their
    # outputs feed the rotary embedding, which keeps nothing)
    per_token = (
        2 * (rmsnorm_bytes(c) + c) * s.hidden
        + rmsnorm_bytes(c) * (q + kv)
        + F32 * (2 + s.heads + s.kv_heads)  # the norms' reciprocal RMS
        + c * q  # o_proj's input
        + 4 * c * s.intermediate
    )  # gate, SiLU(gate), up, their product
    kept = per_token * n
    if w.attention == "flex":  # flex attention keeps q, k, v (grouped heads, not repeated), its output and logsumexp
        kept += n * (c * (2 * q + 2 * kv) + F32 * s.heads)
    else:  # per-group gathers: the prompts' q, k, v [G, P], the completions' q [R, C] and k, v over [R, P + C] keys
        # (full-length rows: one grid; completions of mixed lengths are split into smaller grids, which keep less)
        g, m, p, cl = rows.prompts, rows.completions, rows.prompt, rows.completion
        keys = m * (p + cl)
        kept += (
            g * p * (c * (2 * q + 2 * kv) + F32 * s.heads)  # q, k, v, output, logsumexp of the prompts
            + m * cl * (2 * c * q + F32 * s.heads)  # the completions' q, output, logsumexp
            + keys * 2 * c * kv
        )  # their keys' k and v
    copies = F32 * s.hidden * n if c == F32 else 0  # in float32 the first RMSNorm keeps the layer's input itself
    return kept, copies


@dataclass(frozen=True)
class Activations:
    kept: int  # what autograd keeps from a micro-batch's forward
    backward: int  # what one decoder layer's backward adds to it
    per_layer: int  # what each layer's backward frees of ``kept`` once it is done


def activation_bytes(shape: ModelShape, work: Workload, rows: MicroBatchShape | None = None) -> Activations:
    """What a micro-batch of ``rows`` (default: ``work.rows``) keeps and adds through its forward and backward."""
    s, c = shape, work.compute_bytes
    rows = rows or work.rows
    n = rows.tokens
    layer, input_copy = layer_bytes(s, rows, work, c)
    # outside the layers: rotary cos and sin, the final norm, the hidden states at the loss tokens (the head's input)
    outside = 2 * c * s.head_dim * n + rmsnorm_bytes(c) * s.hidden * n + c * s.hidden * rows.loss_tokens
    if work.attention == "sdpa":  # made once per micro-batch, read by every layer (flex's block mask is small):
        keys = rows.completions * (rows.prompt + rows.completion)  # the completions' key index and additive mask
        outside += keys * 8 + c * rows.completion * keys
    # a layer's backward: the gradients of its output and input in flight, the MLP's widest gradients
    backward = n * (2 * c * s.hidden + 2 * c * s.intermediate)
    if not work.checkpointing:
        return Activations(s.layers * layer + outside, backward, layer)
    # each layer keeps its input (the checkpoint's); the backward recomputes one layer at a time
    return Activations(s.layers * c * s.hidden * n + outside, layer - input_copy + backward, c * s.hidden * n)


def head_bytes(
    positions: int,
    vocab: int,
    compute_bytes: int,
    block: int = DEFAULT_BLOCK_TOKENS,
    top_p: float = 1.0,
    fused: bool = False,
) -> int:
    """The LM head's forward (``trainer/head.HeadLogprobs``) over ``positions`` loss tokens, a block of rows at a
    time: one block's float32 logits and their exponentials (the compute-dtype logits are freed as they are cast),
    under top-p the nucleus's boolean mask and masked copy (or, before, its sort's values and int64 indices, in parts
    of at most ``SORT_ELEMENTS``); three float32 numbers a position (logprob, entropy, log-sum-exp; and the cut).
    ``fused`` (``FusedHeadLogprobs``): the block's logits in the compute dtype alone, beside them under top-p the
    sort's values, indices and their float32 copy."""
    rows = min(block, positions)
    width = rows * vocab
    if fused:
        working = width * compute_bytes + (min(width, SORT_ELEMENTS) * (compute_bytes + 8 + F32) if top_p < 1 else 0)
    else:
        working = width * max(compute_bytes + F32, 2 * F32)
        if top_p < 1:
            working = max(width * (3 * F32 + 1), width * F32 + min(width, SORT_ELEMENTS) * (F32 + 8))
    return working + positions * (3 + (top_p < 1)) * F32


def head_backward_bytes(
    positions: int,
    shape: ModelShape,
    compute_bytes: int,
    block: int,
    top_p: float = 1.0,
    fused: bool = False,
    fp32_output_gemm: bool = True,
) -> int:
    """The head's backward beyond what the forward kept, but for its weight's gradient (``head_weight_gradient``):
    the gradient of the hidden states; a block's logits recomputed in float32 and turned into their gradient in
    place, its cast to the compute dtype beside it, the nucleus's mask and masked copy under top-p (``fused``: the
    block in the compute dtype, turned into its gradient in place). bf16 without a float32-output GEMM (a CPU):
    the block's gradient cast to float32 for the weight's."""
    c, rows = compute_bytes, min(block, positions)
    if fused:
        per_element = c
    else:
        per_element = F32 + (c if c != F32 else 0) + (F32 + 1 if top_p < 1 else 0)
    if c != F32 and not fp32_output_gemm:
        per_element += F32
    return c * positions * shape.hidden + rows * shape.vocab * per_element


def head_weight_gradient(shape: ModelShape, compute_bytes: int) -> int:
    """The head weight's gradient while the head's backward runs: a float32 accumulator over the blocks, each
    block's product added into it by the GEMM itself; in bf16 then its cast to the compute dtype, as large."""
    return (F32 + (compute_bytes if compute_bytes != F32 else 0)) * shape.vocab * shape.hidden


def nccl_bytes(ranks: int) -> int:
    """One NCCL communicator's buffers on one of its ranks (``NCCL_TWO_RANKS``, ``NCCL_MORE_RANKS``; 0 ranks: not
    known here, servers at ``inference.urls``)."""
    return NCCL_TWO_RANKS if ranks == 2 else NCCL_MORE_RANKS


def estimate(shape: ModelShape, work: Workload, source: str = "") -> MemoryPlan:
    """Every term and each moment's bytes per trainer GPU (rank 0's, the busiest), for micro-batches of any rows
    up to ``work.row_tokens`` long: the worst of them (a longer prompt leaves a token budget fewer completions,
    so the head's positions peak at short prompts and, under a completions' cap, the activations at long ones)."""
    completion = min(work.completion_tokens, work.row_tokens - 1)
    longest = max(work.row_tokens - completion, 1)
    prompts = sorted({1, longest, *range(ROW_STEP, longest, ROW_STEP)})
    rows = [replace(work, row_tokens=p + completion).rows for p in prompts]
    if work.ranks > 1:  # a rank with fewer micro-batches than the busiest runs stand-ins (under flex, long ones)
        rows.append(stand_in_shape(work.batching, work.attention))
    return max((estimate_rows(shape, work, r, source) for r in rows), key=lambda plan: plan.peak)


def estimate_rows(shape: ModelShape, work: Workload, rows: MicroBatchShape, source: str = "") -> MemoryPlan:
    """The plan of micro-batches of ``rows``."""
    w, c, P, R = work, work.compute_bytes, shape.parameters(), work.ranks
    trained = w.lora_parameters if w.lora_parameters is not None else P
    copy = R == 1 and c != F32 and w.lora_parameters is None  # one process in bf16: the compute copy
    act = activation_bytes(shape, w, rows)
    saved = act.kept
    state = {
        "weights": c * P + F32 * trained if w.lora_parameters is not None else F32 * P // R,
        "optimizer": 2 * F32 * trained // R,
        "algorithm state": w.extra_state * trained // R,
        "compute copy": c * P if copy else 0,
    }
    fixed = {
        "CUDA context": CUDA_CONTEXT if w.cuda else 0,
        "NCCL": sum(nccl_bytes(ranks) for _, ranks, _ in w.communicators) if w.cuda else 0,
    }
    step = {**state, "gradients": F32 * trained // R, "engine": w.engine_train}
    working = gradient_working_set(shape, w, copy)
    head_trains = w.lora_parameters is None
    head = head_bytes(rows.loss_tokens, shape.vocab, c, w.head_block, w.top_p, w.fused_head)
    head_backward = head_backward_bytes(rows.loss_tokens, shape, c, w.head_block, w.top_p, w.fused_head, w.cuda)
    transient = {
        "forward's end": {"gathered": working.forward, "activations": saved, "head": head},
        "head's backward": {
            "gathered": working.forward,
            "activations": saved,
            "head": head_backward,
            "head gradient": head_weight_gradient(shape, c) if head_trains else 0,
        },
        # the last layer's backward, or the next, which has freed one layer's activations but holds the last's
        # reduce-scatter input (FSDP2)
        "a layer's backward": max(
            (
                {
                    "gathered": working.layer + in_flight,
                    "activations": saved - freed,
                    "backward": act.backward,
                    "gradients in flight": working.head_gradient,
                }
                for in_flight, freed in ((0, 0), (working.reduce_in_flight, act.per_layer))
            ),
            key=lambda parts: sum(parts.values()),
        ),
        "backward's end": {"gathered": working.end},
        "optimizer step": {},
    }
    moments = {}
    for name, parts in transient.items():
        parts = {k: v for k, v in parts.items() if v}
        varying = sum(parts.get(k, 0) for k in VARYING_TERMS)
        reserve = int(ALLOCATOR_RESERVE * varying) if w.cuda else 0
        moments[name] = {**step, **parts, **fixed, "allocator reserve": reserve}
    # the push: after the optimizer step (no gradients), one bucket gathered at a time (its shard cast first, on
    # every rank), a transport's copy of it; an engine awake to take it
    bucket = w.push_bucket + (w.push_bucket // R if R > 1 else 0) + (w.push_bucket if w.push_copy else 0)
    push = {"push bucket": bucket}
    moments["weight push"] = {**state, "engine": w.engine_push, **push, **fixed, "allocator reserve": 0}
    return MemoryPlan(shape, source, work, rows, moments)


@dataclass(frozen=True)
class WorkingSet:
    forward: int  # parameters gathered through the forward and the head (FSDP2's root)
    layer: int  # in a decoder layer's backward: the parameters gathered, the layer's gradients before they are reduced
    reduce_in_flight: int  # in the next layer's backward: the last one's reduce-scatter input, still kept
    head_gradient: int  # the head weight's gradient, held through the layers' backward
    end: int  # at the backward's end, beyond the state and the sharded gradients


def gradient_working_set(shape: ModelShape, w: Workload, copy: bool) -> WorkingSet:
    """FSDP2's gathered parameters and unreduced gradients, or one process's fresh gradients, at each moment."""
    c, root, layer = w.compute_bytes, shape.root_parameters(), shape.layer_parameters()
    head = shape.vocab * shape.hidden
    if w.ranks > 1:
        # the root stays gathered from its forward to its backward. In a layer's backward: the layer gathered, the
        # next one's all-gather done ahead (prefetched), the layer's gradients in the compute dtype; from the second
        # layer on, the float32 reduce-scatter input of the layer before, kept until this one's is made. The root's
        # gradients (the head's first) wait for its reduce-scatter at the backward's end, after the root reshards:
        # their float32 copy-in beside them, then the reduced shard
        return WorkingSet(
            c * root,
            c * root + 3 * c * layer,
            F32 * layer,
            c * head if w.lora_parameters is None else 0,
            F32 * root + max(c * root, F32 * root // w.ranks),
        )
    if w.lora_parameters is not None:
        return WorkingSet(0, 0, 0, 0, 0)  # the frozen base has no gradient; the adapter's are small
    if copy:  # the bf16 copy's gradients pile up through the backward, then go into the float32 .grad
        return WorkingSet(0, 0, 0, c * head, c * shape.parameters())
    # float32, one process: a parameter's fresh gradient before it is added into .grad (the embeddings' the largest);
    # a tied head's waits for the embedding's (autograd sums a leaf's gradients before accumulating them)
    return WorkingSet(0, 0, 0, F32 * head if shape.tied else 0, F32 * head)


# ---- from the config ----------------------------------------------------------------------------------


def lora_parameters(shape: ModelShape, rank: int, targets: list[str]) -> int:
    """The adapter's parameters: ``rank x (in + out)`` for each targeted linear of each layer."""
    h, q, kv, inner = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    sizes = {
        "q_proj": h + q,
        "k_proj": h + kv,
        "v_proj": h + kv,
        "o_proj": q + h,
        "gate_proj": h + inner,
        "up_proj": h + inner,
        "down_proj": inner + h,
    }
    return shape.layers * rank * sum(sizes.get(name, 0) for name in targets)


def workload(
    cfg, shape: ModelShape, *, ranks: int, gpu_bytes: int | None, row_tokens: int | None = None, vllm: bool = False
) -> Workload:
    """One trainer rank's ``Workload`` under ``cfg`` (a ``TrainConfig``), rank 0's where ranks differ. ``row_tokens``:
    the longest sequence (None: ``seq_len``); ``vllm``: whether a colocated ``auto`` backend gets vLLM (installed)."""
    c = F32 if cfg.dtype == "float32" else 2  # "auto" trains in bf16 on a GPU
    dep = cfg.deployment
    servers = dep.num_infer_gpus > 0 or bool(cfg.inference.urls)
    cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and gpu_bytes is not None)
    engine_train = engine_push = 0
    # a push gathers and sends deployment.weight_bucket_mib of full weights at a time, one whole tensor at least
    bucket = max(int(dep.weight_bucket_mib * (1 << 20)), c * shape.vocab * shape.hidden)
    push_bucket = bucket  # servers: every rank gathers each bucket, rank 0 hands it to the transport
    if not servers and (cfg.inference.backend == "vllm" or (cfg.inference.backend == "auto" and vllm)):
        share = int((cfg.inference.gpu_memory_utilization or COLOCATED_GPU_SHARE) * (gpu_bytes or 0))
        engine_train, engine_push = (share if cfg.inference.sleep_level == 0 else 0), share
    elif not servers:  # transformers: one process samples from the trained module; under FSDP a per-rank copy
        engine_train = engine_push = c * shape.parameters() if ranks > 1 else 0
        push_bucket = bucket if ranks > 1 else 0
    nccl_push = servers and cuda and dep.weight_sync_on(True) == "nccl"
    # FSDP2's among the trainer ranks (one node's: the launcher's, or torchrun's); rank 0's push group with the
    # launcher's servers on the same node, or with servers elsewhere (inference.urls: their GPUs unknown here)
    push_group = (
        ("weight push", 0, "network") if cfg.inference.urls else ("weight push", 1 + dep.num_infer_gpus, "NVLink/PCIe")
    )
    communicators = ((("FSDP2", ranks, "NVLink/PCIe"),) if cuda and ranks > 1 else ()) + (
        (push_group,) if nccl_push else ()
    )
    lora = lora_parameters(shape, cfg.lora.rank, cfg.lora.target_modules) if cfg.lora.enabled else None
    attention = cfg.attention if cfg.attention != "auto" else ("flex" if cuda else "sdpa")
    fused_head = kernels.resolve(cfg.kernels, torch.device("cuda" if cuda else "cpu")) == "compile"
    return Workload(
        ranks=ranks,
        compute_bytes=c,
        micro_batch_tokens=cfg.micro_batch_tokens,
        micro_batch_size=cfg.micro_batch_size,
        row_tokens=row_tokens or cfg.seq_len,
        completion_tokens=cfg.max_completion_tokens,
        checkpointing=cfg.activation_checkpointing,
        group_size=cfg.group_size,
        share_prompts=cfg.share_prompts,
        attention=attention,
        head_block=cfg.head_block_tokens or DEFAULT_BLOCK_TOKENS,
        fused_head=fused_head,
        top_p=cfg.top_p,
        lora_parameters=lora,
        extra_state=algorithms.state_bytes_per_param(cfg),
        engine_train=engine_train,
        engine_push=engine_push,
        push_bucket=push_bucket,
        push_copy=nccl_push,
        cuda=cuda,
        communicators=communicators,
    )


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


def usable(gpu_bytes: int) -> int:
    """What a run may plan on: the GPU less ``HEADROOM`` (kernel workspaces, a compiled kernel's scratch, the
    estimate's own error: what the plan cannot count)."""
    return int((1 - HEADROOM) * gpu_bytes)


def fits(shape: ModelShape, work: Workload, gpu_bytes: int) -> bool:
    return estimate(shape, work).peak <= usable(gpu_bytes)


def longest_row_that_fits(shape: ModelShape, work: Workload, gpu_bytes: int) -> int | None:
    """The longest sequence (prompt + completion, at most ``work.row_tokens``) such that micro-batches of rows up to
    it fit; None when not even a full-length completion after a one-token prompt fits."""
    low, high = work.completion_tokens + 1, work.row_tokens
    if not fits(shape, replace(work, row_tokens=low), gpu_bytes):
        return None
    while low < high:  # the plan of rows up to a length grows with the length
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(shape, replace(work, row_tokens=mid), gpu_bytes) else (low, mid - 1)
    return low


BUDGET_SEARCH_LIMIT = 1 << 20  # token budgets past this are "any"


def largest_budget_that_fits(shape: ModelShape, work: Workload, gpu_bytes: int) -> int | None:
    """The largest ``micro_batch_tokens`` whose micro-batches fit (a multiple of 128 under flex attention, whose
    rows are padded to it), with rows up to ``work.row_tokens``; 0 when none does; None when any does (a
    ``micro_batch_size`` cap binds first)."""
    step = FLEX_BLOCK if work.attention == "flex" else 1
    budget = lambda tokens: replace(work, micro_batch_tokens=tokens * step)  # noqa: E731
    if fits(shape, budget(BUDGET_SEARCH_LIMIT // step), gpu_bytes):
        return None
    low, high = 0, BUDGET_SEARCH_LIMIT // step
    while low < high:  # in units of ``step``; budget 0 would be "no bound", so 1 unit is the least tried
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(shape, budget(mid), gpu_bytes) else (low, mid - 1)
    return low * step


def peak_terms(plan: MemoryPlan) -> dict[str, int]:
    """The terms of the moment at the peak, largest first."""
    parts = plan.moments[plan.peak_moment]
    return dict(sorted(((k, v) for k, v in parts.items() if v), key=lambda kv: -kv[1]))


def fixes(shape: ModelShape, work: Workload, gpu_bytes: int, cfg) -> str:
    """The changes to ``cfg`` (a ``TrainConfig``) that each alone make ``work`` fit, each naming the term it cuts and
    its size at the peak, those that need no more hardware first; else the combination of checkpointing and GPUs."""
    plan = estimate(shape, work)
    at_peak = peak_terms(plan)
    checkpointing = "--activation-checkpointing"
    launcher = cfg.deployment.num_infer_gpus > 0 and not cfg.inference.urls
    gpus_flag = "--deployment.num-train-gpus {}" if launcher else "torchrun --nproc-per-node {}"
    found: list[str] = []  # what costs no hardware first, each naming the term it cuts and its size at the peak
    activations = sum(at_peak.get(k, 0) for k in ("activations", "backward", "head"))
    if not work.checkpointing and fits(shape, replace(work, checkpointing=True), gpu_bytes):
        found.append(f"cut the activations ({gib(activations)} at the peak) with {checkpointing}")
    budget = largest_budget_that_fits(shape, work, gpu_bytes)
    if budget and budget < plan.rows.tokens:
        found.append(f"cut the activations ({gib(activations)} at the peak) with --micro-batch-tokens {budget}")
    if work.engine_push:  # the colocated engine's share, as long as it still holds its own weights
        least = work.compute_bytes * shape.parameters() + GIB
        share = next(
            (
                u / 20
                for u in range(19, 0, -1)
                if u / 20 * gpu_bytes > least
                and fits(
                    shape,
                    replace(
                        work,
                        engine_push=int(u / 20 * gpu_bytes),
                        engine_train=int(u / 20 * gpu_bytes) if work.engine_train else 0,
                    ),
                    gpu_bytes,
                )
            ),
            None,
        )
        if share:
            found.append(
                f"cut the colocated engine's share ({gib(work.engine_push)}) with "
                f"--inference.gpu-memory-utilization {share:g}"
            )
    gpus = next((r for r in range(work.ranks + 1, 257) if fits(shape, replace(work, ranks=r), gpu_bytes)), None)
    if gpus:
        state = sum(at_peak.get(k, 0) for k in ("weights", "gradients", "optimizer", "algorithm state", "compute copy"))
        what = "weights, gradients, AdamW moments" + (
            " and the algorithm's state" if at_peak.get("algorithm state") else ""
        )
        found.append(f"shard the {what} ({gib(state)} at the peak) over more trainer GPUs ({gpus_flag.format(gpus)})")
    if found:
        return ", or ".join(found)
    gpus = next(
        (r for r in range(work.ranks, 257) if fits(shape, replace(work, checkpointing=True, ranks=r), gpu_bytes)), None
    )
    if gpus is None:
        return "no combination of checkpointing and GPUs fits: a smaller model, or a LoRA adapter (--lora.enabled)"
    together = ([] if work.checkpointing else [checkpointing]) + (
        [gpus_flag.format(gpus)] if gpus != work.ranks else []
    )
    return "no one change fits; together: " + " ".join(together)


def over(plan: MemoryPlan, gpu_bytes: int, where: str) -> str:
    """``needs about X GiB at its peak (moment, ...), over the Y GiB a run may plan on of a GPU of Z GiB (where)``."""
    return (
        f"needs about {gib(plan.peak)} at its peak ({plan.peak_moment}, micro-batches of up to {plan.rows.tokens} "
        f"tokens), over the {gib(usable(gpu_bytes))} a run may plan on of the GPU's {gib(gpu_bytes)} ({where}; "
        f"{HEADROOM:.0%} is left for what the plan cannot count)"
    )


def check_fit(plan: MemoryPlan, gpu_bytes: int, where: str, cfg) -> int | None:
    """Raise ``PreflightError`` when even micro-batches of full-length completions after one-token prompts cannot
    fit a GPU of ``gpu_bytes`` (its figures and the fixes it names are for rows up to seq_len); else return the
    longest row that fits (None: any row up to seq_len)."""
    if plan.peak <= usable(gpu_bytes):
        return None
    row = longest_row_that_fits(plan.shape, plan.work, gpu_bytes)
    if row is not None:
        return row
    raise PreflightError(
        f"memory: a trainer GPU {over(plan, gpu_bytes, where)}; fix: {fixes(plan.shape, plan.work, gpu_bytes, cfg)}"
    )


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def largest_head_block(shape: ModelShape, work: Workload, gpu_bytes: int) -> int:
    """The largest of ``HEAD_BLOCKS`` whose plan fits a GPU of ``gpu_bytes`` (the smallest when none does)."""
    return next((b for b in HEAD_BLOCKS[:0:-1] if fits(shape, replace(work, head_block=b), gpu_bytes)), HEAD_BLOCKS[0])


def planned_workload(
    cfg, *, ranks: int, gpu: tuple[int, str] | None, row_tokens: int | None = None
) -> tuple[ModelShape, str, Workload] | str:
    """(the model's shapes, where they came from, ``cfg``'s trainer ``Workload`` with the head's block size chosen
    where ``head_block_tokens`` is 0 and a GPU's size is known: ``gpu``'s, else this machine's, as the trainer
    chooses it), or a one-line note saying why there is no plan."""
    found = model_shape(cfg.model)
    if found is None:
        return (
            f"no memory plan: the shapes of model {cfg.model!r} are unknown here (not a local directory, "
            "not in the hub cache, not a known Qwen3 size)"
        )
    shape, source = found
    vllm = importlib.util.find_spec("vllm") is not None
    work = workload(cfg, shape, ranks=ranks, gpu_bytes=gpu[0] if gpu else None, row_tokens=row_tokens, vllm=vllm)
    size = gpu or gpu_size(cfg.deployment)
    if not cfg.head_block_tokens and size and work.cuda:
        work = replace(work, head_block=largest_head_block(shape, work, size[0]))
    return shape, source, work


def head_block_tokens(cfg, ranks: int, device: torch.device) -> int:
    """The trainer's head block: ``head_block_tokens``, or where it is 0 the plan's choice on a CUDA device (at
    seq_len: rows up to it fit with it), ``DEFAULT_BLOCK_TOKENS`` elsewhere or without a plan."""
    if cfg.head_block_tokens or device.type != "cuda":
        return cfg.head_block_tokens or DEFAULT_BLOCK_TOKENS
    planned = planned_workload(cfg, ranks=ranks, gpu=gpu_size(cfg.deployment))
    return DEFAULT_BLOCK_TOKENS if isinstance(planned, str) else planned[2].head_block


def plan_run(
    cfg, *, ranks: int, gpu: tuple[int, str] | None, row_tokens: int | None = None
) -> tuple[MemoryPlan, int | None] | str:
    """(the plan of ``cfg``'s trainer GPUs, the longest row that fits when seq_len's does not), or a one-line
    note saying why there is no plan. Raises ``PreflightError`` for a run that cannot fit."""
    planned = planned_workload(cfg, ranks=ranks, gpu=gpu, row_tokens=row_tokens)
    if isinstance(planned, str):
        return planned
    shape, source, work = planned
    plan = estimate(shape, work, source)
    row = check_fit(plan, gpu[0], gpu[1], cfg) if gpu else None
    return plan, row


def check_rows(cfg, longest_prompt: int, ranks: int) -> None:
    """A run on CUDA, once its prompts are known and before any weight loads: refuse (``PreflightError``)
    when micro-batches of rows up to its longest prompt plus a full-length completion cannot fit a trainer GPU."""
    row = min(cfg.seq_len, longest_prompt + cfg.max_completion_tokens)
    gpu = gpu_size(cfg.deployment)
    planned = plan_run(cfg, ranks=ranks, gpu=gpu, row_tokens=row)  # refuses what even the shortest rows cannot fit
    if gpu is None or isinstance(planned, str) or planned[1] is None:  # no GPU size known: nothing to check
        return
    plan, fits_row = planned
    raise PreflightError(
        f"memory: with sequences of up to {row} tokens (the data's longest prompt, {longest_prompt} tokens, + "
        f"max_completion_tokens) a trainer GPU {over(plan, gpu[0], gpu[1])}; rows up to {fits_row} tokens fit; "
        f"fix: {fixes(plan.shape, plan.work, gpu[0], cfg)}, or --seq-len {fits_row} (longer prompts are then left out)"
    )
