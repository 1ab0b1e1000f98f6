"""The LM head and its softmax over blocks of tokens: no [tokens x vocabulary] float32 tensor in a step.

The training forward stops at the final hidden states (``hidden_states_out``: the model's output
embedding returns its input for the duration of the forward and records the weight it would have used)
and this module turns them into what the losses need, ``block_tokens`` tokens at a time:

- ``token_logprobs``: the sampled tokens' logprobs under the sampling distribution (temperature, the
  top-p nucleus) and the entropy, as ``scirl.trainer.loss.token_logprobs`` computes them from logits;
- a self-teacher's top-k targets (``teacher_targets``) and the student's logprobs at those ids
  (``student_logprobs``), as ``scirl.trainer.targets`` computes them from logits.

``HeadLogprobs`` is an autograd function whose backward recomputes each block's logits from the saved
hidden states, weight and per-row log-sum-exp instead of storing them, and accumulates the gradients of
the hidden states and of the head's weight (under tied embeddings the embedding's: the same parameter).
The peak of the head is a few [block_tokens, V] float32 tensors, whatever the micro-batch's size.

Blocks of rows, not chunks of the vocabulary (prime-rl's online log-sum-exp): every row's arithmetic is
the one the full-logits path does (the same ops over the same row), the nucleus's sort and the teacher's top-k
need a whole row, and the memory bound is the same (block_tokens x V instead of tokens x chunk).
Why by hand: Liger-Kernel's fused linear cross-entropy and GRPO losses are Triton (no CPU), compute their
own loss rather than the logprobs and entropy ours needs, and know no nucleus; torch has no such op.

Under FSDP2 the weight is the one the root module's forward gathered (recorded during that forward); the
root keeps its parameters gathered after its forward until the backward, so it is valid until then.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from scirl.trainer.targets import TeacherTargets, renormalised, student_logprobs, teacher_targets, with_tail

DEFAULT_BLOCK_TOKENS = 512  # 512 x 151,936 float32 logits: 311 MB per [block, V] tensor
SORT_ELEMENTS = 1 << 24  # the nucleus's sort (values and int64 indices) runs over at most this many elements


@contextmanager
def hidden_states_out(model: torch.nn.Module):
    """Inside, ``model(...).logits`` are the final hidden states (after the final norm, sliced by
    ``logits_to_keep``): the output embedding returns its input. Yields a dict whose ``"weight"`` is
    the head weight the last forward would have used (the gathered one under FSDP2)."""
    head = model.get_output_embeddings()
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError("the block-wise LM head does not apply final_logit_softcapping")
    seen: dict = {}

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        seen["weight"] = head.weight
        if getattr(head, "bias", None) is not None:
            raise ValueError("the block-wise LM head expects a head without bias")
        return hidden

    head.forward = forward
    try:
        yield seen
    finally:
        del head.forward  # the class's forward again


def block_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 logits / temperature of a block of rows: the matmul in the compute dtype, as the model's
    head computes them, then cast (the full-logits path's ``logits.float()``); into ``out`` when given (a
    buffer the blocks share: one [block, V] allocation a pass instead of one a block, which a CPU's heap
    would otherwise scatter)."""
    if out is None:
        logits = F.linear(hidden, weight).float()
    elif weight.dtype == torch.float32:
        logits = torch.mm(hidden, weight.t(), out=out)
    else:
        logits = out.copy_(F.linear(hidden, weight))
    return logits.div_(temperature) if temperature != 1.0 else logits


