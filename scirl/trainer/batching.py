"""How a step's samples become micro-batches: the settings, apart from the code that packs them
(``packing.py``), so the run config names its defaults without importing torch."""

from __future__ import annotations

from dataclasses import dataclass

# Tokens a forward packs (each prompt once): enough rows for the GPU's matmuls to run near their peak at 0.6B-8B,
# and, with activation checkpointing at 8B, a few GiB of activations (the memory plan says for a given run)
DEFAULT_MICRO_BATCH_TOKENS = 8192


@dataclass(frozen=True)
class Batching:
    """The run config's fields of the same names."""

    micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS  # tokens per forward, each prompt counted once (0: no bound)
    micro_batch_size: int | None = None  # completions per forward at most (None: no bound)
    share_prompts: bool = True  # False: every completion its own copy of its prompt (the per-sequence forward)
    attention: str = "auto"  # auto, flex, sdpa (``attention.py``)
