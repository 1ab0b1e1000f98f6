"""An HTTP client for one vLLM OpenAI-compatible server (``ServerClient``), the wait until servers are ready,
and calls made on every server at once: what the launcher, the weight transports (``scirl.weights``) and the
rollout engine over servers (``scirl.inference.remote``) say to a server.

Every HTTP call to a vLLM server lives in this module. Every network wait has a timeout, and every failure is a
``ServerError`` whose message is one line naming the server, the route and what went wrong. Importing this
module needs neither vLLM, nor torch, nor transformers: the launcher that waits for its servers never loads a
model.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import httpx

from scirl.inference.base import FINISH_REASONS, Completion, SamplingParams

HEALTH_TIMEOUT_S = 5.0  # one quick question at start (/health, /v1/models, ...): a live server answers in milliseconds
POLL_INTERVAL_S = 0.5  # between /health probes while a server starts
READY_REPORT_S = 15.0  # while servers start: how often a line names those not ready yet
BODY_SNIPPET = 300  # characters of an error body quoted in a ServerError


class ServerError(RuntimeError):
    """A vLLM server did not do what was asked: unreachable, timed out, an error status or a bad answer.

    ``str()`` is one line: ``<url><route>: <problem>[: <body snippet>]``."""

    def __init__(self, url: str, route: str, problem: str, body: str = ""):
        self.url, self.route, self.problem, self.body = url, route, problem, body
        snippet = " ".join(body.split())[:BODY_SNIPPET]
        super().__init__(f"{url}{route}: {problem}" + (f": {snippet}" if snippet else ""))


# ---------------------------------------------------------------------------------------------
# one server


_UNASKED = object()  # ServerClient.routes before the server was asked


class ServerClient:
    """One server at ``url`` (``http://host:port``; a trailing ``/v1`` is dropped), over a sync
    httpx client that threads may share. Every call waits at most ``timeout_s`` for its answer
    unless it says otherwise. ``model``: the served model name to request; by default the server's
    first (``served_model``), asked once."""

    def __init__(self, url: str, *, timeout_s: float = 600.0, model: str | None = None, max_connections: int = 64):
        url = url.rstrip("/")
        self.url = url[: -len("/v1")] if url.endswith("/v1") else url
        self.timeout_s = timeout_s
        self._model = model
        self._routes = _UNASKED
        self._http = httpx.Client(
            base_url=self.url,
            timeout=timeout_s,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    def _request(self, method: str, route: str, *, timeout_s: float | None = None, **kwargs):
        """The response to one request; any failure is a ServerError naming url, route and cause."""
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

    def routes(self) -> frozenset[str] | None:
        """The paths this server serves, from its OpenAPI schema (``GET /openapi.json``), asked once; None
        where it publishes none. vLLM's routes move between releases (``/weight_info`` and
        ``/update_weight_version`` from 0.27, ``/weight_checker`` and ``/shutdown_weight_transfer_engine``
        from 0.32: docs/vllm-range.md), so what a server offers is asked of it, never inferred from its version."""
        if self._routes is _UNASKED:
            try:
                schema = self._json("GET", "/openapi.json")
            except ServerError as exc:
                if "status 404" not in exc.problem:
                    raise
                schema = None
            paths = schema.get("paths") if isinstance(schema, dict) else None
            self._routes = frozenset(paths) if isinstance(paths, dict) else None
        return self._routes

    def offers(self, route: str) -> bool:
        """Whether the server serves ``route``; True where it does not say (a call then fails as it would)."""
        routes = self.routes()
        return routes is None or route in routes

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

    def wait_ready(
        self, timeout_s: float, alive: Callable[[], bool] | None = None, *, say: Callable[[str], None] | None = None
    ) -> None:
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

    def complete(
        self, prompt_ids: list[int], params: SamplingParams, seed: int | None, *, stop_token_ids: Sequence[int] = ()
    ) -> list[Completion]:
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
            completions = [
                replace(
                    completions[0], token_ids=list(completions[0].token_ids), logprobs=list(completions[0].logprobs)
                )
                for _ in range(copies)
            ]
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
                raise ServerError(
                    self.url,
                    route,
                    "a choice lacks token ids or one logprob per token (a vLLM without return_token_ids?)",
                    json.dumps(choice)[:BODY_SNIPPET],
                )
            completions.append(
                Completion(
                    text=choice.get("text") or "",
                    token_ids=[int(t) for t in ids],
                    logprobs=[float(lp) for lp in logprobs],
                    finish_reason=reason,
                )
            )
        return completions

    def reload_weights(self, path: str | Path, *, timeout_s: float | None = None) -> None:
        """Load the weights of the HF model directory ``path`` in place (every worker of the server),
        then forget the prefix cache computed under the old ones."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        self._request(
            "POST",
            "/collective_rpc",
            timeout_s=timeout,
            json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}, "timeout": timeout},
        )
        self.reset_prefix_cache(timeout_s=timeout)

    def reset_prefix_cache(self, *, timeout_s: float | None = None) -> None:
        """Forget cached prompt K/V (computed under old weights, it would be reused as is).

        The server refuses while running requests hold blocks: retried until they finish or the
        timeout passes."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        while True:
            response = self._request("POST", "/reset_prefix_cache", timeout_s=timeout)
            if not response.content.strip():  # 0.25 answers 200 with an empty body: it always resets
                return
            try:
                body = response.json()
            except ValueError as exc:
                raise ServerError(self.url, "/reset_prefix_cache", "the answer is not JSON", response.text) from exc
            if not isinstance(body, dict) or body.get("success", True) is not False:  # 0.26 on: {"success": bool}
                return
            if time.monotonic() >= deadline:
                raise ServerError(
                    self.url,
                    "/reset_prefix_cache",
                    f"still refused after {timeout:g}s: running requests hold cache blocks",
                )
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
            return (
                f"{self.url} has no dev routes (404 on /is_sleeping), so it cannot take new weights: "
                "start it with VLLM_SERVER_DEV_MODE=1 in its environment"
            )
        if weight_sync == "filesystem":
            return None
        info = self._json("GET", "/server_info", params={"config_format": "json"})
        config = (info.get("vllm_config") or {}).get("weight_transfer_config") if isinstance(info, dict) else None
        fix = 'add --weight-transfer-config \'{"backend":"nccl"}\' to its command, or use weight_sync = "filesystem"'
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
        payload = {
            "model": self.model,
            "prompt": list(token_ids),
            "n": 1,
            "max_tokens": 1,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "prompt_logprobs": 0,
        }
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
        """Record ``version`` as the server's weight version (a filesystem reload sets none itself); nothing
        where the server keeps no version (no ``/update_weight_version``: ``confirm_version`` skips it)."""
        if self.offers("/update_weight_version"):
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
            raise ServerError(
                self.url, "/weight_checker", "no checksums in the answer", json.dumps(body)[:BODY_SNIPPET]
            )
        return checksums

    def close(self) -> None:
        self._http.close()


def wait_until_ready(
    clients: list[ServerClient],
    timeout_s: float,
    *,
    alive: Callable[[], bool] | None = None,
    say: Callable[[str], None] | None = None,
    report_every_s: float = READY_REPORT_S,
    probe_timeout_s: float = HEALTH_TIMEOUT_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
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
            raise ServerError(
                next(iter(answers), ""), "/health", "the server's process exited before it was ready; see its log"
            )
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
            raise ServerError(
                url,
                "/health",
                f"not ready after {timeout_s:g}s; its last answer: {answer}"
                + (f"; not ready either: {listing(others)}" if others else ""),
            )
        if say is not None and now >= next_report:
            left = f"{deadline - now:.0f}s of {timeout_s:g}s left"
            say(f"waiting for inference server(s): {listing(answers.items())}; {left}")
            next_report = now + report_every_s
        sleep(POLL_INTERVAL_S)


def listing(answers) -> str:
    """``http://a:1 (connection refused), http://b:2 (status 503)`` from (url, answer) pairs."""
    return ", ".join(f"{url} ({answer})" for url, answer in answers)


# ---------------------------------------------------------------------------------------------
# every server at once (the weight transports)


def on_every_server(
    clients: list[ServerClient], call: Callable[[ServerClient], object], timeout_s: float, route: str
) -> list:
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


def confirm_version(clients: list[ServerClient], version: int, timeout_s: float) -> list[str]:
    """Every server that keeps a weight version reports ``version`` (``GET /weight_info``), or a ServerError
    naming the one that does not: a restarted server, or a push that never reached it. Returns the URLs of
    the servers that keep none (vLLM 0.25 and 0.26 have no ``/weight_info``): for them the logprob probe of
    ``scirl.weights.check`` runs after every push instead (``WeightCheck.every_push``)."""
    expected = str(version)
    versioned = [c for c in clients if c.offers("/weight_info")]
    answers = on_every_server(versioned, lambda c: c.weight_version(), timeout_s, "/weight_info")
    for client, answer in zip(versioned, answers):
        if answer != expected:
            raise ServerError(
                client.url, "/weight_info", f"reports weight version {answer!r} after the push of version {expected}"
            )
    return [c.url for c in clients if c not in versioned]
