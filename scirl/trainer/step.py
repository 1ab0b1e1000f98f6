"""The trainer's step: micro-batched forward/backward with gradient accumulation, one AdamW step per RL
step, the full weights for the sampler and the state a checkpoint keeps.

A micro-batch is one packed row of tokens (``packing.py``): each group's prompt once, its completions after
it, no padding (but flex attention's, up to one of a few lengths), and an attention that keeps completions apart
(``attention.py``). The forward stops at the final hidden states of the positions that predict a loss token;
the LM head and its softmax run there only, a block of tokens at a time (``head.py``). Micro-batches are sized
by tokens (``micro_batch_tokens``), so short completions go many to a forward and long ones few. Everything the
loop indexes with is built on the host with the batch and the step's statistics stay on the device until the
step ends, so a micro-batch's forward and backward never wait for the GPU to tell the host a number
(``tests/trainer/test_packing.py`` counts).

Single process (CPU or one GPU): a plain module, trained in place; the generator samples from the very same
module (in bf16 runs, its bf16 compute copy: ``mixed_precision.py``). Under torchrun (``WORLD_SIZE > 1``): the
FSDP2-sharded module ``model.py`` loads (float32 masters, a bf16 compute policy on GPU); each rank trains on
its share of the batch (whole groups) and ``full_state_dict`` gathers the full tensors (for the generation copy);
checkpoints keep each rank's shards (``checkpoint_state``). The loss-token count is all-reduced first, so every
rank divides by the batch's global count, as prime-rl does, and every rank runs as many forwards as the busiest
(FSDP2's collectives).

The loss, and what a micro-batch's forward/backward computes, is the run's algorithm's (``algorithm``, built
by ``scirl.algorithms``; this module never imports it): ``Trainer`` calls its ``forward_backward`` (by default:
the trainer's logprobs, ``algorithm.loss`` over them and the sampler's, backward), its ``counts`` (normalisers
beyond the loss-token count, all-reduced with it), ``new_sums``/``stats`` and ``after_step``. A self-teacher's
forward (an algorithm that distils) runs on ``teacher_hidden`` with the micro-batch's teacher sequences.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from scirl.distributed import Dist
from scirl.rollouts.contract import Sample
from scirl.trainer import attention
from scirl.trainer.batching import Batching
from scirl.trainer.head import DEFAULT_BLOCK_TOKENS, Head, hidden_states_out
from scirl.trainer.full_weights import FullWeights
from scirl.trainer.kernels import Kernels, compile_counts
from scirl.trainer.lora import is_lora
from scirl.trainer.loss import LossSums, token_logprobs
from scirl.trainer.mixed_precision import ComputeCopy
from scirl.trainer.packing import (MicroBatch, Packed, PackedTeacher, dummy_micro_batch, dummy_teacher, make_micro_batches,
                                   to_device)


class Trainer:
    """One optimizer step per RL step: micro-batched forward/backward with gradient accumulation,
    clipping, AdamW; the same on every device and any number of ranks."""

    def __init__(self, model, optim_cfg, algorithm, *, temperature: float, device: torch.device, dist: Dist,
                 dtype: torch.dtype, top_p: float = 1.0, head_block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 batching: Batching = Batching(), kernels: str = "eager"):
        attention.check_supported(model)
        self.model = model  # holds the float32 master weights the optimizer steps
        self.algorithm = algorithm  # the loss and what else the run's algorithm decides (``scirl.algorithms``)
        # the sampling distribution: the trainer's logprobs are taken under the same temperature and nucleus
        self.temperature, self.top_p = temperature, top_p
        # the LM head and its softmax run from the final hidden states, a block of tokens at a time (``head.py``);
        # compiled decoder layers come with a compiled head
        self.head = Head(temperature, top_p, head_block_tokens, fused=kernels == "compile")
        self.batching = batching
        self.attention = attention.kind_for(batching.attention, device)
        self.device = device
        self.dist = dist
        self.dtype = dtype
        self.max_norm = optim_cfg.max_norm
        # all parameters, except under LoRA: the adapter's only (the base is frozen); clipped over these too
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        # torch's fused AdamW: one kernel per parameter group, and no float32 temporary the size of the
        # parameters at the step (the multi-tensor path's), which at 8B is ~15 GiB a rank
        self.optimizer = torch.optim.AdamW(
            self.trainable,
            lr=optim_cfg.lr,
            betas=tuple(optim_cfg.betas),
            weight_decay=optim_cfg.weight_decay,
            fused=True,
        )
        # Forward and backward run on ``compute_model``: the module itself, except in a single bf16
        # process, where it is a bf16 copy (FSDP2's mixed precision does this under torchrun). A LoRA model
        # needs none: its frozen base is held in the compute dtype and peft computes its float32 adapter as is
        copy = dist.world_size == 1 and dtype != torch.float32 and not is_lora(model)
        self.compute_copy = ComputeCopy(model, dtype) if copy else None
        self.compute_model = self.compute_copy.module if self.compute_copy is not None else model
        # the decoder layers' kernels in the training forward (``kernels.py``): eager, compiled or Liger's; compiled
        # for any row length in one graph, except around flex attention, whose rows take a few lengths, a graph each
        self.kernels = Kernels(self.compute_model, kernels, dynamic=self.attention != "flex")
        self._packed = False  # inside ``packed_forwards``
        self.updates = 0  # optimizer steps this process has taken (skipped steps do not count)
        # called before anything changes the weights, optimizer or algorithm state in place (the optimizer step, a
        # teacher's weights swapped in): the run's checkpointer waits there until it has staged them
        self.before_update = lambda: None
        algorithm.attach(self)  # its own state beside the weights (an EMA teacher), made from the model

    # ---- micro-batches ----

    def batches(self, samples: list[Sample]) -> list[MicroBatch]:
        """A step's micro-batches of the samples the algorithm learns from (``select``)."""
        b = self.batching
        return make_micro_batches(self.algorithm.select(samples), max_tokens=b.micro_batch_tokens,
                                  max_rows=b.micro_batch_size, share_prompts=b.share_prompts, pad_to=self.row_length,
                                  max_grids=attention.max_grids(self.attention, self.kernels.name == "compile"))

    def row_length(self, tokens: int) -> int:
        """The length a packed row of ``tokens`` positions is padded to (``attention.row_length``)."""
        return attention.row_length(tokens, self.attention, self.batching.micro_batch_tokens)

    def stand_in_length(self, tokens: int) -> int:
        """The row length of a stand-in micro-batch (``dummy_micro_batch``): under flex the budget's, which full
        micro-batches take, so its graph is one every rank compiles anyway (the SDPA path's graph takes any)."""
        return self.row_length(max(tokens, self.batching.micro_batch_tokens) if self.attention == "flex" else tokens)

    def describe_batching(self) -> str:
        b = self.batching
        bounds = ([f"{b.micro_batch_tokens} tokens"] if b.micro_batch_tokens else []) + (
            [f"{b.micro_batch_size} completions"] if b.micro_batch_size else [])
        return " or ".join(bounds) + (", each group's prompt once" if b.share_prompts else ", prompts repeated per completion")

    def on_device(self, mb: MicroBatch) -> MicroBatch:
        """``mb`` on the trainer's device with its attention masks made there."""
        mb = to_device(mb, self.device, attention.host_only(self.attention))
        packed = self.prepared(mb.packed)
        teacher = None if mb.teacher is None else dataclasses.replace(mb.teacher, packed=self.prepared(mb.teacher.packed))
        return dataclasses.replace(mb, packed=packed, teacher=teacher)

    def prepared(self, packed: Packed) -> Packed:
        return dataclasses.replace(packed, layout=attention.prepare(packed.layout, self.attention, packed.forward_tokens,
                                                                    self.dtype))

    def dummy_teacher(self) -> PackedTeacher:
        """A teacher forward of two tokens that teaches nothing, on the device: a rank whose micro-batch has no
        teacher joins the teacher forward's all-gathers with it."""
        teacher = to_device(dummy_teacher(self.stand_in_length), self.device)
        return dataclasses.replace(teacher, packed=self.prepared(teacher.packed))

    # ---- the forwards ----

    @contextlib.contextmanager
    def packed_forwards(self):
        """Inside, the compute module's forwards take packed rows (``attention.packed_rows``) and run the decoder
        kernels of ``self.kernels``. Held through a micro-batch's forward *and* backward: activation checkpointing
        recomputes each layer in the backward, which must run the code the forward ran. Re-entrant."""
        if self._packed:
            yield
            return
        self._packed = True
        try:
            with self.kernels.active(), attention.packed_rows(self.compute_model):
                yield
        finally:
            self._packed = False

    def packed_hidden(self, packed: Packed) -> tuple[torch.Tensor, torch.Tensor]:
        """(final hidden states [T, H] of the positions that predict ``packed``'s loss tokens, the head weight).
        The LM head is not applied here: ``self.head`` applies it a block of tokens at a time."""
        model = self.compute_model
        with self.packed_forwards(), hidden_states_out(model) as seen:
            hidden = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
                           scirl_layout=packed.layout).logits
        return hidden[0].index_select(0, packed.predictor), seen["weight"]

    def forward_logprobs(self, mb: MicroBatch) -> tuple[torch.Tensor, ...]:
        """(trainer logprobs, entropies, loss mask, sampler logprobs) of a micro-batch's completion tokens, each
        [rows, longest completion], at the sampling temperature and nucleus (0 off the loss tokens)."""
        hidden, weight = self.packed_hidden(mb.packed)
        logprobs, entropy = self.head.token_logprobs(hidden, weight, mb.packed.targets)
        return self.on_grid(mb.packed, logprobs), self.on_grid(mb.packed, entropy), mb.loss_mask, mb.inference_logprobs

    def forward_hidden(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """A distilling algorithm's student forward: (hidden states [T, H] at the loss tokens, the head weight)."""
        return self.packed_hidden(mb.packed)

    def teacher_hidden(self, teacher: PackedTeacher) -> tuple[torch.Tensor, torch.Tensor]:
        """A self-teacher's forward (under no_grad, with the teacher's weights in place): (hidden states [Tt, H] at
        its loss tokens, in the order of ``teacher.taught``, the head weight)."""
        return self.packed_hidden(teacher.packed)

    @staticmethod
    def on_grid(packed: Packed, values: torch.Tensor) -> torch.Tensor:
        """[T] values of the loss tokens -> [R, C], where each sits among its row's completion tokens (0 elsewhere)."""
        rows, longest = packed.loss_mask.shape
        grid = values.new_zeros(rows * longest)
        return grid.index_copy(0, packed.slot, values).view(rows, longest)

    @staticmethod
    def flat(packed: Packed, grid: torch.Tensor) -> torch.Tensor:
        """[R, C] -> [T], the loss tokens' values in ``packed.targets``' order (the inverse of ``on_grid``)."""
        return grid.reshape(-1).index_select(0, packed.slot)

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

    def forward_backward(self, mb: MicroBatch, scales: list[float]) -> tuple[torch.Tensor, LossSums]:
        """One micro-batch already on the device: the algorithm's forward, loss and backward (``scales``: the
        batch's normalisers). Returns the loss and the sums as device tensors."""
        with self.packed_forwards():
            return self.algorithm.forward_backward(self, mb, scales, mb.dummy)

    def backward(self, loss: torch.Tensor, sums: LossSums, entropy: torch.Tensor, loss_mask: torch.Tensor,
                 dummy: bool) -> tuple[torch.Tensor, LossSums]:
        if dummy:
            # a rank with fewer micro-batches still joins FSDP's collectives, contributing nothing
            loss = loss * 0.0
            sums = type(sums)()
        else:
            sums.entropy = torch.where(loss_mask, entropy.detach(), 0.0).sum()
        # The loss is already divided by the global loss-token count, so the ranks' gradients must be
        # summed; FSDP averages them, hence the world-size factor. (FSDP's set_gradient_divide_factor(1)
        # would say the same, but needs a PREMUL_SUM reduction that gloo lacks.)
        (loss * self.dist.world_size).backward()
        if self.compute_copy is not None:
            self.compute_copy.accumulate_grads()
        return loss.detach(), sums

    def train_step(self, micro_batches: list[MicroBatch]) -> dict:
        """Accumulate gradients over all micro-batches (of all ranks), clip, one optimizer step.

        Returns the batch's loss, grad norm, token statistics and this process's graphs compiled and graph breaks
        so far (``kernels.compile_counts``). ``stepped`` is False when no rank
        had a single loss token (nothing to learn from) or when the loss or the gradient norm is not
        finite (``nonfinite`` True): then the update is skipped and the weights stay as they were.
        """
        counts = [float(sum(mb.loss_tokens for mb in micro_batches)), *self.algorithm.counts(micro_batches)]
        shares = self.all_reduce([*counts, float(sum(mb.unique_tokens for mb in micro_batches))])
        counts, unique = shares[:-1], shares[-1]
        global_tokens = counts[0]
        busiest = len(micro_batches)
        if self.dist.world_size > 1:
            busiest = int(self.all_reduce([float(len(micro_batches))], torch.distributed.ReduceOp.MAX)[0])
        if global_tokens == 0:  # no rank has a token to learn from: no forward at all
            return {"stepped": False, "loss_tokens": 0, "forward_tokens": 0, "padding_tokens": 0, "unique_tokens": 0,
                    **compile_counts()}
        padded = micro_batches + [dummy_micro_batch(self.stand_in_length)] * (busiest - len(micro_batches))
        # the batch's forwards: a stand-in's tokens (``dummy_micro_batch``) are neither work nor padding of it
        forward = [float(sum(mb.packed.forward_tokens for mb in micro_batches)),
                   float(sum(mb.packed.padding_tokens for mb in micro_batches))]

        self.optimizer.zero_grad(set_to_none=True)
        loss_total, sums = torch.zeros((), device=self.device), self.algorithm.new_sums()
        for mb in padded:
            # the copy and the masks are queued on the device, which then waits for nothing the host holds
            loss, mb_sums = self.forward_backward(self.on_device(mb), counts)
            loss_total = loss_total + loss
            sums = sums.add(mb_sums)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.max_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        # the step's one wait for the device: every statistic at once (the grad norm is already global)
        summed = self.all_reduce([loss_total, *sums.as_list(), *forward])
        loss_total, totals, (forward_tokens, padding_tokens) = summed[0], summed[1:-2], summed[-2:]
        grad_norm = float(grad_norm)
        tokens_stats = {"loss_tokens": int(global_tokens), "forward_tokens": int(forward_tokens),
                        "padding_tokens": int(padding_tokens), "unique_tokens": int(unique), **compile_counts()}
        if not (math.isfinite(grad_norm) and math.isfinite(loss_total)):
            # one NaN applied makes every weight NaN; skipping keeps the last good weights and optimizer state
            self.optimizer.zero_grad(set_to_none=True)
            return {"stepped": False, "nonfinite": True, **tokens_stats}
        self.before_update()  # a checkpoint in flight may still be reading the state this changes
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
        """Sums (or ``op``) over ranks of numbers and device scalars, read back to the host in one go."""
        t = torch.stack([torch.as_tensor(v, dtype=torch.float64).to(self.device) for v in values])
        if self.dist.world_size > 1:
            torch.distributed.all_reduce(t, op=op or torch.distributed.ReduceOp.SUM)
        return t.tolist()

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
        """``full_weights`` as one dict (on ``device``; with ``all_ranks=False`` the ranks but 0 get {})."""
        weights = self.full_weights(device=device, dtype=dtype, all_ranks=all_ranks)
        return {name: tensor for name, tensor in weights if tensor is not None}

    def checkpoint_state(self, full: bool = True) -> dict:
        """What a checkpoint keeps, as the tensors are held (under FSDP2 each rank's shards: DCP writes them per rank
        and reshards them on load), no copy made: "model", the trained parameters (LoRA: the adapter's); with
        ``full`` also "optimizer", AdamW's state by parameter name, and "algorithm", the algorithm's own
        (``Algorithm.checkpoint_state``). Every rank calls it; no collective."""
        options = StateDictOptions(ignore_frozen_params=True)
        if not full:
            return {"model": self.trained(get_model_state_dict(self.model, options=options))}
        model, optimizer = get_state_dict(self.model, self.optimizer, options=options)
        return {"model": self.trained(model), "optimizer": optimizer, "algorithm": self.algorithm.checkpoint_state()}

    def trained(self, state: dict) -> dict:
        """``state`` less frozen tensors (LoRA's base, whose tied head torch's ``ignore_frozen_params`` keeps)."""
        if len(self.trainable) == sum(1 for _ in self.model.parameters()):
            return state
        names = {name for name, p in self.model.named_parameters() if p.requires_grad}
        return {name: value for name, value in state.items() if name in names}

    def load_checkpoint_state(self, state: dict) -> None:
        """Take ``state`` (``checkpoint_state()``'s dict, read from a checkpoint in place) as the parameters and
        optimizer state; the algorithm's tensors were read in place already. Every rank calls it."""
        frozen = any(not p.requires_grad for p in self.model.parameters())  # LoRA: the base is not in ``state``
        options = StateDictOptions(ignore_frozen_params=True, strict=not frozen)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=options)
        if self.compute_copy is not None:
            self.compute_copy.refresh()
