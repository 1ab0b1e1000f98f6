"""The trainer's half of a step: one fused AdamW step over micro-batched forwards and backwards (``trainer``,
``Trainer``), the policy loaded for training with FSDP2 (``model``), micro-batches as packed rows with each group's
prompt once (``batching``, ``packing``), the attention over them (``attention``), the decoder layers' kernels
(``kernels``), the LM head over blocks of tokens (``head``), the forward's temporary patches (``patches``),
prime-rl's loss (``loss``), top-k teacher targets (``targets``), LoRA (``lora``), a single process's bf16 compute
copy (``mixed_precision``) and the full weights a tensor at a time (``full_weights``). The loss itself is the run's
algorithm's (``scirl.algorithms``), handed to ``Trainer``.

``from scirl.trainer import Trainer`` imports ``trainer.py`` on first use, not with the package: the run config
reads ``batching``'s defaults without importing torch.

May import: the base modules and ``scirl.rollouts.contract`` (the step's samples), nothing else of the
orchestrator's side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for readers and checkers; at run time ``__getattr__`` imports it
    from scirl.trainer.trainer import Trainer

__all__ = ["Trainer"]


def __getattr__(name: str):
    if name == "Trainer":
        from scirl.trainer.trainer import Trainer  # deferred: it imports torch and transformers

        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
