"""The generation contract shared by the transformers and vLLM backends, in process or behind a server.

The orchestrator hands token-id prompts in and gets, per prompt, ``n`` completions with their
token ids and sampling logprobs out; the trainer hands updated weights back by HF parameter name.
Anything that fits these calls can drive training. What every engine must agree on lives here
too: the stop tokens (``eos_token_ids``), the finish reasons, the per-prompt seeds
(``request_seed``) and the checks on a request (``check_params``).
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from scirl.task.prompt import render_prompt

FINISH_REASONS = ("stop", "length")  # EOS, or max_tokens reached; anything else (an abort) is an error


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions per prompt (the GRPO group size)
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    # EOS is not sampled before this many tokens (vLLM's `min_tokens`); benchmarks set it to
    # max_tokens to force full-length completions
    min_tokens: int = 0


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    # log-probability of each sampled token under the sampling distribution
    # (logits / temperature, after top-p), as vLLM's processed_logprobs mode gives
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS) or "length" (hit max_tokens)


class GenerationCancelled(Exception):
    """``generate`` stopped early because its ``should_stop`` said so (e.g. the client went away)."""


class Generator(ABC):
    """A policy that samples completions and can take new weights."""

    tokenizer: object
    # False where the sampler shares the trainer's module: the optimizer step is the update
    needs_weight_updates: bool = True

    @abstractmethod
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, should_stop: Callable[[], bool] | None = None
    ) -> list[list[Completion]]:
        """Return, for each prompt (token ids), ``params.n`` completions, in order.

        ``should_stop``, if given, is polled between decode steps; once it returns True the call
        raises ``GenerationCancelled`` instead of finishing work nobody will read."""

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, object]]) -> None:
        """Load new policy weights, given as (HF parameter name, tensor) pairs."""

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """The logprob of each token of ``token_ids`` after the first, given the tokens before it, at
        temperature 1 (``len(token_ids) - 1`` values): what this sampler's weights make of a fixed
        sequence, for checking that they are the trainer's (``scirl.weights.check``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot score a sequence")

    def sleep(self) -> None:  # noqa: B027 - optional hook
        """Give the accelerator's memory to the trainer until the next ``update_weights`` (an engine
        colocated with the trainer on one GPU); a no-op for engines that need none."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (GPU memory, worker processes)."""


def encode_messages(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of the chat-templated prompt, ending with the assistant turn's opening."""
    return tokenizer.encode(render_prompt(tokenizer, messages), add_special_tokens=False)


def check_params(prompts: list[list[int]], params: SamplingParams) -> None:
    if not prompts:
        raise ValueError("generate: no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"generate: prompt {i} is empty")
    if params.n < 1:
        raise ValueError(f"SamplingParams.n must be >= 1, got {params.n}")
    if params.max_tokens < 1:
        raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {params.max_tokens}")
    if not 0 <= params.min_tokens <= params.max_tokens:
        raise ValueError(f"SamplingParams.min_tokens must be in [0, max_tokens], got {params.min_tokens}")
    if params.temperature < 0:
        raise ValueError(f"SamplingParams.temperature must be >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {params.top_p}")


def request_seed(seed: int, prompt_index: int) -> int:
    """The seed of prompt ``prompt_index``'s request in a call seeded ``seed``.

    One seed per prompt, not one per call: with a shared seed two equal prompts would get
    equal completions. A hash, not ``seed + i``, so calls with nearby seeds do not share
    request seeds. Fits in 63 bits (vLLM hands it to a torch.Generator).
    """
    digest = hashlib.blake2b(f"{seed}:{prompt_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def eos_token_ids(tokenizer, generation_config=None) -> list[int]:
    """The tokens that end a completion, in every engine: the tokenizer's EOS, then the generation
    config's (a model's ``generation_config``, or the one in a local model directory), without repeats."""
    candidates = [tokenizer.eos_token_id]
    if isinstance(generation_config, (str, Path)):
        candidates.append(directory_eos_token_id(generation_config))
    elif generation_config is not None:
        candidates.append(generation_config.eos_token_id)
    ids: list[int] = []
    for c in candidates:
        for i in c if isinstance(c, (list, tuple)) else [c]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


def directory_eos_token_id(model_dir: str | Path):
    """``eos_token_id`` of a local model directory's ``generation_config.json`` (an id, a list of ids, or None).
    Read as JSON, the one field, rather than through transformers' ``GenerationConfig``: this module is imported
    by processes that never load a model (the launcher waiting for its servers) and transformers costs them
    seconds."""
    if not model_dir or not Path(model_dir).is_dir():  # "" would be the current directory; a hub name has none here
        return None
    try:
        return json.loads((Path(model_dir) / "generation_config.json").read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError):  # no generation_config.json, or not JSON
        return None
