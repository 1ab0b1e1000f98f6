"""A small OpenAI-compatible server over a transformers model, for CPU users and for tests.

``GET /v1/models`` and ``POST /v1/chat/completions`` (``messages``, ``n``,
``temperature``, ``top_p``, ``max_tokens`` / ``max_completion_tokens``, ``seed``).
Generation runs in one worker thread, so the event loop keeps accepting
requests meanwhile; requests that arrive while the model is busy and share
sampling settings are generated together as one batch. A request with a
``seed`` runs alone, so its seed alone decides its output. On GPUs, run
``vllm serve`` instead: ``scirl eval`` talks to both the same way.

Limits, so one client cannot take the server from the others: a request body
above ``max_body_bytes`` is refused (413) before it is read in full; ``n`` x
``max_tokens`` above ``max_request_tokens`` is refused (400); non-finite numbers
are refused (422); JSON parsing and tokenization run off the event loop; a batch
whose clients have all disconnected stops generating at the next decode step.
With ``api_key`` set, every ``/v1`` request needs ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import ipaddress
import json
import math
import signal
import socket
import sys
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request  # at module level: FastAPI resolves the handlers' (string) annotations here

from scirl.inference.base import GenerationCancelled, SamplingParams, encode_messages
from scirl.run.backends import hf_generator

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # MCQ prompts are a few KB; a long chat history still fits
DEFAULT_MAX_REQUEST_TOKENS = 65536  # n x max_tokens of one request: e.g. 16 samples x 4096 tokens


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # OpenAI content parts: keep the text ones
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    n: int = Field(1, ge=1, le=256)
    temperature: float = Field(1.0, ge=0.0, le=10.0)  # OpenAI's default
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    stream: bool = False


class _Pending:
    def __init__(self, prompt: list[int], params, future: asyncio.Future):
        self.prompt, self.params, self.future = prompt, params, future
        # set on the event loop when the client disconnects; read by the worker thread's should_stop
        self.abandoned = False


class Batcher:
    """Queue of generation requests served by one worker: same-settings requests go in one ``generate`` call."""

    def __init__(self, generator, max_batch: int = 32):
        self.generator = generator
        self.max_batch = max_batch
        self.pending: list[_Pending] = []
        self.wakeup = asyncio.Event()

    async def submit(self, prompt: list[int], params, disconnected: asyncio.Future | None = None) -> list | None:
        """The completions, or None when ``disconnected`` (a future set when the client leaves) finishes first."""
        future = asyncio.get_running_loop().create_future()
        pending = _Pending(prompt, params, future)
        self.pending.append(pending)
        self.wakeup.set()
        if disconnected is None:
            return await future
        await asyncio.wait({future, disconnected}, return_when=asyncio.FIRST_COMPLETED)
        if future.done():
            return future.result()
        pending.abandoned = True  # the batch stops once all of its clients have left
        future.cancel()
        return None

    def _take_batch(self) -> list[_Pending]:
        first = self.pending[0]
        if first.params.seed is not None:
            batch = [first]
        else:
            batch = [p for p in self.pending if p.params == first.params][: self.max_batch]
        taken = set(map(id, batch))
        self.pending = [p for p in self.pending if id(p) not in taken]
        return batch

    async def run(self) -> None:
        while True:
            if not self.pending:
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            batch = [p for p in self._take_batch() if not p.future.done()]  # skip requests whose client left
            if not batch:
                continue

            def should_stop(batch=batch) -> bool:
                return all(p.abandoned for p in batch)

            try:
                outputs = await asyncio.to_thread(
                    self.generator.generate, [p.prompt for p in batch], batch[0].params, should_stop=should_stop
                )
            except GenerationCancelled:  # nobody is waiting for this batch any more
                continue
            except Exception as e:  # report to every waiting request, keep serving
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            for p, completions in zip(batch, outputs):
                if not p.future.done():
                    p.future.set_result(completions)


def _error(status: int, message: str, kind: str = "invalid_request_error"):
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}})


class _Refused(Exception):
    """A request refused before generation: (HTTP status, message)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


