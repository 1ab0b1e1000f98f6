"""Waiting for inference servers (``inference.urls``, or the launcher's own): every question is bounded by
seconds, a line names each server not ready yet with what it answered and the time left, and the final
error names the server and its last answer. No vLLM: a bare listening socket stands in for a server that
accepts connections but never answers (a hung server, another program on that port).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from contextlib import contextmanager

import pytest

from fakes.openai_server import FakeOpenAI
from helpers.server_process import free_port
from scirl.errors import TrainError
from scirl.inference.client import ServerClient, ServerError, wait_until_ready
from scirl.run.config_io import load_config
from scirl.synth.questions import generate_rows, write_jsonl

DEADLINE_S = 60  # "within seconds", asserted generously for a loaded 2-core machine


@contextmanager
def silent_server():
    """A URL whose port accepts connections (the kernel completes them) where nobody ever reads or answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


class FakeClock:
    """Time that passes only while the wait sleeps, ``step_s`` per sleep: its lines come out the same on any machine."""

    def __init__(self, step_s: float):
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += self.step_s


def test_the_wait_names_each_server_not_ready_with_its_answer_and_the_time_left():
    clock, lines = FakeClock(step_s=5), []
    with silent_server() as silent, FakeOpenAI(ready=lambda: clock.now >= 20) as starting:
        refused, slow = f"http://127.0.0.1:{free_port()}", starting.url.removesuffix("/v1")
        clients = [ServerClient(url, timeout_s=600) for url in (silent, refused, slow)]
        with pytest.raises(ServerError) as caught:
            wait_until_ready(
                clients, 40, say=lines.append, report_every_s=15, probe_timeout_s=0.2, clock=clock, sleep=clock.sleep
            )
        ready = []
        wait_until_ready([clients[2]], 40, say=ready.append, clock=clock, sleep=clock.sleep)
    waiting = f"waiting for inference server(s): {silent} (no answer within 0.2s), {refused} (connection refused)"
    assert lines == [
        f"{waiting}, {slow} (status 503); 40s of 40s left",  # at once, then every 15 s
        f"{waiting}, {slow} (status 503); 25s of 40s left",
        f"{waiting}; 10s of 40s left",
    ]  # ready since 20 s
    assert str(caught.value) == (
        f"{silent}/health: not ready after 40s; its last answer: no answer within 0.2s; "
        f"not ready either: {refused} (connection refused)"
    )
    assert ready == []  # a server that answers at once is not waited for aloud


def test_a_server_whose_model_list_never_comes_is_named_within_seconds_not_the_request_timeout():
    """After /health, the trainer asks /v1/models: bounded by seconds too, not by the 600 s a generation may take."""
    from scirl.run.backends import make_remote_generator

    release = threading.Event()
    app = FakeOpenAI(model="m", hold={"/v1/models": release})

    outcome: list[BaseException] = []
    finished = threading.Event()

    def connect(url: str) -> None:
        try:
            cfg = load_config(["--inference.urls", url, "--deployment.request-timeout-s", "600"])
            make_remote_generator(cfg.inference.urls, None, cfg.deployment)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome.append(exc)
        finally:
            finished.set()

    with app as server:
        threading.Thread(target=connect, args=(server.url,), daemon=True).start()
        answered = finished.wait(DEADLINE_S)
        release.set()
    assert answered, "the trainer waited on /v1/models past any startup wait"
    url = server.url.removesuffix("/v1")
    assert isinstance(outcome[0], TrainError)
    assert str(outcome[0]).startswith(f"inference server {url} is not usable: /v1/models: no answer within 5s")


@pytest.mark.slow
def test_scirl_train_against_a_silent_server_says_what_it_waits_for_then_names_it(tiny_model_dir, tmp_path):
    data = write_jsonl(generate_rows(n_per_domain=4, seed=0), tmp_path / "rows.jsonl")
    with silent_server() as url:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "scirl",
                "train",
                "--model",
                str(tiny_model_dir),
                "--data.source",
                str(data),
                "--data.eval-per-domain",
                "1",
                "--output-dir",
                str(tmp_path / "run"),
                "--device",
                "cpu",
                "--batch-size",
                "8",
                "--group-size",
                "4",
                "--max-completion-tokens",
                "4",
                "--seq-len",
                "512",
                "--inference.urls",
                f"{url}/v1",
                "--deployment.startup-timeout-s",
                "8",
            ],
            capture_output=True,
            text=True,
            timeout=2 * DEADLINE_S,
        )
    assert done.returncode == 1, done.stderr
    assert f"waiting for inference server(s): {url} (no answer within 5s); " in done.stdout  # not a silent trainer
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"scirl train: inference server {url} is not usable: /health: not ready after 8s; its last answer: "
        "no answer within 5s (deployment.startup_timeout_s = 8s)"
    )
