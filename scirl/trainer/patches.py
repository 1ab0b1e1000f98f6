"""The training forward's temporary patches, entered in one place (``training_forward``).

The trainer's forwards run transformers' own module with three of its parts swapped; outside them the module is
transformers' again, for a sampler that shares it and for ``Trainer.sequence_logprobs``.
"""

from __future__ import annotations

import contextlib

import torch

from scirl.trainer import attention
from scirl.trainer.head import hidden_states_out
from scirl.trainer.kernels import Kernels


@contextlib.contextmanager
def training_forward(model: torch.nn.Module, kernels: Kernels):
    """Inside, ``model``'s forwards are the trainer's. Each patch, and why it is undone on the way out:

    - ``Kernels.active``: the decoder layers run their compiled forwards (``kernels = "compile"``; otherwise
      nothing changes). Undone because a sampler sharing the module decodes eagerly, at other shapes.
    - ``attention.packed_rows``: the attention is ``packed_attention`` over the micro-batch's packed row. Undone
      because other forwards pass no ``scirl_layout``.
    - ``head.hidden_states_out``: the output embedding returns its input, so the forward ends at the final hidden
      states (``Head`` applies the weight a block of tokens at a time), and records the weight it would have used.
      Undone because the sampler and ``sequence_logprobs`` need logits.

    Held through the forward and the backward: activation checkpointing recomputes each layer in the backward,
    which must run the code the forward ran. Each patch puts back what it found, so they nest (the tests' reference
    forward runs inside a step). Yields ``hidden_states_out``'s record: ``"weight"``, the head weight of the latest
    forward. Not here: Liger's kernels, which replace modules for the whole process (``kernels.apply_liger``), and
    SDPO's EMA teacher, which swaps weights, not code, around its teacher forward (``EmaTeacher.holding``).
    """
    with kernels.active(), attention.packed_rows(model), hidden_states_out(model) as seen:
        yield seen
