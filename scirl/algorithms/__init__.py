"""The policy-gradient algorithms researchers compare, one module each behind one seam (``base.Algorithm``),
registered here by name: ``grpo`` (prime-rl's default loss, the default), ``dr_grpo``, ``dapo``, ``gspo``,
``cispo`` and ``sdpo`` (a package: its teacher prompts, its distillation, its algorithm). An algorithm decides
the advantage from a group's rewards, the per-token loss and its normaliser, extra inputs on a sample, extra
state it keeps (checkpointed) and its metrics; each has its own config section, validated by its own model
(``sections``) and declared as a field of ``scirl.run.config.TrainConfig`` (a test checks the two agree).

The registry is a ``Spec`` per algorithm: what reading, checking and planning a config need (its section's
model, its summary, whether prime-rl has its loss, what state it keeps), torch-free, and where its
implementation is, imported by ``build`` only. A process that only reads a config (the launcher of a run with
servers, ``--dry-run``, ``scirl report``, the export) so starts in a fraction of a second instead of paying
~3 s for torch, transformers and peft.

Why one folder above both halves rather than a part in each: an algorithm is read as one thing (its paper's
formula for the advantage and for the loss side by side), and the halves stay apart by receiving the built
object (``RolloutSettings.algorithm``, ``Trainer(algorithm=...)``) instead of importing it.

May import: the base modules, ``task``, ``inference``, ``rollouts`` and ``trainer`` (the primitives it combines:
group advantages, teacher prompts, ``rl_loss``, the trainer's forwards). Imported by ``run`` (which builds it),
``deploy``, ``primerl``, ``report``, ``demo`` and ``commands``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scirl.algorithms import sections
from scirl.algorithms.sections import Section

if TYPE_CHECKING:  # the implementation's types, for readers and checkers only: importing them imports torch
    from scirl.algorithms.base import Algorithm


@dataclass(frozen=True)
class Spec:
    """An algorithm as a config sees it."""

    name: str
    implementation: str  # "module:Class", an ``Algorithm`` subclass imported by ``build``
    summary: str  # one line for --help and the docs
    section: str | None = None  # its config section ([name]); None: none of its own
    config_model: type[Section] | None = None  # validates that section
    prime_rl: bool = False  # prime-rl's trainer has the same loss (``scirl export prime-rl`` may write it)
    check_config: Callable | None = None  # cfg -> what it refuses of the rest of the run's config (one line) or None
    # cfg -> bytes per parameter of state it keeps beside the weights (GPU, checkpoints)
    state_bytes: Callable | None = None


ALGORITHMS: dict[str, Spec] = {
    spec.name: spec
    for spec in (
        Spec(
            "grpo",
            "scirl.algorithms.grpo:Grpo",
            "prime-rl's default loss on group advantages r - mean (the run guide's)",
            section="loss",
            config_model=sections.LossConfig,
            prime_rl=True,
        ),
        Spec(
            "dr_grpo",
            "scirl.algorithms.dr_grpo:DrGrpo",
            "Dr. GRPO: r - mean advantages, PPO clip, every token summed over a constant (completions x max tokens)",
            section="dr_grpo",
            config_model=sections.DrGrpoConfig,
            check_config=sections.no_std_normalize,
        ),
        Spec(
            "dapo",
            "scirl.algorithms.dapo:Dapo",
            "DAPO: group-normalised advantages, clip-higher, token-level loss over the batch, flat groups dropped",
            section="dapo",
            config_model=sections.DapoConfig,
        ),
        Spec(
            "gspo",
            "scirl.algorithms.gspo:Gspo",
            "GSPO: a length-normalised sequence ratio, clipped per completion, completions averaged",
            section="gspo",
            config_model=sections.GspoConfig,
        ),
        Spec(
            "cispo",
            "scirl.algorithms.cispo:Cispo",
            "CISPO: the clipped importance weight, detached, times A log p; token-level loss over the batch",
            section="cispo",
            config_model=sections.CispoConfig,
        ),
        Spec(
            "sdpo",
            "scirl.algorithms.sdpo:Sdpo",
            "SDPO: self-distillation from the policy shown a success of the group (or feedback) [sdpo]",
            section="sdpo",
            config_model=sections.SdpoConfig,
            state_bytes=sections.sdpo_state_bytes,
        ),
    )
}
DEFAULT = "grpo"


def names() -> tuple[str, ...]:
    return tuple(ALGORITHMS)


def config_sections() -> dict[str, type[Section]]:
    """Section name -> the model that validates it, for every registered algorithm that has one."""
    return {spec.section: spec.config_model for spec in ALGORITHMS.values() if spec.section is not None}


def config_problem(cfg) -> str | None:
    """What the algorithm refuses of the rest of the run's config (one line), or None."""
    check = ALGORITHMS[cfg.algorithm].check_config
    return check(cfg) if check is not None else None


def state_bytes_per_param(cfg) -> int:
    """Bytes per model parameter the algorithm keeps beside the weights and AdamW, on the trainer's GPU and in
    every checkpoint (the memory plan, the disk preflight)."""
    extra = ALGORITHMS[cfg.algorithm].state_bytes
    return extra(cfg) if extra is not None else 0


def build(cfg) -> Algorithm:
    """The run's algorithm, built from its ``TrainConfig`` (one per process: both halves share it). Its module is
    imported here, not at the top: it imports torch and the trainer, which reading a config never needs."""
    spec = ALGORITHMS[cfg.algorithm]
    module, name = spec.implementation.split(":")
    return getattr(importlib.import_module(module), name)(cfg, spec)


def exportable(name: str) -> bool:
    """Whether prime-rl's trainer has the same loss (``scirl export prime-rl``)."""
    return ALGORITHMS[name].prime_rl


def summaries() -> dict[str, str]:
    return {name: spec.summary for name, spec in ALGORITHMS.items()}
