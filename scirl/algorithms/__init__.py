"""The policy-gradient algorithms researchers compare, one module each behind one seam (``base.Algorithm``),
registered here by name: ``grpo`` (prime-rl's default loss, the default), ``dr_grpo``, ``dapo``, ``gspo``,
``cispo`` and ``sdpo`` (a package: its teacher prompts, its distillation, its algorithm). An algorithm decides
the advantage from a group's rewards, the per-token loss and its normaliser, extra inputs on a sample, extra
state it keeps (checkpointed) and its metrics; each has its own config section, validated by its own model
(``config_sections``), which ``scirl.run.config`` adds to the run's config without naming any.

Why one folder above both halves rather than a part in each: an algorithm is read as one thing (its paper's
formula for the advantage and for the loss side by side), and the halves stay apart by receiving the built
object (``RolloutSettings.algorithm``, ``Trainer(algorithm=...)``) instead of importing it.

May import: the base modules, ``task``, ``inference``, ``rollouts`` and ``trainer`` (the primitives it combines:
group advantages, teacher prompts, ``rl_loss``, the trainer's forwards). Imported by ``run`` (which builds it),
``deploy``, ``primerl``, ``report``, ``demo`` and ``commands``.
"""

from __future__ import annotations

from scirl.algorithms.base import Algorithm, Section
from scirl.algorithms.cispo import Cispo
from scirl.algorithms.dapo import Dapo
from scirl.algorithms.dr_grpo import DrGrpo
from scirl.algorithms.grpo import Grpo
from scirl.algorithms.gspo import Gspo
from scirl.algorithms.sdpo import Sdpo

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (Grpo, DrGrpo, Dapo, Gspo, Cispo, Sdpo)}
DEFAULT = "grpo"


def names() -> tuple[str, ...]:
    return tuple(ALGORITHMS)


def config_sections() -> dict[str, type[Section]]:
    """Section name -> the model that validates it, for every registered algorithm that has one."""
    return {cls.section: cls.config_model for cls in ALGORITHMS.values() if cls.section is not None}


def config_problem(cfg) -> str | None:
    """What the algorithm refuses of the rest of the run's config (one line), or None."""
    check = getattr(ALGORITHMS[cfg.algorithm], "check_config", None)
    return check(cfg) if check is not None else None


def build(cfg) -> Algorithm:
    """The run's algorithm, built from its ``TrainConfig`` (one per process: both halves share it)."""
    return ALGORITHMS[cfg.algorithm](cfg)


def exportable(name: str) -> bool:
    """Whether prime-rl's trainer has the same loss (``scirl export prime-rl``)."""
    return ALGORITHMS[name].prime_rl


def summaries() -> dict[str, str]:
    return {name: cls.summary for name, cls in ALGORITHMS.items()}
