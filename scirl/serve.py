"""A small OpenAI-compatible server over a transformers model, for CPU users and for tests.

``GET /v1/models`` and ``POST /v1/chat/completions`` (``messages``, ``n``,
``temperature``, ``top_p``, ``max_tokens`` / ``max_completion_tokens``, ``seed``).
Generation runs in one worker thread, so the event loop keeps accepting
requests meanwhile; requests that arrive while the model is busy and share
sampling settings are generated together as one batch. A request with a
``seed`` runs alone, so its seed alone decides its output. On GPUs, run
``vllm serve`` instead: ``scirl eval`` talks to both the same way.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import sys
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # OpenAI content parts: keep the text ones
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
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


class Batcher:
    """Queue of generation requests served by one worker: same-settings requests go in one ``generate`` call."""

    def __init__(self, generator, max_batch: int = 32):
        self.generator = generator
        self.max_batch = max_batch
        self.pending: list[_Pending] = []
        self.wakeup = asyncio.Event()

    async def submit(self, prompt: list[int], params) -> list:
        future = asyncio.get_running_loop().create_future()
        self.pending.append(_Pending(prompt, params, future))
        self.wakeup.set()
        return await future

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
            try:
                outputs = await asyncio.to_thread(self.generator.generate, [p.prompt for p in batch], batch[0].params)
            except Exception as e:  # report to every waiting request, keep serving
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            for p, completions in zip(batch, outputs):
                if not p.future.done():
                    p.future.set_result(completions)


def _error(status: int, message: str, kind: str = "invalid_request_error"):
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}})


def create_app(generator, model_name: str, *, default_max_tokens: int = 256, max_batch: int = 32, on_ready=None):
    """The FastAPI app serving ``generator`` (a ``scirl.inference.base.Generator``) as ``model_name``."""
    from fastapi import FastAPI

    from scirl.inference.base import SamplingParams, encode_messages

    state: dict[str, Any] = {}
    config = getattr(getattr(generator, "model", None), "config", None)
    context_length = getattr(config, "max_position_embeddings", None) if config is not None else None
    context_length = context_length if isinstance(context_length, int) else None

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

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "scirl"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatRequest):
        if request.model is not None and request.model != model_name:
            return _error(404, f"The model `{request.model}` does not exist; this server serves `{model_name}`.", "not_found_error")
        if request.stream:
            return _error(400, "stream=true is not supported by scirl serve")
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        try:
            prompt = encode_messages(generator.tokenizer, messages)
        except Exception as e:  # e.g. a chat template that rejects the roles given
            return _error(400, f"cannot build the prompt: {e}")
        asked = request.max_completion_tokens or request.max_tokens
        if context_length is not None:
            room = context_length - len(prompt)
            if room < 1 or (asked is not None and asked > room):
                # as vLLM does; generating anyway would preallocate a KV cache for all of max_tokens
                return _error(400, f"This model's maximum context length is {context_length} tokens; the prompt has "
                                   f"{len(prompt)} tokens and max_tokens asks for {asked or 'at least 1'} more.")
        max_tokens = asked or default_max_tokens
        if context_length is not None:
            max_tokens = min(max_tokens, context_length - len(prompt))  # a default never overflows the context
        params = SamplingParams(n=request.n, temperature=request.temperature, top_p=request.top_p, max_tokens=max_tokens, seed=request.seed)
        try:
            completions = await state["batcher"].submit(prompt, params)
        except ValueError as e:  # the generator refused this request's values: the client's error, not worth a retry
            return _error(400, f"bad request: {e}")
        except Exception as e:
            return _error(500, f"generation failed: {type(e).__name__}: {e}", "server_error")
        completion_tokens = sum(len(c.token_ids) for c in completions)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [
                {"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": None, "finish_reason": c.finish_reason}
                for i, c in enumerate(completions)
            ],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens, "total_tokens": len(prompt) + completion_tokens},
        }

    return app


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
            raise PortError(f"port {port} on {host} is already in use; pick another --port (--port 0 picks a free one)") from None
        raise PortError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def serve(model_dir: str, *, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
          device: str = "cpu", default_max_tokens: int = 256, max_batch: int = 32) -> None:
    """Load ``model_dir`` and serve it until interrupted. Prints the bound address, then a ready line."""
    import uvicorn

    from scirl.backends import hf_generator

    sock = bind_socket(host, port)
    bound = sock.getsockname()[1]
    name = served_model_name or model_dir
    print(f"scirl serve: bound {host}:{bound}; loading {model_dir}", flush=True)
    generator = hf_generator(model_dir, device=device)
    app = create_app(
        generator,
        name,
        default_max_tokens=default_max_tokens,
        max_batch=max_batch,
        on_ready=lambda: print(f"scirl serve: ready at http://{host}:{bound}/v1 (model {name!r})", flush=True),
    )
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        generator.close()
        sys.stdout.flush()
