"""``Trainer``: one AdamW step per RL step over micro-batched forwards and backwards, the full weights for the
sampler, and the state a checkpoint keeps.

A micro-batch is one packed row (``packing.py``): each group's prompt once, its completions after it, the
attention keeping completions apart (``attention.py``). Micro-batches are sized in tokens, so short completions go
many to a forward and long ones few. The forward stops at the hidden states that predict a loss token and the LM
head runs on those alone, a block of tokens at a time (``head.py``). Indices are built on the host and statistics
stay on the device until the step ends, so a micro-batch never waits for the GPU (``tests/trainer/test_packing.py``
counts).

One process: a plain module trained in place, which the generator samples from (in bf16, its compute copy:
``mixed_precision.py``). Under torchrun: the FSDP2 module ``model.py`` loads; each rank trains its share of the
groups, divides by the batch's loss-token count (all-reduced first, as prime-rl does) and runs as many forwards as
the busiest rank (FSDP2's collectives).

The loss is the run's algorithm's (``scirl.algorithms``, handed in, never imported): ``Trainer`` calls its
``forward_backward`` (by default logprobs, ``algorithm.loss``, backward), ``counts`` (normalisers all-reduced with
the token count), ``new_sums``/``stats`` and ``after_step``; a distilling algorithm's teacher runs on
``teacher_hidden``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from scirl.distributed import Dist
from scirl.rollouts.contract import Sample
from scirl.trainer import attention, cutting
from scirl.trainer.batching import Batching
from scirl.trainer.full_weights import FullWeights
from scirl.trainer.head import DEFAULT_BLOCK_TOKENS, Head
from scirl.trainer.kernels import Kernels, compile_counts
from scirl.trainer.lora import is_lora
from scirl.trainer.loss import LossSums, token_logprobs
from scirl.trainer.mixed_precision import ComputeCopy
from scirl.trainer.packing import MicroBatch, Packed, PackedTeacher, dummy_micro_batch, dummy_teacher, to_device
from scirl.trainer.patches import training_forward


class Trainer:
    """One optimizer step per RL step (gradients accumulated over micro-batches, clipped, AdamW), the same on
    every device and any number of ranks."""

    def __init__(
        self,
        model,
        optim_cfg,
        algorithm,
        *,
        temperature: float,
        device: torch.device,
        dist: Dist,
        dtype: torch.dtype,
        top_p: float = 1.0,
        head_block_tokens: int = DEFAULT_BLOCK_TOKENS,
        batching: Batching = Batching(),
        kernels: str = "eager",
    ):
        attention.check_supported(model)
        self.model = model  # the float32 master weights the optimizer steps
        self.algorithm = algorithm
        # the sampling distribution's: the trainer's logprobs must be taken under the sampler's
        self.temperature, self.top_p = temperature, top_p
        # compiled decoder layers come with a compiled head
        self.head = Head(temperature, top_p, head_block_tokens, fused=kernels == "compile")
        self.batching = batching
        self.attention = attention.kind_for(batching.attention, device)
        self.device = device
        self.dist = dist
        self.dtype = dtype
        self.max_norm = optim_cfg.max_norm
        # under LoRA the adapter's alone (the base is frozen); the gradient norm is clipped over these
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        # fused: no float32 temporary the size of the parameters (the multi-tensor path's: ~15 GiB a rank at 8B)
        self.optimizer = torch.optim.AdamW(
            self.trainable,
            lr=optim_cfg.lr,
            betas=tuple(optim_cfg.betas),
            weight_decay=optim_cfg.weight_decay,
            fused=True,
        )
        # forward and backward run on a bf16 copy in a single bf16 process (FSDP2's mixed precision does it under
        # torchrun); LoRA needs none: its frozen base is held in the compute dtype
        copy = dist.world_size == 1 and dtype != torch.float32 and not is_lora(model)
        self.compute_copy = ComputeCopy(model, dtype) if copy else None
        self.compute_model = self.compute_copy.module if self.compute_copy is not None else model
        # compiled layers take any row length in one graph, except around flex attention (a graph a row length)
        self.kernels = Kernels(self.compute_model, kernels, dynamic=self.attention != "flex")
        self._patched: dict | None = None  # inside ``patched``: its record of the head weight
        self.updates = 0  # optimizer steps this process has taken, skipped ones not counted
        # called before the weights, optimizer or algorithm state change in place: the checkpointer waits there
        # until it has staged them
        self.before_update = lambda: None
        algorithm.attach(self)  # its state beside the weights (an EMA teacher)

    # ---- micro-batches ----

    def batches(self, samples: list[Sample]) -> list[MicroBatch]:
        """A step's micro-batches of the samples the algorithm learns from (``select``)."""
        compiled = self.kernels.name == "compile"
        return cutting.cut(self.algorithm.select(samples), self.batching, self.attention, compiled)

    def row_length(self, tokens: int) -> int:
        """The length a packed row of ``tokens`` positions is padded to (``cutting.row_length``)."""
        return cutting.row_length(tokens, self.batching, self.attention)

    def stand_in_length(self, tokens: int) -> int:
        """The row length of a stand-in micro-batch (``dummy_micro_batch``, ``cutting.stand_in_length``)."""
        return cutting.stand_in_length(tokens, self.batching, self.attention)

    def describe_batching(self) -> str:
        b = self.batching
        bounds = ([f"{b.micro_batch_tokens} tokens"] if b.micro_batch_tokens else []) + (
            [f"{b.micro_batch_size} completions"] if b.micro_batch_size else []
        )
        return " or ".join(bounds) + (
            ", each group's prompt once" if b.share_prompts else ", prompts repeated per completion"
        )

    def on_device(self, mb: MicroBatch) -> MicroBatch:
        """``mb`` on the device, its attention masks made there."""
        mb = to_device(mb, self.device, attention.host_only(self.attention))
        packed = self.prepared(mb.packed)
        teacher = (
            None if mb.teacher is None else dataclasses.replace(mb.teacher, packed=self.prepared(mb.teacher.packed))
        )
        return dataclasses.replace(mb, packed=packed, teacher=teacher)

    def prepared(self, packed: Packed) -> Packed:
        return dataclasses.replace(
            packed, layout=attention.prepare(packed.layout, self.attention, packed.forward_tokens, self.dtype)
        )

    def dummy_teacher(self) -> PackedTeacher:
        """A two-token teacher that teaches nothing, on the device: a rank without a teacher joins the teacher
        forward's all-gathers with it."""
        teacher = to_device(dummy_teacher(self.stand_in_length), self.device)
        return dataclasses.replace(teacher, packed=self.prepared(teacher.packed))

    # ---- the forwards ----

    @contextlib.contextmanager
    def patched(self):
        """The compute module under ``patches.training_forward``, entered once however the calls nest (the
        algorithm's forwards run inside ``forward_backward``'s). Yields its record of the head weight."""
        if self._patched is not None:
            yield self._patched
            return
        with training_forward(self.compute_model, self.kernels) as seen:
            self._patched = seen
            try:
                yield seen
            finally:
                self._patched = None

    def packed_hidden(self, packed: Packed) -> tuple[torch.Tensor, torch.Tensor]:
        """(final hidden states [T, H] of the positions that predict ``packed``'s loss tokens, the head weight).
        ``self.head`` applies the weight a block of tokens at a time."""
        model = self.compute_model
        with self.patched() as seen:
            hidden = model(
                input_ids=packed.input_ids,
                position_ids=packed.position_ids,
                use_cache=False,
                scirl_layout=packed.layout,
            ).logits
        return hidden[0].index_select(0, packed.predictor), seen["weight"]

    def forward_logprobs(self, mb: MicroBatch) -> tuple[torch.Tensor, ...]:
        """(trainer logprobs, entropies, loss mask, sampler logprobs), each [rows, longest completion], under the
        sampling temperature and nucleus (0 off the loss tokens)."""
        hidden, weight = self.packed_hidden(mb.packed)
        logprobs, entropy = self.head.token_logprobs(hidden, weight, mb.packed.targets)
        return self.on_grid(mb.packed, logprobs), self.on_grid(mb.packed, entropy), mb.loss_mask, mb.inference_logprobs

    def forward_hidden(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """A distilling algorithm's student: (hidden states [T, H] at the loss tokens, the head weight)."""
        return self.packed_hidden(mb.packed)

    def teacher_hidden(self, teacher: PackedTeacher) -> tuple[torch.Tensor, torch.Tensor]:
        """A self-teacher (under no_grad, its weights in place): (hidden states [Tt, H] in ``teacher.taught``'s
        order, the head weight)."""
        return self.packed_hidden(teacher.packed)

    @staticmethod
    def on_grid(packed: Packed, values: torch.Tensor) -> torch.Tensor:
        """[T] loss-token values -> [R, C], each at its place among its row's completion tokens (0 elsewhere)."""
        rows, longest = packed.loss_mask.shape
        grid = values.new_zeros(rows * longest)
        return grid.index_copy(0, packed.slot, values).view(rows, longest)

    @staticmethod
    def flat(packed: Packed, grid: torch.Tensor) -> torch.Tensor:
        """[R, C] -> [T] in ``packed.targets``' order: ``on_grid``'s inverse."""
        return grid.reshape(-1).index_select(0, packed.slot)

    @torch.no_grad()
    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        """Each token's logprob after the first, at temperature 1, on the compute copy in the compute dtype: what a
        sampler holding the same weights must reproduce (``scirl.weights.check``). Under FSDP every rank calls it
        with the same ids (the all-gathers are collectives)."""
        ids = torch.tensor([list(token_ids)], device=self.device)
        logits = self.compute_model(input_ids=ids, use_cache=False).logits[:, :-1]
        return token_logprobs(logits, ids[:, 1:])[0][0].tolist()

    def reshard_root(self) -> None:
        """Free FSDP2's gathered root parameters so the next forward gathers them anew (around an EMA teacher's
        forward, whose weights are swapped in)."""
        if isinstance(self.compute_model, FSDPModule):
            self.compute_model.reshard()

    # ---- the step ----

    def forward_backward(self, mb: MicroBatch, scales: list[float]) -> tuple[torch.Tensor, LossSums]:
        """The algorithm's forward, loss and backward of one micro-batch on the device (``scales``: the batch's
        normalisers) -> (loss, sums), device tensors."""
        with self.patched():
            return self.algorithm.forward_backward(self, mb, scales, mb.dummy)

    def backward(
        self, loss: torch.Tensor, sums: LossSums, entropy: torch.Tensor, loss_mask: torch.Tensor, dummy: bool
    ) -> tuple[torch.Tensor, LossSums]:
        if dummy:
            # a rank with fewer micro-batches still joins FSDP's collectives, contributing nothing
            loss = loss * 0.0
            sums = type(sums)()
        else:
            sums.entropy = torch.where(loss_mask, entropy.detach(), 0.0).sum()
        # the loss is divided by the global loss-token count, so the ranks' gradients must be summed, and FSDP
        # averages them (set_gradient_divide_factor(1) would say so, but needs PREMUL_SUM, which gloo lacks)
        (loss * self.dist.world_size).backward()
        if self.compute_copy is not None:
            self.compute_copy.accumulate_grads()
        return loss.detach(), sums

    def train_step(self, micro_batches: list[MicroBatch]) -> dict:
        """Gradients accumulated over every rank's micro-batches, clipped, one optimizer step -> the loss, grad
        norm, token statistics and this process's compiles so far (``kernels.compile_counts``). ``stepped`` False:
        no rank had a loss token, or the loss or the gradient norm was not finite (``nonfinite``); the weights stay
        as they were."""
        counts = [float(sum(mb.loss_tokens for mb in micro_batches)), *self.algorithm.counts(micro_batches)]
        shares = self.all_reduce([*counts, float(sum(mb.unique_tokens for mb in micro_batches))])
        counts, unique = shares[:-1], shares[-1]
        global_tokens = counts[0]
        busiest = len(micro_batches)
        if self.dist.world_size > 1:
            busiest = int(self.all_reduce([float(len(micro_batches))], torch.distributed.ReduceOp.MAX)[0])
        if global_tokens == 0:  # no rank has a token to learn from: no forward at all
            return {
                "stepped": False,
                "loss_tokens": 0,
                "forward_tokens": 0,
                "padding_tokens": 0,
                "unique_tokens": 0,
                **compile_counts(),
            }
        padded = micro_batches + [dummy_micro_batch(self.stand_in_length)] * (busiest - len(micro_batches))
        # a stand-in's tokens are neither the batch's work nor its padding
        forward = [
            float(sum(mb.packed.forward_tokens for mb in micro_batches)),
            float(sum(mb.packed.padding_tokens for mb in micro_batches)),
        ]

        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, sums = torch.zeros((), device=self.device), self.algorithm.new_sums()
        for mb in padded:
            # copy and masks are queued on the device, which then waits for nothing on the host
            loss, mb_sums = self.forward_backward(self.on_device(mb), counts)
            loss_sum = loss_sum + loss
            sums = sums.add(mb_sums)
        norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        # the step's one wait for the device: every statistic at once (the grad norm is already global)
        summed = self.all_reduce([loss_sum, *sums.as_list(), *forward])
        loss_total, totals, (forward_tokens, padding_tokens) = summed[0], summed[1:-2], summed[-2:]
        grad_norm = float(norm)
        tokens_stats = {
            "loss_tokens": int(global_tokens),
            "forward_tokens": int(forward_tokens),
            "padding_tokens": int(padding_tokens),
            "unique_tokens": int(unique),
            **compile_counts(),
        }
        if not (math.isfinite(grad_norm) and math.isfinite(loss_total)):
            # one NaN applied makes every weight NaN: keep the last good weights and optimizer state
            self.optimizer.zero_grad(set_to_none=True)
            return {"stepped": False, "nonfinite": True, **tokens_stats}
        self.before_update()  # a checkpoint in flight may still be reading this state
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
            **tokens_stats,
            "masked_fraction": masked / max(tokens, 1),
            "mismatch_kl": mismatch_kl / max(tokens, 1),
            "entropy": entropy / max(tokens, 1),
        }
        stats.update(self.algorithm.stats(totals, self.dist.world_size))
        return stats

    def all_reduce(self, values: list, op=None) -> list[float]:
        """Numbers and device scalars summed (or ``op``) over ranks, read back to the host at once."""
        t = torch.stack([torch.as_tensor(v, dtype=torch.float64).to(self.device) for v in values])
        if self.dist.world_size > 1:
            torch.distributed.all_reduce(t, op=op or torch.distributed.ReduceOp.SUM)
        return t.tolist()

    # ---- state for the generation copy and checkpoints ----

    def full_weights(
        self,
        *,
        device: str | torch.device,
        dtype: torch.dtype | None = None,
        all_ranks: bool = True,
        first: tuple[str, ...] = (),
    ) -> FullWeights:
        """Full HF-named tensors, each gathered as read, each rank's shard cast to ``dtype`` first
        (``full_weights.py``). Under FSDP every rank reads them all; ``all_ranks=False``: rank 0 alone keeps them,
        the others read None. LoRA: the merged weights. ``first``: names read before the others."""
        return FullWeights(self.model, device=device, dtype=dtype, keep=all_ranks or self.dist.is_main, first=first)

    def full_state_dict(
        self, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None, all_ranks: bool = True
    ) -> dict[str, torch.Tensor]:
        """``full_weights`` as one dict (``all_ranks=False``: {} on the ranks but 0)."""
        weights = self.full_weights(device=device, dtype=dtype, all_ranks=all_ranks)
        return {name: tensor for name, tensor in weights if tensor is not None}

    def checkpoint_state(self, full: bool = True) -> dict:
        """What a checkpoint keeps, as held, no copy (under FSDP2 each rank's shards, which DCP reshards on load):
        "model", the trained parameters (LoRA: the adapter's); with ``full`` also "optimizer" (AdamW's state by
        parameter name) and "algorithm" (``Algorithm.checkpoint_state``). Every rank calls it; no collective."""
        options = StateDictOptions(ignore_frozen_params=True)
        if not full:
            return {"model": self.trained(get_model_state_dict(self.model, options=options))}
        model, optimizer = get_state_dict(self.model, self.optimizer, options=options)
        return {"model": self.trained(model), "optimizer": optimizer, "algorithm": self.algorithm.checkpoint_state()}

    def trained(self, state: dict) -> dict:
        """``state`` less frozen tensors (LoRA's tied head, which ``ignore_frozen_params`` keeps)."""
        if len(self.trainable) == sum(1 for _ in self.model.parameters()):
            return state
        names = {name for name, p in self.model.named_parameters() if p.requires_grad}
        return {name: value for name, value in state.items() if name in names}

    def load_checkpoint_state(self, state: dict) -> None:
        """``checkpoint_state()``'s dict, read from a checkpoint, as the parameters and optimizer state (the
        algorithm's tensors were read in place). Every rank calls it."""
        frozen = any(not p.requires_grad for p in self.model.parameters())  # LoRA's base, not in ``state``
        options = StateDictOptions(ignore_frozen_params=True, strict=not frozen)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=options,
        )
        if self.compute_copy is not None:
            self.compute_copy.refresh()
