"""scirl serve: the OpenAI-compatible API over the tiny model, batching, port errors, and eval end to end."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from scirl.inference.base import Completion, Generator
from scirl.synth.questions import generate_rows, write_jsonl
from scirl.task.data import load_splits

MESSAGES = [{"role": "system", "content": "Answer with a letter."}, {"role": "user", "content": "Which? A. x B. y"}]


@pytest.fixture(scope="module")
def generator(tiny_model_dir):
    from scirl.inference.hf import HFGenerator

    gen = HFGenerator(str(tiny_model_dir), device="cpu")
    yield gen
    gen.close()


@pytest.fixture(scope="module")
def client(generator):
    from fastapi.testclient import TestClient

    from scirl.serve import create_app

    with TestClient(create_app(generator, "tiny")) as c:
        yield c


def test_models_lists_the_served_name(client):
    data = client.get("/v1/models").json()
    assert [m["id"] for m in data["data"]] == ["tiny"]


def test_chat_completion_shape_n_usage_and_token_limit(client):
    r = client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": MESSAGES, "n": 3, "temperature": 1.0, "max_completion_tokens": 5, "seed": 1},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(
        c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str) for c in body["choices"]
    )
    assert all(c["finish_reason"] in ("stop", "length") for c in body["choices"])
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0 and 0 < usage["completion_tokens"] <= 15
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_seed_makes_sampling_reproducible(client):
    request = {"messages": MESSAGES, "n": 2, "temperature": 1.0, "max_tokens": 12, "seed": 123}
    first = [c["message"]["content"] for c in client.post("/v1/chat/completions", json=request).json()["choices"]]
    again = [c["message"]["content"] for c in client.post("/v1/chat/completions", json=request).json()["choices"]]
    assert first == again


def test_bad_requests_get_openai_style_errors(client):
    r = client.post("/v1/chat/completions", json={"model": "other", "messages": MESSAGES})
    assert r.status_code == 404 and "other" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True})
    assert r.status_code == 400
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "n": 0})
    assert r.status_code == 422


def test_max_tokens_beyond_the_context_is_a_clear_400_not_a_huge_allocation(client, generator):
    """vLLM answers 400 when prompt + max_tokens exceed the model's context; a client's typo
    (max_tokens=10**9) must not make the server preallocate a cache that size."""
    context = generator.model.config.max_position_embeddings
    for key in ("max_tokens", "max_completion_tokens"):
        r = client.post("/v1/chat/completions", json={"messages": MESSAGES, key: context, "temperature": 0})
        assert r.status_code == 400, r.text
        assert str(context) in r.json()["error"]["message"] and "context" in r.json()["error"]["message"]
    long_prompt = [{"role": "user", "content": "word " * context}]
    r = client.post("/v1/chat/completions", json={"messages": long_prompt, "temperature": 0})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]


class SlowGenerator(Generator):
    """Answers "A" and records the size of every generate call; the first call holds the model until
    ``release`` is set, so requests that arrive meanwhile queue up (an event, not a delay that a
    loaded machine could outlast)."""

    tokenizer = None

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls: list[int] = []
        self.release = threading.Event()

    def generate(self, prompts, params, should_stop=None):
        self.calls.append(len(prompts))
        assert self.release.wait(timeout=60), "the test never released the model"
        return [[Completion("A", [1], [0.0], "stop") for _ in range(params.n)] for _ in prompts]

    def update_weights(self, named_tensors):
        pass


def test_requests_arriving_together_are_batched_without_blocking(generator, monkeypatch):
    from fastapi.testclient import TestClient

    import scirl.serve
    from scirl.serve import create_app

    slow = SlowGenerator(generator.tokenizer)
    queued, all_queued = [], threading.Event()
    plain_submit = scirl.serve.Batcher.submit

    async def counting_submit(self, *args, **kwargs):
        queued.append(1)
        if len(queued) == 6:
            all_queued.set()
        return await plain_submit(self, *args, **kwargs)

    monkeypatch.setattr(scirl.serve.Batcher, "submit", counting_submit)
    with TestClient(create_app(slow, "slow")) as c:
        results = []

        def ask():
            results.append(c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4}).status_code)

        threads = [threading.Thread(target=ask) for _ in range(6)]
        for t in threads:
            t.start()
        assert all_queued.wait(timeout=60)  # every request reached the server while the model was busy
        assert c.get("/v1/models").status_code == 200  # the loop answers while the model works
        slow.release.set()
        for t in threads:
            t.join()
    assert results == [200] * 6
    assert sum(slow.calls) == 6 and len(slow.calls) < 6  # the queued requests shared a generate call


@pytest.mark.slow
def test_port_in_use_fails_at_once_with_a_clear_message(tiny_model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "scirl", "serve", str(tiny_model_dir), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2  # refused before the model loads
    assert "already in use" in done.stderr and str(port) in done.stderr


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(generate_rows(n_per_domain=12, seed=5), tmp_path_factory.mktemp("serve_data") / "rows.jsonl")


@pytest.mark.slow
def test_eval_against_scirl_serve_end_to_end(tiny_model_dir, data_file, tmp_path):
    server = subprocess.Popen(
        [sys.executable, "-m", "scirl", "serve", str(tiny_model_dir), "--port", "0", "--served-model-name", "tiny"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = None
        deadline = time.time() + 120
        while url is None:  # port 0: the server prints the port it got, then a ready line
            line = server.stdout.readline()
            assert line or server.poll() is None, "scirl serve exited before it was ready"
            assert time.time() < deadline
            if "ready at " in line:
                url = line.split("ready at ")[1].split()[0]
        out = tmp_path / "eval.json"
        env = {**os.environ, "OPENAI_API_KEY": "sk-never-written"}
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "scirl",
                "eval",
                "--base-url",
                url,
                "--model",
                "tiny",
                "--data",
                str(data_file),
                "--eval-per-domain",
                "4",
                "--max-tokens",
                "6",
                "--n-samples",
                "2",
                "--temperature",
                "1.0",
                "--seed",
                "0",
                "--concurrency",
                "4",
                "--out",
                str(out),
                "--no-progress",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "overall" in done.stdout  # the summary table
    results = json.loads(out.read_text())
    questions = load_splits(str(data_file), eval_per_domain=4).split("eval")
    assert results["counts"]["answered"] == len(questions) == 16 and results["failed"] == []
    assert [r["id"] for r in results["records"]] == [q.id for q in questions]
    assert all(len(r["replies"]) == 2 and len(r["answers"]) == 2 for r in results["records"])
    assert 0.0 <= results["overall_accuracy"] <= 1.0
    assert set(results["per_domain_accuracy"]) == {"Biology", "Chemistry", "Material", "Physics"}
    assert results["settings"]["model"] == "tiny" and results["settings"]["n_samples"] == 2
    assert "sk-never-written" not in out.read_text() + done.stdout + done.stderr


def test_local_evaluation_in_process_and_resume(generator, data_file, tmp_path):
    from scirl.eval.local import evaluate_generator

    questions = load_splits(str(data_file), eval_per_domain=3).split("eval")
    calls = []
    original = generator.generate

    def counting(prompts, params):
        calls.append(len(prompts))
        return original(prompts, params)

    generator.generate = counting
    try:
        out = tmp_path / "local.json"
        first = evaluate_generator(generator, questions[:5], max_tokens=4, out=out, settings={"model": "tiny"})
        assert first["counts"]["answered"] == 5 and sum(calls) == 5
        full = evaluate_generator(generator, questions, max_tokens=4, out=out, settings={"model": "tiny"}, batch_size=4)
    finally:
        del generator.generate
    assert sum(calls) == len(questions)  # the first five were not asked again
    assert full["counts"]["answered"] == len(questions)
    assert json.loads(out.read_text())["records"] == full["records"]
    assert full["settings"]["backend"] == "local" and full["settings"]["max_tokens"] == 4
    # greedy decoding: the same replies as the first run for the first five
    assert [r["replies"] for r in full["records"][:5]] == [r["replies"] for r in first["records"]]


def test_eval_command_on_a_local_model_dir(tiny_model_dir, data_file, tmp_path, capsys):
    from scirl.commands.eval import main

    out = tmp_path / "local.json"
    args = [
        "--model",
        str(tiny_model_dir),
        "--data",
        str(data_file),
        "--eval-per-domain",
        "2",
        "--max-tokens",
        "3",
        "--device",
        "cpu",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    results = json.loads(out.read_text())
    assert results["counts"]["answered"] == 8 and results["settings"]["backend"] == "local"
    assert "overall" in capsys.readouterr().out
    assert main(args + ["--max-tokens", "4"]) == 2  # another setting, same --out
    assert "max_tokens" in capsys.readouterr().err


# ---- limits, authentication, and clients that leave (issue 12, items 4 and 5) ----


class HeldGenerator(Generator):
    """Generates until released, polling ``should_stop`` as a real decode loop does between steps."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.started, self.release, self.cancelled = threading.Event(), threading.Event(), threading.Event()

    def generate(self, prompts, params, should_stop=None):
        from scirl.inference.base import GenerationCancelled

        self.started.set()
        deadline = time.monotonic() + 120
        while not self.release.wait(0.01):  # one "decode step"
            if should_stop is not None and should_stop():
                self.cancelled.set()
                raise GenerationCancelled()
            assert time.monotonic() < deadline, "never released nor cancelled"
        return [[Completion("A", [1], [0.0], "stop") for _ in range(params.n)] for _ in prompts]

    def update_weights(self, named_tensors):
        pass


