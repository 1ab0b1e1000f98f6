"""Evaluate a model behind an OpenAI-compatible server (vLLM, ``scirl serve``): an async chat-completions client.

Bounded concurrency (a pool of ``concurrency`` one-connection HTTP clients:
a request borrows one, so at most that many are in flight), retries with
exponential backoff and jitter on 5xx / 429 / timeouts / connection errors /
malformed replies, and every answered question appended to the records file the
moment it arrives, so a killed run resumes where it stopped.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import random
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any

import httpx

from scirl.eval.display import progress_bar
from scirl.eval.permutations import Item, items
from scirl.eval.results import RecordsFile, build_results, check_unique_ids, records_path, write_json
from scirl.task.prompt import build_messages
from scirl.task.schema import Question

RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
FATAL_STATUS = {401, 403, 404}  # the whole run is misconfigured: stop at once


class RetryableError(Exception):
    pass


class QuestionError(Exception):
    """This question cannot be answered by retrying (e.g. its prompt is longer than the server's context)."""


class FatalServerError(Exception):
    """Every request would fail the same way (bad URL, key or model name)."""


@dataclass
class ClientConfig:
    base_url: str
    model: str
    api_key: str | None = None
    n_samples: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 1024
    seed: int | None = None
    timeout: float = 120.0  # per request, seconds
    retries: int = 6  # attempts after the first
    concurrency: int = 32
    backoff_base: float = 0.5  # seconds; doubles per attempt
    backoff_max: float = 30.0
    max_reply_chars: int | None = None  # longer replies are cut (and counted); None: default_max_reply_chars

    @property
    def reply_cap(self) -> int:
        return self.max_reply_chars if self.max_reply_chars is not None else default_max_reply_chars(self.max_tokens)


def default_max_reply_chars(max_tokens: int) -> int:
    """16 characters per requested token: above any real tokenizer's average (about 4), so only a server
    that ignores max_tokens is cut, while 20 MB replies no longer reach memory and disk."""
    return max(16 * max_tokens, 4096)


def body_limit(cap: int, n: int) -> int:
    """Most bytes read of one response: n replies of ``cap`` characters, JSON-escaped (up to 6 bytes each,
    as \\uXXXX), plus room for the rest of the body."""
    return n * cap * 6 + (1 << 20)


def _chat_url(base_url: str) -> str:
    return base_url.rstrip("/") + "/chat/completions"


def public_url(url: str) -> str:
    """``url`` with the password of a ``user:password@`` part blanked out: URLs are printed and saved."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    userinfo, host = parts.netloc.rsplit("@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{userinfo.split(':', 1)[0]}:***@{host}"))


_AUTH_VALUE = re.compile(r"(?i)\b(Basic|Bearer)(\s+|%20|\+)[A-Za-z0-9._~+/=%-]+")


def blank_secrets(text: str, cfg: ClientConfig) -> str:
    """Servers and proxies may quote a credential back in an error (some echo the whole Authorization header);
    that text is printed and saved. Blanked: the API key, the URL's password (as written and decoded), the
    base64 ``user:password`` that HTTP Basic auth sends, and any ``Basic``/``Bearer`` header value."""
    parts = urllib.parse.urlsplit(cfg.base_url)
    secrets = [(cfg.api_key, "<api key>")]
    if parts.password is not None:
        user, password = parts.username or "", parts.password
        plain_user, plain_password = urllib.parse.unquote(user), urllib.parse.unquote(password)
        for u, pw in {(user, password), (plain_user, plain_password)}:
            token = base64.b64encode(f"{u}:{pw}".encode()).decode()
            secrets += [(token, "***"), (token.rstrip("="), "***")]
        secrets += [(password, "***"), (plain_password, "***")]
    for secret, label in secrets:
        if secret and len(secret) >= 3:  # a 1-2 character "secret" would blank innocent text, and guards nothing
            text = text.replace(secret, label)
        elif secret:
            text = re.sub(r"(?<![\w])" + re.escape(secret) + r"(?![\w])", label, text)
    return _AUTH_VALUE.sub(lambda m: f"{m.group(1)} ***", text)


class BodyTooLarge(Exception):
    pass


async def _read_capped(response: httpx.Response, limit: int, cut: bool = False) -> bytes:
    """The response body, at most ``limit`` bytes of it: a runaway server cannot fill memory. Past the limit,
    BodyTooLarge, or with ``cut`` the first ``limit`` bytes (enough of an error message)."""
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > limit:
            if cut:
                chunks.append(chunk[: len(chunk) - (size - limit)])
                break
            raise BodyTooLarge()
        chunks.append(chunk)
    return b"".join(chunks)


def cap_replies(replies: list[str], cap: int) -> tuple[list[str], int]:
    """Replies cut to ``cap`` characters, and how many were cut."""
    return [r[:cap] for r in replies], sum(len(r) > cap for r in replies)


def parse_choices(body: bytes) -> list[tuple[str, str | None]]:
    """(content, finish_reason) per choice of a chat-completions reply; RetryableError if it is malformed."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RetryableError(f"malformed reply: not JSON ({e})") from None
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices:
        raise RetryableError("malformed reply: no choices")
    if not all(isinstance(c, dict) and type(c.get("index", 0)) is int for c in choices):
        raise RetryableError("malformed reply: a choice that is not an object with an integer index")
    out = []
    for choice in sorted(choices, key=lambda c: c.get("index", 0)):
        message = choice.get("message")
        if not isinstance(message, dict):
            raise RetryableError("malformed reply: a choice without a message")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise RetryableError("malformed reply: message content is not text")
        # None content is a real answer (e.g. a reasoning model cut off while thinking): it scores as unparsed
        out.append((content or "", choice.get("finish_reason")))
    return out


class ChatClient:
    """Chat completions over a pool of HTTP clients, one connection each.

    One shared httpx pool of C connections costs O(C) bookkeeping per request
    (httpcore scans every connection), which at C=32 eats the CPU that should
    go to requests; C single-connection clients, lent out through a queue, keep
    that O(1) and bound the requests in flight to C just the same.
    """

    def __init__(self, clients: list[httpx.AsyncClient], cfg: ClientConfig):
        self.cfg = cfg
        self.idle: asyncio.Queue[httpx.AsyncClient] = asyncio.Queue()
        for http in clients:
            self.idle.put_nowait(http)
        self.server_ignores_n = False  # learned from the first short reply; then we ask one sample per call

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}

    async def _request_once(
        self, messages: list[dict[str, str]], n: int, seed: int | None
    ) -> list[tuple[str, str | None]]:
        cfg = self.cfg
        payload: dict[str, Any] = {
            "model": cfg.model,
            "messages": messages,
            "n": n,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "max_tokens": cfg.max_tokens,
        }
        if seed is not None:
            payload["seed"] = seed
        limit = body_limit(cfg.reply_cap, n)
        try:
            http = await self.idle.get()
            try:
                # httpx's timeout bounds each read, not the request: a server that trickles bytes would
                # never time out, so the whole request is bounded too
                status, headers, body = await asyncio.wait_for(self._post(http, payload, limit), cfg.timeout)
            finally:
                self.idle.put_nowait(http)
        except (httpx.TimeoutException, asyncio.TimeoutError):
            raise RetryableError(f"timed out after {cfg.timeout:g} s") from None
        except httpx.RequestError as e:  # transport errors, and bodies that fail to decode (DecodingError)
            raise RetryableError(f"{type(e).__name__}: {blank_secrets(str(e), cfg)}") from None
        except BodyTooLarge:
            # asking again would get the same flood; the question is listed as failed, with the fix
            raise QuestionError(
                f"the server's reply passed {limit} bytes (it ignores max_tokens?); not read further. "
                "Raise --max-reply-chars to accept longer replies"
            ) from None
        if status == 200:
            return parse_choices(body)
        detail = blank_secrets(body.decode("utf-8", "replace"), cfg)[
            :300
        ]  # cut after the blanking: no piece of a key survives
        if status in RETRY_STATUS or status >= 500:
            error = RetryableError(f"HTTP {status}: {detail}")
            error.retry_after = headers.get("retry-after")  # type: ignore[attr-defined]
            raise error
        if status in FATAL_STATUS:
            hint = " (does --base-url end with /v1, and is --model the served model name?)" if status == 404 else ""
            raise FatalServerError(f"{public_url(_chat_url(cfg.base_url))} answered HTTP {status}{hint}: {detail}")
        raise QuestionError(f"HTTP {status}: {detail}")

    async def _post(self, http: httpx.AsyncClient, payload: dict[str, Any], limit: int):
        """(status, headers, body) of one chat-completions call, reading at most ``limit`` bytes of body."""
        cfg = self.cfg
        async with http.stream(
            "POST", _chat_url(cfg.base_url), json=payload, headers=self._headers(), timeout=cfg.timeout
        ) as response:
            ok = response.status_code == 200
            body = await _read_capped(response, limit if ok else 64 * 1024, cut=not ok)
            return response.status_code, response.headers, body

    async def _request(self, messages: list[dict[str, str]], n: int, seed: int | None) -> list[tuple[str, str | None]]:
        """One request, retried with exponential backoff and full jitter."""
        cfg = self.cfg
        for attempt in range(cfg.retries + 1):
            try:
                return await self._request_once(messages, n, seed)
            except RetryableError as e:
                if attempt == cfg.retries:
                    raise QuestionError(f"gave up after {cfg.retries + 1} attempts; last error: {e}") from None
                delay = random.uniform(0, min(cfg.backoff_max, cfg.backoff_base * 2**attempt))
                retry_after = getattr(e, "retry_after", None)
                if retry_after and retry_after.replace(".", "", 1).isdigit():
                    delay = max(delay, min(cfg.backoff_max, float(retry_after)))
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def sample(self, messages: list[dict[str, str]]) -> list[tuple[str, str | None]]:
        """``n_samples`` (reply, finish_reason) pairs: one call with n=k, topped up one call per missing sample."""
        k, seed = self.cfg.n_samples, self.cfg.seed
        got: list[tuple[str, str | None]] = []
        if k == 1 or not self.server_ignores_n:
            got = (await self._request(messages, k, seed))[:k]
            if len(got) < k:
                self.server_ignores_n = True
        if len(got) < k:
            # seed + i, so seeded top-up calls do not all repeat the same sample
            more = await asyncio.gather(
                *(self._request(messages, 1, None if seed is None else seed + i) for i in range(len(got), k))
            )
            got += [m[0] for m in more]
        return got


