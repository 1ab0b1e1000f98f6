"""vLLM OpenAI-compatible servers as the rollout engine: the ``Generator`` over one or more servers
(``RemoteGenerator``), each spoken to through ``scirl.inference.client``.

It reproduces the in-process adapter's sampling (``scirl.inference.vllm``): the same per-prompt seeds, the
same stop tokens, the same ``processed_logprobs``, so a synchronous run through a server samples what the
colocated run samples. Importing this module needs no vLLM and no torch of its own (transformers, for the
tokenizer, may import it).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path

from transformers import AutoTokenizer

from scirl.inference.base import (
    Completion,
    GenerationCancelled,
    Generator,
    SamplingParams,
    check_params,
    eos_token_ids,
    request_seed,
)
from scirl.inference.client import POLL_INTERVAL_S, ServerClient


class RemoteGenerator(Generator):
    """The ``Generator`` contract over one or more servers serving the same model (data-parallel
    replicas): prompts go round-robin to the servers, at most ``max_concurrency`` requests in
    flight, each waiting at most ``timeout_s``.

    ``tokenizer``: a transformers tokenizer or a model directory (for ``.tokenizer`` and the stop
    tokens). ``eos_ids``: the tokens that end a completion; by default the tokenizer's EOS and the
    generation config's next to it, as the in-process engines stop.

    ``needs_weight_updates`` is False: weights reach the servers through ``FilesystemWeightSync``
    or ``NCCLWeightSync``, not ``update_weights``."""

    needs_weight_updates = False

    def __init__(
        self,
        urls: list[str],
        tokenizer,
        *,
        model_name: str,
        timeout_s: float,
        max_concurrency: int = 64,
        eos_ids: list[int] | None = None,
    ):
        if not urls:
            raise ValueError("RemoteGenerator needs at least one server URL")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if isinstance(tokenizer, (str, Path)):
            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.tokenizer = tokenizer
        self.eos_ids = (
            list(eos_ids) if eos_ids is not None else eos_token_ids(tokenizer, getattr(tokenizer, "name_or_path", None))
        )
        if not self.eos_ids:
            raise ValueError("no EOS token: the tokenizer names none and no eos_ids were given")
        self.clients = [
            ServerClient(u, timeout_s=timeout_s, model=model_name, max_connections=max_concurrency) for u in urls
        ]
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="rollout")
        self._next_server = 0  # where the next call's first prompt goes: calls of one prompt still spread
        self._lock = threading.Lock()

    def generate(self, prompts: list[list[int]], params: SamplingParams, should_stop=None) -> list[list[Completion]]:
        """One request per prompt, prompt ``i`` seeded ``request_seed(params.seed, i)`` (the in-process
        engine's scheme); results in prompt order. ``should_stop`` is polled while requests run; requests
        already sent then finish on the server, unread."""
        check_params(prompts, params)
        with self._lock:
            first = self._next_server
            self._next_server = (first + len(prompts)) % len(self.clients)
        futures: list[Future] = []
        for i, prompt in enumerate(prompts):
            client = self.clients[(first + i) % len(self.clients)]
            seed = None if params.seed is None else request_seed(params.seed, i)
            futures.append(self._pool.submit(client.complete, prompt, params, seed, stop_token_ids=self.eos_ids))
        try:
            pending = set(futures)
            while pending:
                done, pending = wait(
                    pending, timeout=POLL_INTERVAL_S if should_stop else None, return_when=FIRST_EXCEPTION
                )
                for future in done:
                    future.result()  # the first failure, as the ServerError it is
                if pending and should_stop is not None and should_stop():
                    raise GenerationCancelled("generation stopped: should_stop() returned True")
        finally:
            for future in futures:
                future.cancel()  # the requests not sent yet
        return [future.result() for future in futures]

    def update_weights(self, named_tensors: Iterable[tuple[str, object]]) -> None:
        raise RuntimeError(
            "a RemoteGenerator's servers take new weights through FilesystemWeightSync or "
            "NCCLWeightSync (needs_weight_updates is False)"
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for client in self.clients:
            client.close()