async def _read_body(request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``limit`` bytes (before it is all read)."""
    declared = request.headers.get("content-length")
    too_big = f"request body larger than {limit} bytes (the server's --max-body-bytes)"
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _Refused(413, too_big)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _Refused(413, too_big)
        chunks.append(chunk)
    return b"".join(chunks)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range for a float")
    return value


def _parse_request(body: bytes) -> ChatRequest:
    """Parse and validate a chat request; NaN, Infinity and overflowing numbers are a 422, as any bad value."""
    try:
        data = json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError; so is UnicodeDecodeError
        raise _Refused(422, f"the request body is not valid JSON: {e}") from None
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as e:
        # the values are left out: echoing them back could itself be unserialisable
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors()[:5])
        raise _Refused(422, f"invalid request: {problems}") from None


async def _wait_disconnect(receive) -> None:
    """Returns when the client disconnects. Call only after the body has been read: the ASGI server then has
    nothing else to send but ``http.disconnect``."""
    while (await receive())["type"] != "http.disconnect":
        pass


def create_app(
    generator,
    model_name: str,
    *,
    default_max_tokens: int = 256,
    max_batch: int = 32,
    on_ready=None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS,
):
    """The FastAPI app serving ``generator`` (a ``scirl.inference.base.Generator``) as ``model_name``."""
    state: dict[str, Any] = {}
    config = getattr(getattr(generator, "model", None), "config", None)
    context_length = getattr(config, "max_position_embeddings", None) if config is not None else None
    context_length = context_length if isinstance(context_length, int) else None
    expected_auth = f"Bearer {api_key}".encode() if api_key else None

    @asynccontextmanager
    async def lifespan(app):
        state["batcher"] = Batcher(generator, max_batch)
        worker = asyncio.create_task(state["batcher"].run())
        if on_ready:
            on_ready()
        try:
            yield
        finally:
            worker.cancel()

    app = FastAPI(title="scirl serve", lifespan=lifespan)

    def unauthorized(request: Request):
        """A 401 response when an API key is set and the request does not carry it, else None."""
        if expected_auth is None:
            return None
        given = request.headers.get("authorization", "").encode("utf-8", "surrogateescape")
        # constant time: how much of a guess matched must not show in the response time
        if hmac.compare_digest(given, expected_auth):
            return None
        return _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "authentication_error")

    @app.get("/v1/models")
    async def models(raw: Request):
        refused = unauthorized(raw)
        if refused is not None:
            return refused
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "scirl"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        refused = unauthorized(raw)
        if refused is not None:
            return refused
        try:
            body = await _read_body(raw, max_body_bytes)
            # parsing and tokenizing a large body takes time: off the event loop, so other clients are served
            request = await asyncio.to_thread(_parse_request, body)
        except _Refused as e:
            return _error(e.status, e.message)
        if request.model is not None and request.model != model_name:
            return _error(
                404,
                f"The model `{request.model}` does not exist; this server serves `{model_name}`.",
                "not_found_error",
            )
        if request.stream:
            return _error(400, "stream=true is not supported by scirl serve")
        asked = request.max_completion_tokens or request.max_tokens
        if request.n * (asked or default_max_tokens) > max_request_tokens:
            return _error(
                400,
                f"n x max_tokens = {request.n} x {asked or default_max_tokens} exceeds this server's limit "
                f"of {max_request_tokens} tokens per request (--max-request-tokens); ask for fewer",
            )
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        try:
            prompt = await asyncio.to_thread(encode_messages, generator.tokenizer, messages)
        except Exception as e:  # e.g. a chat template that rejects the roles given
            return _error(400, f"cannot build the prompt: {e}")
        if context_length is not None:
            room = context_length - len(prompt)
            if room < 1 or (asked is not None and asked > room):
                # as vLLM does; generating anyway would preallocate a KV cache for all of max_tokens
                return _error(
                    400,
                    f"This model's maximum context length is {context_length} tokens; the prompt has "
                    f"{len(prompt)} tokens and max_tokens asks for {asked or 'at least 1'} more.",
                )
        max_tokens = asked or default_max_tokens
        if context_length is not None:
            max_tokens = min(max_tokens, context_length - len(prompt))  # a default never overflows the context
        params = SamplingParams(
            n=request.n, temperature=request.temperature, top_p=request.top_p, max_tokens=max_tokens, seed=request.seed
        )
        # the body is read, so the next ASGI message can only be the client's disconnect
        disconnected = asyncio.ensure_future(_wait_disconnect(raw.receive))
        try:
            completions = await state["batcher"].submit(prompt, params, disconnected)
        except ValueError as e:  # the generator refused this request's values: the client's error, not worth a retry
            return _error(400, f"bad request: {e}")
        except Exception as e:
            return _error(500, f"generation failed: {type(e).__name__}: {e}", "server_error")
        finally:
            disconnected.cancel()
        if completions is None:  # the client left: nobody reads a response
            return _error(499, "client closed the request")
        completion_tokens = sum(len(c.token_ids) for c in completions)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                }
                for i, c in enumerate(completions)
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt) + completion_tokens,
            },
        }

    return app


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """What to tell the user when ``host`` exposes the model beyond this machine with no API key."""
    if api_key or is_loopback(host):
        return None
    return (
        f"listening on {host} without --api-key: anyone who can reach this machine can use the model; "
        "set --api-key (or $SCIRL_API_KEY), or bind 127.0.0.1"
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable only from this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


class PortError(RuntimeError):
    """The address cannot be listened on (in use, not ours, bad host)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind now, so a port in use fails at once with a clear message, and port 0 picks a free port we can print."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # lets a restarted server reuse a port left in TIME_WAIT; a port with a live listener still fails
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortError(
                f"port {port} on {host} is already in use; pick another --port (--port 0 picks a free one)"
            ) from None
        raise PortError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    # listen now: connections made after the "ready" line wait in the backlog instead of being refused
    # while the server starts up
    sock.listen(2048)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, remembering the signal that stopped it. uvicorn raises that signal again on its way out,
    after putting back the handler it found: in a process started with SIGINT ignored (a script's background job,
    ``nohup``) that raise is ignored and the process exited 0 as if nothing had stopped it."""

    stopped_by: int | None = None

    def handle_exit(self, sig, frame) -> None:
        self.stopped_by = self.stopped_by or sig
        super().handle_exit(sig, frame)


def serve(
    model_dir: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    device: str = "cpu",
    default_max_tokens: int = 256,
    max_batch: int = 32,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS,
) -> None:
    """Load ``model_dir`` and serve it until interrupted. Prints the bound address, then a ready line."""
    sock = bind_socket(host, port)
    warning = exposure_warning(host, api_key)
    if warning:
        print(f"scirl serve: warning: {warning}", file=sys.stderr, flush=True)
    bound = sock.getsockname()[1]
    name = served_model_name or model_dir
    print(f"scirl serve: bound {host}:{bound}; loading {model_dir}", flush=True)
    generator = hf_generator(model_dir, device=device)
    app = create_app(
        generator,
        name,
        default_max_tokens=default_max_tokens,
        max_batch=max_batch,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        max_request_tokens=max_request_tokens,
        on_ready=lambda: print(f"scirl serve: ready at http://{host}:{bound}/v1 (model {name!r})", flush=True),
    )
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    server = _Server(config)
    try:
        server.run(sockets=[sock])
        if server.stopped_by == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C: the command says so and exits 130
    finally:
        sock.close()
        generator.close()
        sys.stdout.flush()