@torch.no_grad()
def nucleus_cut(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest logit of each row's top-p nucleus ([R, V] -> [R]), by the rule of
    ``scirl.trainer.loss.nucleus_mask``: sort ascending, drop the tokens whose cumulative probability
    stays <= 1 - top_p, keep the most likely one. The nucleus is then every token at or above the cut
    (tokens tied with the cut all stay in it; the sort's order among them is arbitrary anyway)."""
    cuts = []
    rows = max(1, SORT_ELEMENTS // logits.shape[-1])
    for part in logits.split(rows):
        ordered = part.sort(dim=-1).values
        kept = ordered.softmax(dim=-1).cumsum_(dim=-1) > 1 - top_p
        kept[:, -1] = True
        cuts.append(ordered.gather(1, kept.to(torch.int8).argmax(dim=1, keepdim=True)).squeeze(1))
    return torch.cat(cuts) if cuts else logits.new_empty(0)


def in_nucleus(logits: torch.Tensor, cut: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """``logits`` with the tokens outside the nucleus at -inf (the ``ids`` always kept); as is without one."""
    if cut is None:
        return logits
    outside = logits < cut[:, None]
    outside.scatter_(1, ids, False)
    return logits.masked_fill(outside, float("-inf"))


class HeadLogprobs(torch.autograd.Function):
    """From hidden states [N, H] and the head weight [V, H]: ``log_softmax(logits / T)`` at ``ids`` [N, k]
    and the entropy [N] (no gradient), over the nucleus when ``top_p < 1``; block by block, the backward
    recomputing each block's softmax from the saved log-sum-exp."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, temperature: float, top_p: float, block_tokens: int):
        logprobs = hidden.new_empty(ids.shape, dtype=torch.float32)
        entropy = hidden.new_empty(ids.shape[0], dtype=torch.float32)
        logsumexp = hidden.new_empty(ids.shape[0], dtype=torch.float32)
        cut = hidden.new_empty(ids.shape[0], dtype=torch.float32) if top_p < 1.0 else None
        logits_buffer, probs_buffer = (hidden.new_empty((min(block_tokens, hidden.shape[0]), weight.shape[0]),
                                                        dtype=torch.float32) for _ in range(2))
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
            # -sum p log p, log p = (logit - shift) - log(total): lse - sum p * logit would subtract two numbers the
            # size of the logits and lose a near-certain token's entropy (a few %). Outside the nucleus p = 0: with
            # the unmasked (finite) logits their terms are 0, not 0 * -inf (a batched matmul: a dot product per
            # row without a [block, V] product tensor)
            entropy[rows] = total.log().squeeze(-1) - torch.bmm(probs[:, None], logits.sub_(shift)[:, :, None]).view(-1)
            del logits, masked, probs
        del logits_buffer, probs_buffer
        ctx.save_for_backward(hidden, weight, ids, logsumexp, cut)
        ctx.settings = (temperature, block_tokens)
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, ids, logsumexp, cut = ctx.saved_tensors
        temperature, block_tokens = ctx.settings
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        # summed over blocks in float32 (one matmul over all tokens accumulates in float32 as well)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        buffer = hidden.new_empty((min(block_tokens, hidden.shape[0]), weight.shape[0]), dtype=torch.float32)
        for start in range(0, hidden.shape[0], block_tokens):
            rows = slice(start, start + block_tokens)
            n = min(block_tokens, hidden.shape[0] - start)
            g = grad_logprobs[rows].float()
            logits = in_nucleus(block_logits(hidden[rows], weight, temperature, out=buffer[:n]),
                                None if cut is None else cut[rows], ids[rows])
            # d logprob(id) / d logit = onehot(id) - p, then through the division by the temperature
            grad = logits.sub_(logsumexp[rows, None]).exp_().mul_(-g.sum(dim=1, keepdim=True))
            grad.scatter_add_(1, ids[rows], g)
            if temperature != 1.0:
                grad.div_(temperature)
            grad = grad.to(weight.dtype)
            if want_hidden:
                grad_hidden[rows] = grad @ weight
            if want_weight:
                grad_weight.add_(grad.T @ hidden[rows])
            del logits, grad
        if want_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


@dataclass
class Head:
    """The sampling distribution's settings and the block size: the losses' inputs from hidden states."""

    temperature: float = 1.0
    top_p: float = 1.0
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    def __post_init__(self):
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be at least 1, got {self.block_tokens}")

    def token_logprobs(self, hidden: torch.Tensor, weight: torch.Tensor,
                       targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden`` [T, H] of the positions that predict ``targets`` [T] -> their logprobs and entropies [T]:
        those of ``scirl.trainer.loss.token_logprobs`` (the head runs on these positions only: no compute on
        padding or prompts)."""
        logprobs, entropy = HeadLogprobs.apply(hidden, weight, targets[:, None], self.temperature, self.top_p,
                                               self.block_tokens)
        return logprobs.squeeze(1), entropy

    @torch.no_grad()
    def teacher_targets(self, hidden: torch.Tensor, weight: torch.Tensor, *, top_k: int, tail: bool) -> TeacherTargets:
        """``scirl.trainer.targets.teacher_targets`` of the logits of ``hidden`` [N, H], a block at a time
        (top_k 0, the whole vocabulary, is a [N, V] target by definition: computed at once)."""
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

    def student_logprobs(self, hidden: torch.Tensor, weight: torch.Tensor, targets: TeacherTargets, *,
                         tail: bool) -> torch.Tensor:
        """``scirl.trainer.targets.student_logprobs`` of the logits of ``hidden`` [N, H] (without the nucleus,
        as there), a block at a time with the top-k targets."""
        if targets.ids is None:
            return student_logprobs(F.linear(hidden, weight), targets, tail=tail, temperature=self.temperature)
        top, _ = HeadLogprobs.apply(hidden, weight, targets.ids, self.temperature, 1.0, self.block_tokens)
        return with_tail(top) if tail else renormalised(top)
