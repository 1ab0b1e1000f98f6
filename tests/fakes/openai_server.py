"""The one fake OpenAI-compatible server the tests share, vLLM's own routes included where asked.

``FakeOpenAI(...)`` answers ``/health``, ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions`` and
``/openapi.json`` (its routes, which a client asks); ``vllm=VLLMRoutes(...)`` adds the dev-mode and weight-transfer
routes of a vLLM server (``fake_vllm``: the fake as the trainer's vLLM server; ``answering``: the fake answering
a set of questions). Its behaviours are parameters: the answer (a text, or a function of the request giving a text
or a whole ``Reply``), a delay, a cap on the choices, seeded faults, a route held until an event is set, a route
that fails with a status. It records every POST (``state.calls``: route and JSON body, ``state.headers``: its
headers) and counts chat requests (``requests``, by ``count_by``).

``with FakeOpenAI(...) as srv`` serves it from a thread of the test's process (``srv.url`` ends in /v1);
``tests/fakes/deploy_fakes.py`` serves it as a process of its own, on the port a launcher gives it. Built on
``http.server``: a process of its own starts in a fraction of a second.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from urllib.parse import urlsplit

HOLD_LIMIT_S = 120  # a held route gives up after this, even if the test never lets it go
FAULTS = ("500", "429", "hang", "bad_json", "no_choices", "short")


@dataclass
class Reply:
    """One HTTP answer: ``body`` a dict or list (sent as JSON), bytes or str (as they are) or None (empty);
    ``chunks``: sent one after another, ``chunk_delay_s`` apart, in place of a body (a server that trickles)."""

    status: int = 200
    body: object = None
    headers: dict[str, str] = field(default_factory=dict)
    media_type: str = "application/json"
    chunks: list[bytes] | None = None
    chunk_delay_s: float = 0.0


@dataclass
class Request:
    """What a behaviour sees of a request: its route, JSON body and headers (lower-case names)."""

    route: str
    body: dict | None
    headers: dict[str, str]

    @property
    def text(self) -> str:
        """The last chat message's content (a completion's prompt, as a string)."""
        body = self.body or {}
        return body["messages"][-1]["content"] if "messages" in body else str(body.get("prompt"))


def failed_on_purpose(route: str, status: int) -> Reply:
    return Reply(status, {"error": f"{route} failed on purpose"})


@dataclass
class VLLMRoutes:
    """A vLLM server's dev-mode routes (``VLLM_SERVER_DEV_MODE=1``) and weight transfer.

    ``release``: "0.32" (also 0.33's routes) or "0.25", read from that release's source: no ``/weight_info``,
    ``/update_weight_version``, ``/weight_checker`` or ``/shutdown_weight_transfer_engine``, and its workers
    refuse an ``init_info`` or ``update_info`` key outside their dataclasses (``RELEASE_PAYLOAD_FIELDS``).
    ``on_init(init_info)``: runs in ``/init_weight_transfer_engine`` (a worker joining the group); an exception
    it raises is a 500. ``keeps_version``: False for a server that forgets the weight version it is given
    (restarted). ``checksums()``: what ``/weight_checker`` answers (None: the route is missing)."""

    world_size: int = 1
    weight_transfer: dict | None = None
    release: str = "0.32"
    on_init: Callable[[dict], None] | None = None
    keeps_version: bool = True
    checksums: Callable[[], object] | None = None


# The NCCL workers' init_info and update_info fields per release (NCCLWeightTransferInitInfo and
# NCCLWeightTransferUpdateInfo in vllm/distributed/weight_transfer/): 0.25 takes the packing with each update,
# 0.32 and 0.33 at init.
RELEASE_PAYLOAD_FIELDS = {
    "0.25": (
        frozenset({"master_address", "master_port", "rank_offset", "world_size"}),
        frozenset({"names", "dtype_names", "shapes", "packed", "packed_buffer_size_bytes", "packed_num_buffers"}),
    ),
    "0.32": (
        frozenset(
            {
                "master_address",
                "master_port",
                "rank_offset",
                "world_size",
                "nccl_unique_id_b64",
                "packed",
                "packed_buffer_size_bytes",
                "packed_num_buffers",
            }
        ),
        frozenset({"names", "dtype_names", "shapes"}),
    ),
}


class FakeOpenAI:
    """An OpenAI-compatible server whose behaviours are its arguments (the module's docstring).

    ``answer``: the reply text, or ``answer(request)`` giving a text or a ``Reply``; ``finish_reason`` and
    ``max_n`` (choices per reply at most, as servers that ignore ``n``) shape a text's reply. ``delay_s``: each
    chat request waits this long first. ``faults``: the chance that a chat request gets one of ``FAULTS`` instead
    (a seeded draw; ``hang`` waits ``hang_s`` and then answers; ``injected`` counts them). ``count_by(request)``:
    the key ``requests`` counts a chat request under (default: its last message). ``ready()``: whether
    ``/health`` answers 200 (else 503). ``hold``: a route waits until its event is set. ``fail``: a route answers
    ``{"error": "ROUTE failed on purpose"}`` with that status, or ``fail[route](request)``'s ``Reply`` where it
    gives one. ``model`` and ``max_model_len``: what ``/v1/models`` lists. ``vllm``: vLLM's own routes."""

    def __init__(
        self,
        *,
        answer: str | Callable[[Request], str | Reply] = "A",
        model: str = "fake",
        max_model_len: int | None = None,
        finish_reason: str = "stop",
        max_n: int | None = None,
        delay_s: float = 0.0,
        faults: float = 0.0,
        seed: int = 0,
        hang_s: float = 1.5,
        count_by: Callable[[Request], object] | None = None,
        ready: Callable[[], bool] = lambda: True,
        hold: dict[str, threading.Event] | None = None,
        fail: dict[str, int | Callable[[Request], Reply | None]] | None = None,
        vllm: VLLMRoutes | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        self.answer, self.model, self.max_model_len = answer, model, max_model_len
        self.finish_reason, self.max_n, self.delay_s = finish_reason, max_n, delay_s
        self.faults, self.rng, self.hang_s = faults, random.Random(seed), hang_s
        self.count_by = count_by or (lambda request: request.text)
        self.ready, self.hold, self.fail, self.vllm = ready, hold or {}, fail or {}, vllm
        self.host, self.port = host, port
        self.state = SimpleNamespace(calls=[], headers=[], version="default")
        self.requests: Counter = Counter()
        self.injected: Counter = Counter()
        self.lock = threading.Lock()
        self.routes = {
            ("GET", "/health"): self.health,
            ("GET", "/v1/models"): self.models,
            ("POST", "/v1/chat/completions"): self.chat,
            ("POST", "/v1/completions"): self.completions,
        }
        if vllm is not None:
            self.routes.update(vllm_routes(self, vllm))
        self.routes[("GET", "/openapi.json")] = self.openapi
        self.httpd: Server | None = None

    # ---- serving ----

    def __enter__(self) -> FakeOpenAI:
        fake = self

        class Handler(BaseHTTPRequestHandler):  # HTTP/1.0: a connection a request, closed with its answer
            def do_GET(self):  # noqa: N802 - http.server's hook
                fake.handle(self, "GET")

            def do_POST(self):  # noqa: N802
                fake.handle(self, "POST")

            def log_message(self, *args):
                pass

        self.httpd = Server((self.host, self.port), Handler)
        self.url = f"http://{self.host}:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)

    def handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        route = urlsplit(handler.path).path
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        request = Request(route, json.loads(raw) if raw else None, {k.lower(): v for k, v in handler.headers.items()})
        if method == "POST":
            with self.lock:
                self.state.calls.append((route, request.body))
                self.state.headers.append(request.headers)
        behaviour = self.routes.get((method, route))
        if behaviour is None:
            return send(handler, Reply(404, {"detail": "Not Found"}))
        if route in self.hold:
            self.hold[route].wait(HOLD_LIMIT_S)
        send(handler, self.failure(request) or behaviour(request))

    def failure(self, request: Request) -> Reply | None:
        rule = self.fail.get(request.route)
        if rule is None:
            return None
        return failed_on_purpose(request.route, rule) if isinstance(rule, int) else rule(request)

    # ---- the OpenAI routes ----

    def openapi(self, request: Request) -> Reply:
        """The schema's paths, where a client asks which routes this server has (as FastAPI publishes vLLM's)."""
        paths: dict[str, dict] = {}
        for method, route in self.routes:
            if route != "/openapi.json":
                paths.setdefault(route, {})[method.lower()] = {}
        return Reply(body={"openapi": "3.1.0", "paths": paths})

    def health(self, request: Request) -> Reply:
        return Reply(200 if self.ready() else 503, {})

    def models(self, request: Request) -> Reply:
        entry = {"id": self.model, "object": "model"}
        if self.max_model_len is not None:
            entry["max_model_len"] = self.max_model_len
        return Reply(body={"object": "list", "data": [entry]})

    def chat(self, request: Request) -> Reply:
        with self.lock:
            self.requests[self.count_by(request)] += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        n = request.body.get("n", 1)
        fault = self.draw_fault(n)
        if fault == "500":
            return Reply(500, {"error": "boom"})
        if fault == "429":
            return Reply(429, {"error": "slow down"}, headers={"retry-after": "0"})
        if fault == "hang":
            time.sleep(self.hang_s)
        if fault == "bad_json":
            return Reply(body='{"choices": [{"message": {"content": "A"')
        if fault == "no_choices":
            return Reply(body={"id": "x", "object": "chat.completion"})
        answer = self.answer(request) if callable(self.answer) else self.answer
        if isinstance(answer, Reply):
            return answer
        count = 1 if fault == "short" else min(n, self.max_n or n)
        choices = [
            {"index": i, "message": {"role": "assistant", "content": answer}, "finish_reason": self.finish_reason}
            for i in range(count)
        ]
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        return Reply(
            body={
                "id": "x",
                "object": "chat.completion",
                "model": request.body.get("model"),
                "choices": choices,
                "usage": usage,
            }
        )

    def draw_fault(self, n: int) -> str | None:
        if not self.faults:
            return None
        with self.lock:
            fault = self.rng.choice(FAULTS) if self.rng.random() < self.faults else None
            if fault == "short" and n == 1:  # a one-choice reply cannot be short
                fault = self.rng.choice(FAULTS[:-1])
            if fault:
                self.injected[fault] += 1
        return fault

    def completions(self, request: Request) -> Reply:
        """vLLM's completions with ``return_token_ids`` and sampling logprobs: two tokens a choice."""
        answer = self.answer(request) if callable(self.answer) else self.answer
        if isinstance(answer, Reply):
            return answer
        return Reply(
            body={
                "choices": [
                    {
                        "index": i,
                        "text": answer,
                        "token_ids": [5, 2],
                        "finish_reason": "stop",
                        "logprobs": {"token_logprobs": [-0.5, -0.25]},
                    }
                    for i in range(request.body["n"])
                ]
            }
        )


def vllm_routes(fake: FakeOpenAI, vllm: VLLMRoutes) -> dict:
    """The dev-mode routes of ``vllm.release``, as (method, route) -> behaviour."""
    init_fields, update_fields = RELEASE_PAYLOAD_FIELDS[vllm.release]
    old = vllm.release == "0.25"

    def ok(request):
        return Reply(body={"message": "ok"})

    def unknown_keys(info: dict, fields: frozenset[str]) -> Reply | None:
        extra = sorted(set(info) - fields)  # the worker's dataclass(**info) raises TypeError: a 500
        return Reply(500, {"error": f"unexpected keys {extra}"}) if extra else None

    def update_weights(request):
        return unknown_keys(request.body["update_info"], update_fields) or ok(request)

    def init_weight_transfer_engine(request):
        refused = unknown_keys(request.body["init_info"], init_fields)
        if refused is None and vllm.on_init is not None:
            try:
                vllm.on_init(request.body["init_info"])
            except Exception as exc:  # noqa: BLE001 - a worker's failure is the server's 500
                return Reply(500, {"error": str(exc)})
        return refused or ok(request)

    def sets_version(key: str):  # both routes set the version /weight_info reports
        def behaviour(request):
            if vllm.keeps_version:
                fake.state.version = request.body[key]
            return Reply(body={"success": True})

        return behaviour

    routes = {
        ("GET", "/is_sleeping"): lambda request: Reply(body={"is_sleeping": False}),
        ("GET", "/server_info"): lambda request: Reply(
            body={"vllm_config": {"weight_transfer_config": vllm.weight_transfer}}
        ),
        ("GET", "/get_world_size"): lambda request: Reply(body={"world_size": vllm.world_size}),
        ("POST", "/start_weight_update"): ok,
        ("POST", "/collective_rpc"): ok,
        ("POST", "/update_weights"): update_weights,
        ("POST", "/init_weight_transfer_engine"): init_weight_transfer_engine,
        # 0.25 answers 200 with an empty body; 0.26 on, {"success": bool}
        ("POST", "/reset_prefix_cache"): lambda request: Reply(body=None if old else {"success": True}),
    }
    if old:  # its /finish_weight_update takes no body and no version is kept
        routes[("POST", "/finish_weight_update")] = ok
        return routes
    routes.update(
        {
            ("POST", "/shutdown_weight_transfer_engine"): ok,
            ("POST", "/finish_weight_update"): sets_version("weight_version"),
            ("POST", "/update_weight_version"): sets_version("new_version"),
            ("GET", "/weight_info"): lambda request: Reply(body={"weight_version": fake.state.version}),
        }
    )
    if vllm.checksums is not None:
        routes[("POST", "/weight_checker")] = lambda request: Reply(body={"checksums": vllm.checksums()})
    return routes


class Server(ThreadingHTTPServer):
    request_queue_size = 128  # a client's burst of connections is never refused (a refused one retries after 1 s)

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that stopped reading is no error here
            super().handle_error(request, client_address)


def send(handler: BaseHTTPRequestHandler, reply: Reply) -> None:
    handler.send_response(reply.status)
    handler.send_header("Content-Type", reply.media_type)
    for name, value in reply.headers.items():
        handler.send_header(name, value)
    if reply.chunks is not None:  # no length: the body ends with the connection
        handler.end_headers()
        for i, chunk in enumerate(reply.chunks):
            time.sleep(reply.chunk_delay_s if i else 0)
            handler.wfile.write(chunk)
            handler.wfile.flush()
        return
    body = reply.body
    data = (
        b""
        if body is None
        else body
        if isinstance(body, bytes)
        else body.encode()
        if isinstance(body, str)
        else json.dumps(body).encode()
    )
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def answering(questions, reply: Callable[[object], str | Reply], **behaviour) -> FakeOpenAI:
    """The fake answering each of ``questions`` (the request's last message is its prompt) by ``reply(question)``
    and counting requests per question id; ``behaviour``: the rest of ``FakeOpenAI``'s arguments."""
    from scirl.task.prompt import user_text

    by_text = {user_text(q): q for q in questions}
    return FakeOpenAI(
        answer=lambda request: reply(by_text[request.text]),
        count_by=lambda request: by_text[request.text].id,
        **behaviour,
    )


def fake_vllm(
    *, dev_mode: bool = True, fail: dict[str, int] | None = None, gate: threading.Event | None = None, **routes
) -> FakeOpenAI:
    """The fake as a vLLM server: completions of two tokens ("x"), dev-mode routes unless ``dev_mode`` is False
    (``routes``: ``VLLMRoutes``' fields); ``gate``: completions wait until it is set (a server still generating)."""
    return FakeOpenAI(
        answer="x",
        fail=fail,
        hold={"/v1/completions": gate} if gate is not None else None,
        vllm=VLLMRoutes(**routes) if dev_mode else None,
    )


def routes(fake: FakeOpenAI) -> list[str]:
    """The routes posted to, in order."""
    return [route for route, _ in fake.state.calls]


def body(fake: FakeOpenAI, route: str) -> list:
    """The JSON bodies posted to ``route``, in order."""
    return [b for r, b in fake.state.calls if r == route]
