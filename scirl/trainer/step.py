"""The trainer's step: micro-batched forward/backward with gradient accumulation, one AdamW step per RL
step, and the full weights for the sampler and checkpoints.

Single process (CPU or one GPU): a plain module, trained in place; the generator
samples from the very same module (in bf16 runs, its bf16 compute copy: ``mixed_precision.py``). Under
torchrun (``WORLD_SIZE > 1``): the FSDP2-sharded module ``model.py`` loads (float32 masters, a bf16
compute policy on GPU); each rank trains on its share of the batch and ``full_state_dict`` gathers
the full tensors (for the generation copy and checkpoints). The loss-token count is all-reduced
first, so every rank divides by the batch's global count, as prime-rl does.

The loss, and what a micro-batch's forward/backward computes, is the run's algorithm's (``algorithm``, built
by ``scirl.algorithms``; this module never imports it): ``Trainer`` calls its ``forward_backward`` (by default:
the trainer's logprobs, ``algorithm.loss`` over them and the sampler's, backward), its ``counts`` (normalisers
beyond the loss-token count, all-reduced with it), ``new_sums``/``stats`` and ``after_step``. A self-teacher's
forward (an algorithm that distils) runs on ``teacher_hidden`` with the sequences of ``scirl/trainer/teacher.py``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from scirl.distributed import Dist
from scirl.rollouts.contract import Sample
from scirl.trainer.head import DEFAULT_BLOCK_TOKENS, Head, hidden_states_out
from scirl.trainer.full_weights import FullWeights
from scirl.trainer.lora import is_lora
from scirl.trainer.loss import LossSums, token_logprobs
from scirl.trainer.mixed_precision import ComputeCopy
from scirl.trainer.teacher import TeacherInputs, teacher_inputs


@dataclass
class MicroBatch:
    """Right-padded sequences (prompt + completion). Position t of the ``*_mask``/``logprobs``
    tensors describes the token ``input_ids[:, t]`` as a prediction target."""

    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long
    loss_mask: torch.Tensor  # [B, L] bool: completion tokens
    inference_logprobs: torch.Tensor  # [B, L] float32: sampler logprobs at completion tokens
    advantages: torch.Tensor  # [B] float32
    teacher: TeacherInputs | None = None  # a self-teacher's sequences of the rows that have one


def make_micro_batches(samples: list[Sample], micro_batch_size: int, pad_id: int,
                       micro_batch_tokens: int = 0) -> list[MicroBatch]:
    """Right-padded micro-batches of whole sequences.

    Samples of similar length share a micro-batch (sorted by length; the gradient is a sum, so the
    order does not matter), which keeps padding small when some completions stop early. With
    ``micro_batch_tokens`` a micro-batch holds as many sequences as fit in that many tokens, padding
    counted, instead of ``micro_batch_size`` (short sequences go many to a forward, long ones few).
    """
    samples = sorted(samples, key=sequence_length)
    batches = []
    for chunk in length_sorted_chunks(samples, micro_batch_size, micro_batch_tokens):
        length = max(len(s.prompt_ids) + len(s.completion_ids) for s in chunk)
        input_ids = torch.full((len(chunk), length), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(chunk), length), dtype=torch.long)
        loss_mask = torch.zeros((len(chunk), length), dtype=torch.bool)
        inference_logprobs = torch.zeros((len(chunk), length), dtype=torch.float32)
        for b, s in enumerate(chunk):
            check_sample(s)
            p, c = len(s.prompt_ids), len(s.completion_ids)
            input_ids[b, : p + c] = torch.tensor(s.prompt_ids + s.completion_ids, dtype=torch.long)
            attention_mask[b, : p + c] = 1
            loss_mask[b, p : p + c] = True
            inference_logprobs[b, p : p + c] = torch.tensor(s.logprobs, dtype=torch.float32)
        advantages = torch.tensor([float(s.advantage) for s in chunk], dtype=torch.float32)
        batches.append(MicroBatch(input_ids, attention_mask, loss_mask, inference_logprobs, advantages,
                                  teacher_inputs(chunk, pad_id)))
    return batches


def sequence_length(s: Sample) -> int:
    return len(s.prompt_ids) + len(s.completion_ids)


def length_sorted_chunks(samples: list[Sample], micro_batch_size: int, micro_batch_tokens: int = 0) -> list[list[Sample]]:
    """Consecutive runs of ``samples`` (sorted by length): ``micro_batch_size`` each, or with ``micro_batch_tokens``
    as many as keep rows x the longest row's length within it (a longer sequence alone)."""
    if not micro_batch_tokens:
        return [samples[start : start + micro_batch_size] for start in range(0, len(samples), micro_batch_size)]
    chunks: list[list[Sample]] = []
    for s in samples:
        # sorted ascending: a new sample is the longest of its chunk, so the padded size is rows x its length
        if chunks and (len(chunks[-1]) + 1) * sequence_length(s) <= micro_batch_tokens:
            chunks[-1].append(s)
        else:
            chunks.append([s])
    return chunks


