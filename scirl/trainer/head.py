"""The LM head and its softmax over blocks of tokens: no [tokens x vocabulary] float32 tensor in a step.

The training forward stops at the final hidden states (``hidden_states_out``) and this module computes from them,
``block_tokens`` rows at a time, what the losses need: the sampled tokens' logprobs and entropies under the
sampling temperature and nucleus (``token_logprobs``, as ``loss.token_logprobs`` from logits), a self-teacher's
top-k targets and the student's logprobs at those ids (as ``targets.py`` from logits).

``HeadLogprobs``'s backward recomputes each block's logits from the saved log-sum-exp instead of storing them and
adds each block's weight gradient into a float32 accumulator by the GEMM itself (a tied head's reaches the
embedding): the head's peak is a few [block, V] float32 tensors whatever the micro-batch. ``FusedHeadLogprobs``
(with ``kernels = "compile"``) compiles each block's elementwise work: one [block, V] tensor in the compute dtype,
a pass or two over it.

Blocks of rows, not vocabulary chunks (prime-rl's online log-sum-exp): each row's arithmetic stays the full-logits
path's, the nucleus's sort and the top-k need whole rows, and the memory bound is the same. By hand because
Liger-Kernel's fused losses are Triton-only, compute their own loss rather than logprobs and entropies, and know
no nucleus; torch has no such op.

Under FSDP2 the weight is the one the root's forward gathered, which the root keeps until its backward.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from scirl.trainer.targets import TeacherTargets, renormalised, student_logprobs, teacher_targets, with_tail

DEFAULT_BLOCK_TOKENS = 512  # 512 x 151,936 float32 logits: 311 MB per [block, V] tensor
SORT_ELEMENTS = 1 << 24  # the nucleus's sort (values and int64 indices) runs over at most this many elements


@contextmanager
def hidden_states_out(model: torch.nn.Module):
    """Inside, ``model(...).logits`` are the final hidden states (after the final norm): the output embedding
    returns its input. Yields a dict whose ``"weight"`` is the head weight the latest forward would have used (under
    FSDP2 the gathered one). Nested, the outer one's is back on the way out."""
    # transformers' method; torch types an attribute it does not know as a Tensor or a Module
    head: torch.nn.Module = model.get_output_embeddings()  # type: ignore[operator]
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError("the block-wise LM head does not apply final_logit_softcapping")
    seen: dict = {}

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        seen["weight"] = head.weight
        if getattr(head, "bias", None) is not None:
            raise ValueError("the block-wise LM head expects a head without bias")
        return hidden

    before = head.__dict__.get("forward")  # an outer patch's, when nested
    head.forward = forward
    try:
        yield seen
    finally:
        if before is None:
            del head.forward  # the class's forward again
        else:
            head.forward = before


