"""The seam every algorithm fills: what the orchestrator's half and the trainer's half ask of it.

An ``Algorithm`` is built once per process from the run's config (``scirl.algorithms.build``) and handed to
both halves: the orchestrator's half (``scirl.rollouts``) calls its first group of methods, the trainer's
half (``scirl.trainer.Trainer``) the second, the loop, checkpoints and metrics the third. Neither half
imports this module: they call the methods named here on the object they are given.

The default methods are prime-rl's GRPO except for the loss, which each algorithm writes: a function over
(trainer logprobs [B, T], sampler logprobs [B, T], advantages [B], loss mask [B, T]) and the batch's
normalisers, as prime-rl's ``loss.py``. The sampler's logprobs are the "old" policy's: one optimizer step per
batch, so the policy that sampled the batch is the one the step starts from (up to the async lag and the
sampler-trainer mismatch, which the ratio then also corrects).
"""

from __future__ import annotations

import torch

from scirl.rollouts.grpo import group_advantages
from scirl.trainer.loss import LossSums


class Algorithm:
    """prime-rl's GRPO everywhere but the loss; a subclass overrides what its paper changes."""

    # the advantage's division by the group's std: fixed by the paper (True, False), or None: ``[advantage]`` decides
    std_normalize: bool | None = None

    def __init__(self, cfg, spec):
        """``cfg``: the run's ``TrainConfig``; each algorithm keeps the slice it reads (``self.cfg``: its section).
        ``spec``: its registry entry (``scirl.algorithms.Spec``: its name, its section, ...)."""
        self.spec = spec
        self.name = spec.name
        self.cfg = getattr(cfg, spec.section) if spec.section else None
        self.advantage_cfg = cfg.advantage
        self.max_completion_tokens = cfg.max_completion_tokens

    # ---- the orchestrator's half (``scirl.rollouts.generate``) ----

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """[1, group_size] float64 rewards of one group -> its advantages (prime-rl: ``r - mean``, std opt-in)."""
        std_normalize = self.advantage_cfg.std_normalize if self.std_normalize is None else self.std_normalize
        return group_advantages(rewards, std_normalize, self.advantage_cfg.eps)

    def drops_flat_groups(self) -> bool:
        """Whether a group whose advantages are all 0 is dropped whatever ``[filters] zero_advantage`` says
        (dynamic sampling)."""
        return False

    def refill_rounds(self) -> int:
        """How many rounds of further questions may replace the dropped groups of a batch (0: none)."""
        return 0

    def group_extras(self, items, completions, scored, tokenizer, reward_mode: str) -> list[dict | None]:
        """Per completion of one group: None, or {"sample": ``Sample`` fields to set, "record": rollout-record
        fields, "keep": never dropped by the zero-advantage filter}. Only a distilling algorithm adds anything (a
        teacher prompt)."""
        return [None] * len(completions)

    def needs_tokenizer(self) -> bool:
        return False

    # ---- the trainer's half (``scirl.trainer.Trainer``) ----

    def attach(self, trainer) -> None:
        """Called once by the trainer: extra state the algorithm keeps beside the weights (an EMA teacher)."""

    def select(self, samples: list) -> list:
        """The samples the trainer learns from (all of them by default)."""
        return samples

    def counts(self, micro_batches: list) -> list[float]:
        """Normalisers beyond the loss-token count (always ``scales[0]``), summed over micro-batches and ranks
        before the first backward, so micro-batching and data parallelism do not change the gradient."""
        return []

    def new_sums(self) -> LossSums:
        return LossSums()

    def forward_backward(self, trainer, mb, scales: list[float], dummy: bool):
        """One micro-batch (already on the device): the trainer's logprobs, this algorithm's loss, backward."""
        logprobs, entropy, loss_mask, inference_logprobs = trainer.forward_logprobs(mb)
        loss, sums = self.loss(logprobs, inference_logprobs, mb.advantages, loss_mask, scales)
        return trainer.backward(loss, sums, entropy, loss_mask, dummy)

    def loss(self, trainer_logprobs, inference_logprobs, advantages, loss_mask, scales: list[float]):
        """(this micro-batch's share of the batch loss, detached ``LossSums``)."""
        raise NotImplementedError

    def after_step(self) -> None:
        """After every optimizer step (e.g. an EMA teacher moves toward the policy)."""

    def stats(self, sums: list[float], world_size: int) -> dict:
        """The algorithm's own entries of the step's stats, from the step's summed ``new_sums`` fields (all of them)."""
        return {}

    # ---- checkpoints, metrics, deployment ----

    def checkpoint_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The algorithm's own state a checkpoint keeps, by name: tensors as held (under FSDP2 each rank's shards),
        which a resume reads back into in place (every rank calls it)."""
        return {}

    def state_restored(self, missing: list[str], say) -> None:
        """After a resume read ``checkpoint_state()`` in place: ``missing``, the names the checkpoint did not hold."""

    def rollout_metrics(self, rollouts: list[dict]) -> dict:
        """The algorithm's entries of a step's metrics row computed from its rollout records."""
        return {}

    def train_metric(self, key: str) -> bool:
        """Whether a stats key of ``stats`` belongs in the metrics row."""
        return key.startswith(f"{self.name}/")

    def step_line(self, m: dict) -> list[str]:
        """Extra parts of the console's step line."""
        return []


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`` elementwise, and where the clip decided."""
    clipped_ratio = ratio.clamp(1 - eps_low, 1 + eps_high)
    unclipped, clipped = ratio * advantages, clipped_ratio * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).detach()


def token_clip_loss(
    trainer_logprobs, inference_logprobs, advantages, loss_mask, eps_low: float, eps_high: float, normaliser: float
) -> tuple[torch.Tensor, LossSums]:
    """PPO's clipped surrogate of every loss token, summed and divided by ``normaliser`` (the PPO-clip variants)."""
    mask = loss_mask.to(bool)
    log_ratio = trainer_logprobs - inference_logprobs.to(trainer_logprobs.dtype)
    per_token, clipped = clipped_surrogate(log_ratio.exp(), expand(advantages, trainer_logprobs), eps_low, eps_high)
    return (per_token * mask).sum() / normaliser, mismatch_sums(log_ratio.detach(), mask, clipped)


def expand(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B] advantages -> [B, T] in ``like``'s dtype ([B, T] pass through)."""
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(like)
    return advantages.to(like.dtype)


def sequence_count(micro_batches: list) -> float:
    """Completions with at least one loss token (counted when the batch was built, on the host)."""
    return float(sum(mb.sequences for mb in micro_batches))


def mismatch_sums(log_ratio: torch.Tensor, mask: torch.Tensor, clipped: torch.Tensor) -> LossSums:
    """The statistics every loss reports: loss tokens, clipped ones (``masked``), the trainer-sampler k3 KL (device
    scalars: nothing here waits for the device)."""
    with torch.no_grad():
        k3 = log_ratio.exp() - 1 - log_ratio
        return LossSums(tokens=mask.sum(), masked=(clipped & mask).sum(), mismatch_kl=torch.where(mask, k3, 0.0).sum())