async def check_server(http: httpx.AsyncClient, cfg: ClientConfig, attempts: int = 3) -> str | None:
    """Fail fast when nothing listens at --base-url; return a warning when the model is not listed there."""
    url, shown = cfg.base_url.rstrip("/") + "/models", public_url(cfg.base_url.rstrip("/") + "/models")
    for attempt in range(attempts):
        try:
            response = await http.get(
                url, headers={"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}, timeout=cfg.timeout
            )
            break
        except httpx.TransportError as e:  # includes timeouts
            if attempt == attempts - 1:
                raise FatalServerError(
                    f"cannot reach {shown}: {type(e).__name__}: {blank_secrets(str(e), cfg)}. Is the server running?"
                ) from None
            await asyncio.sleep(1.0)
    try:
        served = [m.get("id") for m in response.json().get("data", [])]
    except Exception:  # a server without a usable /models: nothing to check
        return None
    if served and cfg.model not in served:
        return f"model {cfg.model!r} is not among the served models {served}"
    return None


async def evaluate_questions(
    units: list[Item],
    cfg: ClientConfig,
    on_answer=None,
    on_failure=None,
    check: bool = True,
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Ask every question as shown by its unit (``scirl.eval.permutations.Item``); return
    ({unit key: {"id", "replies", "finish_reasons", ...}}, [{"id", "error"}]).

    ``on_answer(unit, replies, finish_reasons, truncated)`` runs as each answer arrives
    (the caller appends it to the records file; replies longer than ``cfg.reply_cap`` characters
    come cut to it, ``truncated`` of them); ``on_failure(unit, error)``
    when a question failed after all retries. FatalServerError stops the run.
    """
    answered: dict[str, dict[str, Any]] = {}
    failed: list[dict[str, Any]] = []
    ssl_context = httpx.create_ssl_context()  # built once: each client building its own costs ~0.1 s
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(
                    limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
                    timeout=cfg.timeout,
                    verify=ssl_context,
                )
            )
            for _ in range(max(1, min(cfg.concurrency, len(units) * cfg.n_samples)))  # no idle clients
        ]
        if check:
            warning = await check_server(clients[0], cfg)
            if warning:
                print(f"warning: {warning}")
        client = ChatClient(clients, cfg)

        async def ask(unit: Item):
            try:
                return unit, await client.sample(build_messages(unit.question)), None
            except QuestionError as e:
                return unit, None, str(e)

        tasks = [asyncio.ensure_future(ask(u)) for u in units]
        try:
            for next_done in asyncio.as_completed(tasks):
                unit, samples, error = await next_done
                if samples is None:
                    failed.append(
                        {
                            "id": unit.question.id,
                            **({} if unit.permutation is None else {"permutation": unit.permutation}),
                            "error": error,
                        }
                    )
                    if on_failure:
                        on_failure(unit, error)
                    continue
                replies, truncated = cap_replies([s[0] for s in samples], cfg.reply_cap)
                finish = [s[1] for s in samples]
                answered[unit.key] = {
                    "id": unit.question.id,
                    **unit.fields(),
                    "replies": replies,
                    "finish_reasons": finish,
                }
                if truncated:
                    answered[unit.key]["truncated"] = truncated
                if on_answer:
                    on_answer(unit, replies, finish, truncated)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return answered, failed


def server_settings(cfg: ClientConfig, **extra: Any) -> dict[str, Any]:
    """The resolved settings written into the results; never the API key."""
    return {
        "backend": "server",
        "base_url": public_url(cfg.base_url),
        "model": cfg.model,
        "n_samples": cfg.n_samples,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "max_tokens": cfg.max_tokens,
        "seed": cfg.seed,
        "timeout": cfg.timeout,
        "retries": cfg.retries,
        "concurrency": cfg.concurrency,
        "max_reply_chars": cfg.reply_cap,
        **extra,
    }


def evaluate_server(
    questions: list[Question],
    cfg: ClientConfig,
    *,
    out=None,
    settings: dict[str, Any] | None = None,
    overwrite: bool = False,
    progress: bool = True,
    permutations: int = 1,
    permutation_seed: int = 0,
    trained_on: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Evaluate ``questions`` against the server; resume from and append to ``out``'s records file.
    ``permutations`` K > 1 asks each question under K option orders (``scirl.eval.permutations``); ``trained_on``
    says which of them a run trained on (``scirl.eval.provenance``)."""
    check_unique_ids(questions)
    settings = settings if settings is not None else server_settings(cfg)
    settings = {**settings, "permutations": permutations, "permutation_seed": permutation_seed}
    units = items(questions, permutations, permutation_seed)
    records = (
        RecordsFile(
            records_path(out),
            settings,
            overwrite=overwrite,
            background=True,
            expected_ids=[u.key for u in units],
            expected_orders={u.key: u.order for u in units} if permutations > 1 else None,
        )
        if out
        else None
    )
    try:
        done = records.answered if records else {}
        todo = [u for u in units if u.key not in done]
        if records and len(todo) < len(units):
            what = "questions" if permutations == 1 else "(question, order) pairs"
            print(f"resuming: {len(units) - len(todo)} of {len(units)} {what} already answered in {records.path}")
        with progress_bar(len(todo), "evaluating", enabled=progress) as bar:

            def on_answer(unit, replies, finish, truncated):
                if records:
                    records.append(unit.question.id, replies, finish, truncated=truncated, **unit.fields())
                bar.advance()

            answered, failed = asyncio.run(
                evaluate_questions(
                    todo, cfg, on_answer=on_answer, on_failure=lambda q, e: bar.advance(failed=True), check=bool(todo)
                )
            )
    finally:
        if records:
            records.close()
    all_answered = {**done, **answered}
    results = build_results(questions, all_answered, failed, settings, trained_on)
    if out:
        write_json(results, out)
    return results