def raw_post(url: str, body: bytes, headers: str = "") -> socket.socket:
    """Send a chat request over a plain socket (so the test can drop the connection) and return the socket."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{headers}\r\n".encode()
        + body
    )
    return sock


def test_a_batch_whose_client_disconnected_stops_generating(generator):
    """Before: the disconnect check never fired, so an abandoned heavy request held the model for its whole length."""
    import httpx

    from helpers.asgi_server import running
    from scirl.serve import create_app

    held = HeldGenerator(generator.tokenizer)
    with running(create_app(held, "held")) as srv:
        sock = raw_post(srv.url, json.dumps({"messages": MESSAGES, "max_tokens": 4}).encode())
        assert held.started.wait(60), "generation never started"
        sock.close()  # the client leaves mid-generation
        assert held.cancelled.wait(60), "the generator was not told to stop"
        # the model is free again: the next request is served
        held.started.clear()
        held.release.set()
        r = httpx.post(srv.url + "/chat/completions", json={"messages": MESSAGES, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "A"


def test_a_batch_keeps_going_while_one_of_its_clients_waits(generator):
    """Only a batch that *every* client left is cancelled; a connected client still gets its answer."""
    import httpx

    from helpers.asgi_server import running
    from scirl.serve import create_app

    held = HeldGenerator(generator.tokenizer)
    with running(create_app(held, "held")) as srv:
        result = {}
        waiting = threading.Thread(
            target=lambda: result.setdefault(
                "r",
                httpx.post(srv.url + "/chat/completions", json={"messages": MESSAGES, "max_tokens": 4}, timeout=120),
            )
        )
        waiting.start()
        assert held.started.wait(60)
        held.release.set()
        waiting.join(120)
    assert result["r"].status_code == 200 and not held.cancelled.is_set()


@pytest.fixture(scope="module")
def limited(generator):
    from fastapi.testclient import TestClient

    from scirl.serve import create_app

    with TestClient(create_app(generator, "tiny", max_body_bytes=4000, max_request_tokens=64, api_key="s3cret")) as c:
        c.headers["Authorization"] = "Bearer s3cret"
        yield c


def test_request_body_limit_is_a_413(limited):
    """Before: a 10 MB prompt was read and tokenized on the event loop, blocking every other client."""
    big = {"messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 2}
    r = limited.post("/v1/chat/completions", json=big)
    assert r.status_code == 413 and "4000 bytes" in r.json()["error"]["message"]
    # a chunked body (no Content-Length) is cut off at the limit too
    r = limited.post(
        "/v1/chat/completions",
        content=iter([json.dumps(big).encode()[:3000]] * 2),
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 413


def test_n_times_max_tokens_is_capped(limited):
    r = limited.post("/v1/chat/completions", json={"messages": MESSAGES, "n": 9, "max_tokens": 8})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "9 x 8" in message and "64" in message and "--max-request-tokens" in message
    r = limited.post("/v1/chat/completions", json={"messages": MESSAGES, "n": 8, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}',
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -Infinity}',
        b'{"messages": "hi"',
        b"\xff\xfe{}",
    ],
)
def test_non_finite_numbers_and_bad_json_are_a_422(limited, body):
    """Before: NaN gave a 500 (the error echoed NaN, which JSON cannot carry) and a dropped connection."""
    r = limited.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["message"]


def test_api_key_is_required_when_set(limited):
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        assert limited.get("/v1/models", headers=headers).status_code == 401
        r = limited.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}, headers=headers)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert limited.get("/v1/models").status_code == 200


def test_binding_beyond_loopback_without_a_key_warns():
    from scirl.serve import exposure_warning

    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("::1", None) is None
    assert exposure_warning("localhost", None) is None
    assert "--api-key" in exposure_warning("0.0.0.0", None)
    assert "--api-key" in exposure_warning("myhost.example", None)
    assert exposure_warning("0.0.0.0", "k") is None


class BlockingTokenizer:
    """A tokenizer whose encoding waits for a signal, standing for a huge prompt's slow tokenization."""

    chat_template = None

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def encode(self, text, add_special_tokens=False):
        self.entered.set()
        assert self.release.wait(120)
        return [1, 2, 3]


def test_tokenization_runs_off_the_event_loop(generator):
    from fastapi.testclient import TestClient

    from scirl.serve import create_app

    tokenizer = BlockingTokenizer()
    slow = SlowGenerator(tokenizer)
    slow.release.set()  # here the tokenizer is what holds the request, not the model
    with TestClient(create_app(slow, "slow")) as c:
        result = {}
        asking = threading.Thread(
            target=lambda: result.setdefault(
                "r", c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
            )
        )
        asking.start()
        assert tokenizer.entered.wait(60)
        assert c.get("/v1/models").status_code == 200  # served while the prompt is still being tokenized
        tokenizer.release.set()
        asking.join(120)
    assert result["r"].status_code == 200
