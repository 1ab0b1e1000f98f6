"""The generation contract shared by the transformers and vLLM backends.

The orchestrator hands token-id prompts in and gets, per prompt, ``n`` completions
with their token ids and sampling logprobs out; the trainer hands updated weights
back by HF parameter name. Anything that fits these two calls can drive training,
whether it runs in-process (transformers, ``vllm.LLM``) or behind a server.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Iterable


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
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 should_stop: Callable[[], bool] | None = None) -> list[list[Completion]]:
        """Return, for each prompt (token ids), ``params.n`` completions, in order.

        ``should_stop``, if given, is polled between decode steps; once it returns True the call
        raises ``GenerationCancelled`` instead of finishing work nobody will read."""

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, "object"]]) -> None:
        """Load new policy weights, given as (HF parameter name, tensor) pairs."""

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """The logprob of each token of ``token_ids`` after the first, given the tokens before it, at
        temperature 1 (``len(token_ids) - 1`` values): what this sampler's weights make of a fixed
        sequence, for checking that they are the trainer's (``scirl.weight_check``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot score a sequence")

    def sleep(self) -> None:  # noqa: B027 - optional hook
        """Give the accelerator's memory to the trainer until the next ``update_weights`` (an engine
        colocated with the trainer on one GPU); a no-op for engines that need none."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (GPU memory, worker processes)."""


def encode_messages(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of the chat-templated prompt, ending with the assistant turn's opening."""
    from scirl.prompt import render_prompt

    return tokenizer.encode(render_prompt(tokenizer, messages), add_special_tokens=False)
