"""Each algorithm's config section: its settings with their defaults, bounds and meaning, one pydantic model per
algorithm, and what the config may refuse or plan from them. Nothing here imports torch: reading a config (the
launcher of a run with servers, ``--dry-run``'s memory plan, ``scirl report``, the prime-rl export) needs these
models and never the losses, which import torch, the trainer and transformers. Each model sits beside its
algorithm's formula in that algorithm's module docstring (``grpo.py``, ``dapo.py``, ...).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

EMA_BYTES_PER_PARAM = 4  # SDPO's EMA teacher: a float32 copy of the weights


class Section(BaseModel):
    """A config section: unknown keys are errors; inf and nan are never a setting (``scirl.run.config``'s rule)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class LossConfig(Section):
    """``grpo`` (and SDPO's GRPO term): prime-rl's default loss."""

    mask_low: float = Field(0.2, ge=0, description="mask a token with A<0 whose probability fell by more than this")
    mask_high: float = Field(0.2, ge=0, description="mask a token with A>0 whose probability rose by more than this")
    kl_tau: float = Field(1e-3, ge=0, description="weight of the (log ratio)^2 trainer-vs-sampler term")


class DrGrpoConfig(Section):
    eps_low: float = Field(0.2, ge=0, le=1, description="the ratio's lower clip: 1 - eps_low")
    eps_high: float = Field(0.2, ge=0, description="the ratio's upper clip: 1 + eps_high")


class DapoConfig(Section):
    eps_low: float = Field(0.2, ge=0, le=1, description="the ratio's lower clip: 1 - eps_low")
    eps_high: float = Field(0.28, ge=0, description="the ratio's upper clip: 1 + eps_high (clip-higher)")
    dynamic_sampling: Literal["refill", "drop", "off"] = Field(
        "drop",
        description="drop: a group whose advantages are all 0 leaves the batch; refill: and further questions "
        "are sampled in its place (one colocated rank or vLLM servers); off: [filters] decides",
    )
    refill_rounds: int = Field(3, ge=1, description="refill: at most this many further rounds of sampling a step")


class GspoConfig(Section):
    eps_low: float = Field(3e-4, ge=0, le=1, description="the sequence ratio's lower clip: 1 - eps_low")
    eps_high: float = Field(4e-4, ge=0, description="the sequence ratio's upper clip: 1 + eps_high")


class CispoConfig(Section):
    eps_low: float = Field(1.0, ge=0, le=1, description="the weight's lower clip: 1 - eps_low (1: no lower bound)")
    eps_high: float = Field(0.28, ge=0, description="the weight's upper clip: 1 + eps_high")


class SdpoConfig(Section):
    """SDPO, self-distillation (``algorithm = "sdpo"``; Hübotter et al. 2026, arXiv 2601.20802; defaults from the
    reference code's ``self_distillation`` section). The policy shown a successful completion of the group
    (or feedback on a failed one) is the teacher of the policy on the plain question, on the student's own
    completions. The orchestrator's half reads the first four fields, the trainer's half the rest."""

    success_threshold: float = Field(
        0.5,
        description="a completion with reward >= this is a success: a solution "
        "shown to the teacher of the other completions of its group",
    )
    reprompt_on_self_success: bool = Field(
        False,
        description="a success may be shown itself as the solution "
        "(false: only another success of its group; a group's one success has no teacher)",
    )
    feedback: bool = Field(
        True,
        description="a failed completion of a group without a success is shown why it "
        "failed, where the reward says (no answer letter read; cut at the length limit)",
    )
    max_teacher_prompt_tokens: int = Field(
        10240,
        ge=1,
        description="a longer teacher prompt is cut in the solution it shows; one that cannot fit gets no teacher",
    )
    alpha: float = Field(
        0.5,
        ge=0,
        le=1,
        description="the divergence: 0 forward KL(teacher||student), 1 reverse "
        "KL(student||teacher), between them the generalised Jensen-Shannon mixture",
    )
    top_k: int = Field(
        100,
        ge=0,
        description="the divergence over the teacher's top-k tokens of each position "
        "(plus a tail bucket); 0: over the full vocabulary",
    )
    tail: bool = Field(
        True,
        description="top-k: one bucket holding the rest of each distribution's mass "
        "(false: both renormalised over the k tokens)",
    )
    is_clip: float = Field(
        2.0,
        ge=0,
        description="each token's loss weighted by min(trainer/sampler probability "
        "of the sampled token, is_clip): async lag and sampler mismatch; 0: no weight",
    )
    teacher: Literal["ema", "current"] = Field(
        "ema",
        description="the teacher's weights: an EMA of the policy "
        "(float32, in checkpoints) or the current policy (no copy)",
    )
    ema_rate: float = Field(
        0.05, gt=0, le=1, description="after every optimizer step: ema += ema_rate * (policy - ema)"
    )
    grpo_coef: float = Field(0.0, ge=0, description="adds this times the GRPO loss on the same batch (the hybrid)")


def no_std_normalize(cfg) -> str | None:
    """Dr. GRPO removes the division by the group's std: a run that asks for it contradicts its algorithm."""
    if cfg.advantage.std_normalize:
        return f"algorithm {cfg.algorithm} has no std normalisation of the advantage: drop advantage.std_normalize"
    return None


def sdpo_state_bytes(cfg) -> int:
    """Bytes per parameter SDPO keeps beside the weights and AdamW (on the GPU, in checkpoints): the EMA teacher at
    full size (under LoRA it is the small adapter's; ``teacher = "current"`` keeps no copy)."""
    return EMA_BYTES_PER_PARAM if cfg.sdpo.teacher == "ema" and not cfg.lora.enabled else 0