def block_logits(
    hidden: torch.Tensor, weight: torch.Tensor, temperature: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 logits / temperature of a block of rows: the matmul in the compute dtype, as the model's head does,
    then cast (the full-logits path's ``logits.float()``). ``out``: a buffer the blocks share, one [block, V]
    allocation a pass instead of one a block, which a CPU's heap would scatter."""
    if out is None:
        logits = F.linear(hidden, weight).float()
    elif weight.dtype == torch.float32:
        logits = torch.mm(hidden, weight.t(), out=out)
    else:
        logits = out.copy_(F.linear(hidden, weight))
    return logits.div_(temperature) if temperature != 1.0 else logits


@torch.no_grad()
def nucleus_cut(logits: torch.Tensor, top_p: float, temperature: float = 1.0) -> torch.Tensor:
    """The smallest logit of each row's top-p nucleus under ``logits / temperature`` ([R, V] -> [R] float32, in
    ``logits``' units), by ``loss.nucleus_mask``'s rule: sort ascending, drop the tokens whose cumulative
    probability stays <= 1 - top_p, keep the most likely. The nucleus is every token at or above the cut, so
    tokens tied with it all stay in (the sort orders them arbitrarily anyway). Probabilities are float32's."""
    cuts = []
    rows = max(1, SORT_ELEMENTS // logits.shape[-1])
    for part in logits.split(rows):
        ordered = part.sort(dim=-1).values
        scaled = ordered.float() / temperature if temperature != 1.0 else ordered.float()
        kept = scaled.softmax(dim=-1).cumsum_(dim=-1) > 1 - top_p
        kept[:, -1] = True
        cuts.append(ordered.gather(1, kept.to(torch.int8).argmax(dim=1, keepdim=True)).squeeze(1).float())
    return torch.cat(cuts) if cuts else logits.new_empty(0, dtype=torch.float32)


def in_nucleus(logits: torch.Tensor, cut: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """``logits`` with the tokens outside the nucleus at -inf (the ``ids`` always kept); as is without one."""
    if cut is None:
        return logits
    outside = logits < cut[:, None]
    outside.scatter_(1, ids, False)
    return logits.masked_fill(outside, float("-inf"))


def blocks(total: int, block_tokens: int):
    """(rows, length) of each block of ``block_tokens`` of ``total`` rows, the last one shorter."""
    for start in range(0, total, block_tokens):
        yield slice(start, start + block_tokens), min(block_tokens, total - start)


def outputs(
    hidden: torch.Tensor, ids: torch.Tensor, top_p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The head's float32 outputs, filled a block at a time: logprobs [N, k], entropy, log-sum-exp and the
    nucleus's cut [N]."""
    n = ids.shape[0]
    new = lambda *shape: hidden.new_empty(shape, dtype=torch.float32)  # noqa: E731
    return new(*ids.shape), new(n), new(n), new(n) if top_p < 1.0 else None


def saved(ctx, tensors: tuple, settings: tuple, logprobs: torch.Tensor, entropy: torch.Tensor):
    """Keeps what the backward recomputes a block from; returns the outputs, the entropy without gradient."""
    ctx.save_for_backward(*tensors)
    ctx.settings = settings
    ctx.mark_non_differentiable(entropy)
    return logprobs, entropy


def gradients(ctx) -> tuple:
    """A backward's inputs: what the forward saved, its settings, and the gradients to fill (None where autograd
    wants none): the hidden states' a block at a time, the weight's summed over blocks in float32 (as one matmul
    over all tokens would accumulate)."""
    hidden, weight, ids, logsumexp, cut = ctx.saved_tensors
    want_hidden, want_weight = ctx.needs_input_grad[:2]
    return (
        hidden,
        weight,
        ids,
        logsumexp,
        cut,
        *ctx.settings,
        torch.empty_like(hidden) if want_hidden else None,
        torch.zeros_like(weight, dtype=torch.float32) if want_weight else None,
    )


class HeadLogprobs(torch.autograd.Function):
    """Hidden states [N, H], head weight [V, H] -> ``log_softmax(logits / T)`` at ``ids`` [N, k] and the entropy
    [N] (no gradient), over the nucleus when ``top_p < 1``, a block at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, temperature: float, top_p: float, block_tokens: int):
        logprobs, entropy, logsumexp, cut = outputs(hidden, ids, top_p)
        logits_buffer, probs_buffer = (
            hidden.new_empty((min(block_tokens, hidden.shape[0]), weight.shape[0]), dtype=torch.float32)
            for _ in range(2)
        )
        for start in range(0, hidden.shape[0], block_tokens):
            rows = slice(start, start + block_tokens)
            n = min(block_tokens, hidden.shape[0] - start)
            logits = block_logits(hidden[rows], weight, temperature, out=logits_buffer[:n])
            if cut is not None:
                cut[rows] = nucleus_cut(logits, top_p)
            masked = in_nucleus(logits, None if cut is None else cut[rows], ids[rows])
            # the full-logits path's steps (``TargetLogprobs``): shift, exp, normalise
            shift = masked.amax(dim=-1, keepdim=True)
            probs = torch.sub(masked, shift, out=probs_buffer[:n]).exp_()
            total = probs.sum(dim=-1, keepdim=True)
            probs.div_(total)
            lse = (shift + total.log()).squeeze(-1)
            logsumexp[rows] = lse
            logprobs[rows] = logits.gather(1, ids[rows]) - lse[:, None]
            # -sum p log p with log p = (logit - shift) - log(total): lse - sum p * logit would subtract two
            # logit-sized numbers and lose a near-certain token's entropy (a few %). The unmasked (finite) logits
            # make the terms outside the nucleus 0, not 0 * -inf; a batched matmul makes no [block, V] product
            entropy[rows] = total.log().squeeze(-1) - torch.bmm(probs[:, None], logits.sub_(shift)[:, :, None]).view(-1)
            del logits, masked, probs
        del logits_buffer, probs_buffer
        return saved(ctx, (hidden, weight, ids, logsumexp, cut), (temperature, block_tokens), logprobs, entropy)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, ids, logsumexp, cut, temperature, block_tokens, grad_hidden, grad_weight = gradients(ctx)
        buffer = hidden.new_empty((min(block_tokens, hidden.shape[0]), weight.shape[0]), dtype=torch.float32)
        for rows, n in blocks(hidden.shape[0], block_tokens):
            g = grad_logprobs[rows].float()
            logits = in_nucleus(
                block_logits(hidden[rows], weight, temperature, out=buffer[:n]),
                None if cut is None else cut[rows],
                ids[rows],
            )
            # d logprob(id) / d logit = onehot(id) - p, then through the division by the temperature
            grad = logits.sub_(logsumexp[rows, None]).exp_().mul_(-g.sum(dim=1, keepdim=True))
            grad.scatter_add_(1, ids[rows], g)
            if temperature != 1.0:
                grad.div_(temperature)
            grad = grad.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad @ weight
            if grad_weight is not None:
                accumulate_weight_grad(grad_weight, grad, hidden[rows])
            del logits, grad
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def block_stats(
    logits: torch.Tensor, ids: torch.Tensor, cut: torch.Tensor | None, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-sum-exp [R], logprobs at ``ids`` [R, k], entropy [R]) of a block's logits [R, V] (compute dtype, before
    the temperature) over the nucleus (the tokens at or above ``cut``, and the ids): ``HeadLogprobs``'s arithmetic
    written for ``torch.compile`` to fuse into a pass or two. The entropy is log Z - sum p (logit - max), because
    ``lse - sum p logit`` loses a near-certain token's to the log-sum-exp's round-off."""
    raw = logits.float()
    scaled = raw / temperature
    top = scaled.amax(dim=-1, keepdim=True)  # the most likely token's: always in the nucleus
    shifted = scaled - top
    exp = shifted.exp()
    at_ids = shifted.gather(1, ids)
    if cut is not None:
        exp = torch.where(raw >= cut[:, None], exp, 0.0)
        # the ids below the cut are in the nucleus too, each once
        repeated = (ids[:, :, None] == ids[:, None, :]).tril(-1).any(dim=-1)
        below = torch.where((raw.gather(1, ids) < cut[:, None]) & ~repeated, at_ids.exp(), 0.0)
    else:
        below = torch.zeros_like(at_ids)
    # Z = 1 + rest, the most likely token's exp(0) = 1 apart: log1p(rest) keeps the digits of a near-certain row's
    # entropy and logprobs, which 1 + rest would round away
    rest = (
        torch.where(shifted < 0, exp, 0.0).sum(dim=-1, keepdim=True)
        + below.sum(dim=-1, keepdim=True)
        + ((shifted == 0).sum(dim=-1, keepdim=True) - 1)
    )  # ties with the most likely token, in integers
    weighted = (exp * shifted).sum(dim=-1, keepdim=True) + (below * at_ids).sum(dim=-1, keepdim=True)
    log_total = rest.log1p()
    return (top + log_total).squeeze(1), at_ids - log_total, (log_total - weighted / (1 + rest)).squeeze(1)


def block_grad_(
    logits: torch.Tensor, logsumexp: torch.Tensor, grad_sum: torch.Tensor, cut: torch.Tensor | None, temperature: float
) -> None:
    """A block's logits [R, V] (compute dtype, before the temperature) become, in place, -p * grad_sum / T: the
    gradient of sum_k grad_k * logprob(id_k) except at the ids, which ``FusedHeadLogprobs`` writes after. For
    ``torch.compile``: one pass, into the block's own memory."""
    raw = logits.float()
    probs = (raw / temperature - logsumexp[:, None]).exp()
    if cut is not None:
        probs = torch.where(raw >= cut[:, None], probs, 0.0)
    logits.copy_(probs * -grad_sum / temperature)


@functools.cache
def compiled(fn):
    return torch.compile(fn, fullgraph=True)


def run_compiled(fn, buffer: torch.Tensor, n: int, *args):
    """``fn(buffer[:n], *args)`` compiled with a block's rows dynamic: one graph for blocks of any size (static
    shapes would compile one per micro-batch's last block). A one-row block runs as two equal rows, since torch
    gives a dimension of size 1 a graph of its own."""
    if n == 1:
        buffer[1].copy_(buffer[0])
        args = tuple(torch.cat([arg, arg]) if isinstance(arg, torch.Tensor) else arg for arg in args)
    block = buffer[: max(n, 2)]
    for tensor in (block, *args):
        if isinstance(tensor, torch.Tensor):
            torch._dynamo.mark_dynamic(tensor, 0)
    out = compiled(fn)(block, *args)
    return None if out is None else tuple(o[:n] for o in out)


def fused_buffer(hidden: torch.Tensor, weight: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """The blocks' shared [rows, V] logits in the compute dtype: at least two rows (``run_compiled``)."""
    return hidden.new_empty((max(min(block_tokens, hidden.shape[0]), 2), weight.shape[0]), dtype=weight.dtype)


class FusedHeadLogprobs(torch.autograd.Function):
    """``HeadLogprobs`` with each block's elementwise work compiled (``block_stats``, ``block_grad_``): ~7 passes
    over a [block, V] float32 tensor become one or two over the block's logits in the compute dtype, the only
    [block, V] tensor of the forward and of the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, temperature: float, top_p: float, block_tokens: int):
        logprobs, entropy, logsumexp, cut = outputs(hidden, ids, top_p)
        buffer = fused_buffer(hidden, weight, block_tokens)
        for rows, n in blocks(hidden.shape[0], block_tokens):
            logits = torch.mm(hidden[rows], weight.t(), out=buffer[:n])
            if cut is not None:
                cut[rows] = nucleus_cut(logits, top_p, temperature)
            logsumexp[rows], logprobs[rows], entropy[rows] = run_compiled(
                block_stats, buffer, n, ids[rows], None if cut is None else cut[rows], temperature
            )
        return saved(ctx, (hidden, weight, ids, logsumexp, cut), (temperature, block_tokens), logprobs, entropy)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, ids, logsumexp, cut, temperature, block_tokens, grad_hidden, grad_weight = gradients(ctx)
        buffer = fused_buffer(hidden, weight, block_tokens)
        for rows, n in blocks(hidden.shape[0], block_tokens):
            g, block_ids, lse = grad_logprobs[rows].float(), ids[rows], logsumexp[rows, None]
            logits = torch.mm(hidden[rows], weight.t(), out=buffer[:n])
            at_ids = logits.gather(1, block_ids).float() / temperature
            grad_sum = g.sum(dim=1, keepdim=True)
            block_cut = None if cut is None else cut[rows]
            run_compiled(block_grad_, buffer, n, logsumexp[rows], grad_sum, block_cut, temperature)
            # at the ids (always in the nucleus): d logprob(id) / d logit = onehot(id) - p, over the temperature;
            # a row's equal ids add up
            onehot = ((block_ids[:, :, None] == block_ids[:, None, :]) * g[:, None, :]).sum(dim=-1)
            at_grad = (onehot - (at_ids - lse).exp() * grad_sum) / temperature
            grad = logits.scatter_(1, block_ids, at_grad.to(logits.dtype))
            if grad_hidden is not None:
                torch.mm(grad, weight, out=grad_hidden[rows])
            if grad_weight is not None:
                accumulate_weight_grad(grad_weight, grad, hidden[rows])
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def accumulate_weight_grad(total: torch.Tensor, grad: torch.Tensor, hidden: torch.Tensor) -> None:
    """``total`` [V, H] float32 += ``grad``.T @ ``hidden`` by one GEMM that adds into it (no [V, H] product). bf16
    operands: a float32-output GEMM where torch has one (CUDA), else the block's operands cast."""
    if grad.dtype == total.dtype:
        total.addmm_(grad.t(), hidden)
    elif fp32_output_gemm(total.device):
        torch.addmm(total, grad.t(), hidden, out_dtype=total.dtype, out=total)
    else:
        total.addmm_(grad.t().float(), hidden.float())


@functools.cache
def fp32_output_gemm(device: torch.device) -> bool:
    """Whether ``torch.addmm(acc, a, b, out_dtype=float32, out=acc)`` takes bf16 ``a``, ``b`` into a float32 ``acc``
    on ``device``: CUDA only (torch >= 2.8), a float32 ``acc`` since pytorch#167931 (torch 2.10), from compute
    capability 8.0. Tried once on 2 x 2 tensors."""
    if device.type != "cuda":
        return False
    a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
    acc = torch.ones(2, 2, dtype=torch.float32, device=device)
    try:
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError):
        return False
    return bool((acc == 3).all())


@dataclass
class Head:
    """The sampling distribution's settings and the block size: the losses' inputs from hidden states."""

    temperature: float = 1.0
    top_p: float = 1.0
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    fused: bool = False  # each block's elementwise work compiled (``FusedHeadLogprobs``); else eager

    def __post_init__(self):
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be at least 1, got {self.block_tokens}")
        self.function = FusedHeadLogprobs if self.fused else HeadLogprobs

    def token_logprobs(
        self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden`` [T, H] of the positions that predict ``targets`` [T] -> their logprobs and entropies [T], as
        ``loss.token_logprobs`` (no compute on padding or prompts)."""
        logprobs, entropy = self.function.apply(
            hidden, weight, targets[:, None], self.temperature, self.top_p, self.block_tokens
        )
        return logprobs.squeeze(1), entropy

    @torch.no_grad()
    def teacher_targets(self, hidden: torch.Tensor, weight: torch.Tensor, *, top_k: int, tail: bool) -> TeacherTargets:
        """``targets.teacher_targets`` of ``hidden`` [N, H]'s logits, a block at a time (top_k 0, the whole
        vocabulary, is an [N, V] target anyway: computed at once)."""
        if not top_k:
            return teacher_targets(block_logits(hidden, weight, 1.0), top_k=0, tail=tail, temperature=self.temperature)
        ids, tops = [], []
        for part in hidden.split(self.block_tokens):
            logprobs = torch.log_softmax(block_logits(part, weight, self.temperature), dim=-1)
            top, top_ids = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
            ids.append(top_ids)
            tops.append(top)
            del logprobs
        top = torch.cat(tops) if tops else hidden.new_empty((0, min(top_k, weight.shape[0])), dtype=torch.float32)
        top_ids = torch.cat(ids) if ids else torch.zeros(top.shape, dtype=torch.long, device=hidden.device)
        return TeacherTargets(top_ids, with_tail(top) if tail else renormalised(top))

    def student_logprobs(
        self, hidden: torch.Tensor, weight: torch.Tensor, targets: TeacherTargets, *, tail: bool
    ) -> torch.Tensor:
        """``targets.student_logprobs`` of ``hidden`` [N, H]'s logits (no nucleus, as there), a block at a time
        with top-k targets."""
        if targets.ids is None:
            return student_logprobs(F.linear(hidden, weight), targets, tail=tail, temperature=self.temperature)
        top, _ = self.function.apply(hidden, weight, targets.ids, self.temperature, 1.0, self.block_tokens)
        return with_tail(top) if tail else renormalised(top)