def check_sample(s: Sample) -> None:
    c = len(s.completion_ids)
    if len(s.logprobs) != c or c == 0:
        raise ValueError(f"a sample has {c} completion tokens and {len(s.logprobs)} logprobs; "
                         "expected one sampling logprob per completion token (and at least one token)")


def on_device(batch, device: torch.device):
    """A copy of a micro-batch (a dataclass of tensors, its teacher inputs nested) with every tensor on ``device``."""
    def moved(value):
        if value is None:
            return None
        return on_device(value, device) if dataclasses.is_dataclass(value) else value.to(device)
    return type(batch)(*(moved(value) for value in vars(batch).values()))


def dummy_micro_batch() -> MicroBatch:
    """Two tokens, no loss token: lets a rank with fewer micro-batches join FSDP's collectives."""
    return MicroBatch(
        torch.zeros((1, 2), dtype=torch.long),
        torch.ones((1, 2), dtype=torch.long),
        torch.zeros((1, 2), dtype=torch.bool),
        torch.zeros((1, 2), dtype=torch.float32),
        torch.zeros(1, dtype=torch.float32),
    )


class Trainer:
    """One optimizer step per RL step: micro-batched forward/backward with gradient accumulation,
    clipping, AdamW. ``make_batches`` and ``forward_logprobs`` are the two hooks ``scirl.cpu.CPUTrainer``
    overrides; everything else is the same on every device."""

    def __init__(self, model, optim_cfg, algorithm, *, temperature: float, device: torch.device, dist: Dist,
                 dtype: torch.dtype, top_p: float = 1.0, head_block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 micro_batch_tokens: int = 0):
        self.model = model  # holds the float32 master weights the optimizer steps
        self.algorithm = algorithm  # the loss and what else the run's algorithm decides (``scirl.algorithms``)
        # the sampling distribution: the trainer's logprobs are taken under the same temperature and nucleus
        self.temperature, self.top_p = temperature, top_p
        # the LM head and its softmax run from the final hidden states, a block of tokens at a time (``head.py``)
        self.head = Head(temperature, top_p, head_block_tokens)
        self.micro_batch_tokens = micro_batch_tokens  # 0: micro-batches of micro_batch_size sequences
        self.device = device
        self.dist = dist
        self.dtype = dtype
        self.max_norm = optim_cfg.max_norm
        # all parameters, except under LoRA: the adapter's only (the base is frozen); clipped over these too
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.trainable,
            lr=optim_cfg.lr,
            betas=tuple(optim_cfg.betas),
            weight_decay=optim_cfg.weight_decay,
        )
        # Forward and backward run on ``compute_model``: the module itself, except in a single bf16
        # process, where it is a bf16 copy (FSDP2's mixed precision does this under torchrun). A LoRA model
        # needs none: its frozen base is held in the compute dtype and peft computes its float32 adapter as is
        copy = dist.world_size == 1 and dtype != torch.float32 and not is_lora(model)
        self.compute_copy = ComputeCopy(model, dtype) if copy else None
        self.compute_model = self.compute_copy.module if self.compute_copy is not None else model
        self.updates = 0  # optimizer steps this process has taken (skipped steps do not count)
        algorithm.attach(self)  # its own state beside the weights (an EMA teacher), made from the model

    def _all_reduce(self, values: list[float], op=None) -> list[float]:
        if self.dist.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=op or torch.distributed.ReduceOp.SUM)
        return t.tolist()

    # ---- the hooks ----

    def make_batches(self, samples: list[Sample], micro_batch_size: int, pad_id: int) -> list[MicroBatch]:
        return make_micro_batches(samples, micro_batch_size, pad_id, self.micro_batch_tokens)

    def forward_logprobs(self, mb) -> tuple[torch.Tensor, ...]:
        """(trainer logprobs, entropies, loss mask, sampler logprobs) of a micro-batch's completion tokens."""
        return self.completion_logprobs(mb)

    def forward_hidden(self, mb) -> tuple[torch.Tensor, ...]:
        """A distilling algorithm's student forward: (final hidden states [B, T, H], the head weight, the tokens they predict,
        loss mask, sampler logprobs)."""
        hidden, weight, targets, loss_mask, first = self.completion_hidden(mb.input_ids, mb.attention_mask, mb.loss_mask)
        return hidden, weight, targets, loss_mask, mb.inference_logprobs[:, first:]

    def teacher_hidden(self, teacher: TeacherInputs) -> tuple[torch.Tensor, ...]:
        """A self-teacher's forward (under no_grad, with the teacher's weights in place): (hidden states, the head
        weight, target mask)."""
        hidden, weight, _, loss_mask, _ = self.completion_hidden(teacher.input_ids, teacher.attention_mask,
                                                                 teacher.loss_mask)
        return hidden, weight, loss_mask

    def completion_logprobs(self, mb: MicroBatch) -> tuple[torch.Tensor, ...]:
        """Trainer logprobs and entropies of the completion tokens, at the sampling temperature, with
        the loss mask and sampler logprobs aligned to them."""
        hidden, weight, targets, loss_mask, first = self.completion_hidden(mb.input_ids, mb.attention_mask, mb.loss_mask)
        logprobs, entropy = self.head.token_logprobs(hidden, weight, targets, loss_mask)
        return logprobs, entropy, loss_mask, mb.inference_logprobs[:, first:]

    def completion_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor):
        """(final hidden states, the head weight, the tokens they predict, the loss mask aligned to them, the
        first position kept), from the micro-batch's earliest completion token on. The LM head is not
        applied here: ``self.head`` applies it a block of tokens at a time, at the loss tokens only."""
        starts = loss_mask.to(torch.int8).argmax(dim=1)  # first completion position per row
        first = max(int(starts.min()), 1)
        length = input_ids.shape[1]
        # hidden states of positions first-1 .. L-1; position t predicts token t+1
        with hidden_states_out(self.compute_model) as seen:
            hidden = self.compute_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                                        logits_to_keep=length - first + 1).logits
        return hidden[:, :-1], seen["weight"], input_ids[:, first:], loss_mask[:, first:], first

    @torch.no_grad()
    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        """This trainer's logprob of each token after the first of one fixed sequence, at temperature 1,
        computed as the training forward computes (the compute copy, in the compute dtype): what a
        sampler holding the same weights must reproduce (``scirl.weights.check``). Under FSDP every
        rank must call it, with the same ids (the forward's all-gathers are collectives)."""
        ids = torch.tensor([list(token_ids)], device=self.device)
        logits = self.compute_model(input_ids=ids, use_cache=False).logits[:, :-1]
        return token_logprobs(logits, ids[:, 1:])[0][0].tolist()

    def reshard_root(self) -> None:
        """Free FSDP2's gathered root parameters, so the next forward gathers them anew (around a forward
        with other weights put in place: an EMA teacher's)."""
        if hasattr(self.compute_model, "reshard"):
            self.compute_model.reshard()

    # ---- the step ----

    def forward_backward(self, mb, scales: list[float], dummy: bool = False) -> tuple[float, LossSums]:
        """One micro-batch: the algorithm's forward, loss and backward (``scales``: the batch's normalisers)."""
        return self.algorithm.forward_backward(self, on_device(mb, self.device), scales, dummy)

    def backward(self, loss: torch.Tensor, sums: LossSums, entropy: torch.Tensor, loss_mask: torch.Tensor,
                 dummy: bool) -> tuple[float, LossSums]:
        if dummy:
            # a rank with fewer micro-batches still joins FSDP's collectives, contributing nothing
            loss = loss * 0.0
            sums = type(sums)()
        else:
            sums.entropy = float(entropy[loss_mask].sum())
        # The loss is already divided by the global loss-token count, so the ranks' gradients must be
        # summed; FSDP averages them, hence the world-size factor. (FSDP's set_gradient_divide_factor(1)
        # would say the same, but needs a PREMUL_SUM reduction that gloo lacks.)
        (loss * self.dist.world_size).backward()
        if self.compute_copy is not None:
            self.compute_copy.accumulate_grads()
        return float(loss.detach()), sums

    def train_step(self, micro_batches: list) -> dict:
        """Accumulate gradients over all micro-batches (of all ranks), clip, one optimizer step.

        Returns the batch's loss, grad norm and token statistics. ``stepped`` is False when no rank
        had a single loss token (nothing to learn from) or when the loss or the gradient norm is not
        finite (``nonfinite`` True): then the update is skipped and the weights stay as they were.
        """
        counts = [float(sum(int(mb.loss_mask.sum()) for mb in micro_batches)), *self.algorithm.counts(micro_batches)]
        counts = self._all_reduce(counts)
        global_tokens = counts[0]
        max_micro_batches = len(micro_batches)
        if self.dist.world_size > 1:
            max_micro_batches = int(self._all_reduce([float(len(micro_batches))], torch.distributed.ReduceOp.MAX)[0])
        if global_tokens == 0:
            return {"stepped": False, "loss_tokens": 0}

        self.optimizer.zero_grad(set_to_none=True)
        loss_total, sums = 0.0, self.algorithm.new_sums()
        for i in range(max_micro_batches):
            dummy = i >= len(micro_batches)
            mb = micro_batches[i] if not dummy else dummy_micro_batch()
            loss, mb_sums = self.forward_backward(mb, counts, dummy=dummy)
            loss_total += loss
            sums = sums.add(mb_sums)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.max_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        loss_total, *totals = self._all_reduce([loss_total, *sums.as_list()])
        grad_norm = float(grad_norm)  # the global norm: every rank sees the same value
        if not (math.isfinite(grad_norm) and math.isfinite(loss_total)):
            # one NaN applied makes every weight NaN; skipping keeps the last good weights and optimizer state
            self.optimizer.zero_grad(set_to_none=True)
            return {"stepped": False, "nonfinite": True, "loss_tokens": int(global_tokens)}
        self.optimizer.step()
        self.updates += 1
        self.optimizer.zero_grad(set_to_none=True)
        if self.compute_copy is not None:
            self.compute_copy.refresh()
        self.algorithm.after_step()

        tokens, masked, mismatch_kl, entropy = totals[:4]
        stats = {
            "stepped": True,
            "loss": loss_total,
            "grad_norm": grad_norm,
            "loss_tokens": int(tokens),
            "masked_fraction": masked / max(tokens, 1),
            "mismatch_kl": mismatch_kl / max(tokens, 1),
            "entropy": entropy / max(tokens, 1),
        }
        stats.update(self.algorithm.stats(totals, self.dist.world_size))
        return stats

    def batches(self, samples: list[Sample], micro_batch_size: int, pad_id: int) -> list:
        """A step's micro-batches (``make_batches``) of the samples the algorithm learns from (``select``)."""
        return self.make_batches(self.algorithm.select(samples), micro_batch_size, pad_id)

    # ---- state for the generation copy and checkpoints ----

    def full_weights(self, *, device: str | torch.device, dtype: torch.dtype | None = None, all_ranks: bool = True,
                     first: tuple[str, ...] = ()) -> FullWeights:
        """Full (unsharded) HF-named tensors, each gathered as it is read, each rank's shard cast to ``dtype`` first
        (``full_weights.py``): a push reads them a bucket at a time. Under FSDP every rank must read them all; with
        ``all_ranks=False`` only rank 0 keeps them, the others read None. A LoRA model gives its merged weights.
        ``first``: names read before the others."""
        return FullWeights(self.model, device=device, dtype=dtype, keep=all_ranks or self.dist.is_main, first=first)

    def full_state_dict(self, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                        all_ranks: bool = True) -> dict[str, torch.Tensor]:
        """``full_weights`` as one dict (checkpoints: on CPU, a tensor at a time; the others get {})."""
        weights = self.full_weights(device=device, dtype=dtype, all_ranks=all_ranks)
        return {name: tensor for name, tensor in weights if tensor is not None}

    def optimizer_state_dict(self) -> dict:
        """The optimizer state, keyed by parameter name so it survives a change of sharding.
        Under FSDP every rank must call this; the full state comes back on rank 0 only (on CPU),
        which is the rank that writes checkpoints."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.model, self.optimizer, options=options)

    def load_optimizer_state_dict(self, state: dict | None) -> None:
        """Load a full optimizer state (as ``optimizer_state_dict`` returns it). Under FSDP every rank
        must call this, but only rank 0 needs ``state``: it broadcasts each tensor and every rank keeps
        its own shard, so the full state (AdamW: 8 bytes per parameter, ~64 GB for an 8B model) is held
        by one process instead of one per rank. The other ranks pass None."""
        if self.dist.world_size == 1:
            options = StateDictOptions(full_state_dict=True)
        else:
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            if not self.dist.is_main:
                state = {}  # torch reads only rank 0's dict; the others receive the param groups and tensors
        set_optimizer_state_dict(self.model, self.optimizer, state, options=options)
