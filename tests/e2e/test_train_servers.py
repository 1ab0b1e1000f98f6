"""Training against real vLLM server processes (``inference.urls``): the orchestrator in trainer rank 0
asks the servers for completions over HTTP, the trainer pushes every new policy version through the
filesystem, and failures of a server end the run with a clear error instead of a hang.

One server for the module (a CPU server takes about half a minute to start), on the demo base model;
each run pushes its start weights first, so runs sharing the server do not see each other's weights.
Skipped where vLLM is not installed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import scirl
from helpers.in_process import train_here
from helpers.server_process import free_port

pytest.importorskip("vllm")

DEMO_BASE = Path(scirl.__file__).parent / "assets" / "demo-base"
DEMO_CONFIG = Path(scirl.__file__).parent / "configs" / "demo.toml"
SERVER_START_DEADLINE_S = 240
RUN_DEADLINE_S = 420
# the runs' own deadlines govern: pytest's default 300 s would cut a run a loaded machine slows past it first
pytestmark = [pytest.mark.slow, pytest.mark.timeout(RUN_DEADLINE_S + 60)]


@pytest.fixture(scope="module")
def questions(tmp_path_factory) -> Path:
    from scirl.demo.run import write_questions

    return write_questions(tmp_path_factory.mktemp("servers_data") / "q.jsonl", 40, 10, 0)


def start_server(log_path: Path, *, core: int | None = None) -> tuple[subprocess.Popen, str]:
    from scirl.inference.client import ServerClient
    from scirl.inference.vllm_command import server_command

    port = free_port()
    argv, env = server_command(
        str(DEMO_BASE),
        port=port,
        served_model_name="policy",
        dtype="float32",
        max_model_len=512,
        device="cpu",
        kv_cache_gib=0.25,
        seed=0,
    )
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            argv,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    client = ServerClient(url, timeout_s=30)
    try:
        client.wait_ready(SERVER_START_DEADLINE_S, alive=lambda: proc.poll() is None)
    except Exception:
        stop_server(proc)
        pytest.fail(f"the vLLM server did not come up:\n{log_path.read_text()[-4000:]}")
    finally:
        client.close()
    return proc, url


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGCONT)  # a test may have stopped it
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(request, tmp_path_factory) -> tuple[subprocess.Popen, str]:
    proc, url = start_server(tmp_path_factory.mktemp("servers_log") / "server.log")
    request.addfinalizer(lambda: stop_server(proc))
    return proc, url


def train_args(questions: Path, out: Path, *extra: str) -> list[str]:
    return [
        "@",
        str(DEMO_CONFIG),
        "--model",
        str(DEMO_BASE),
        "--output-dir",
        str(out),
        "--data.source",
        str(questions),
        "--data.eval-per-domain",
        "10",
        "--batch-size",
        "16",
        "--group-size",
        "4",
        "--max-completion-tokens",
        "8",
        "--seq-len",
        "512",
        *extra,
    ]


def run_scirl(args: list[str], *, timeout: float = RUN_DEADLINE_S) -> subprocess.CompletedProcess:
    """``scirl ARGS`` in a process of its own (a launcher)."""
    return subprocess.run(
        [sys.executable, "-m", "scirl", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def rollouts(run: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (run / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]


def greedy_texts(generate, prompts: list[list[int]]) -> list[str]:
    from scirl.inference.base import SamplingParams

    return [group[0].text for group in generate(prompts, SamplingParams(n=1, temperature=0.0, max_tokens=8, seed=0))]


def test_one_command_starts_a_server_and_two_trainer_ranks_async_through_the_filesystem(questions, tmp_path):
    """``scirl train`` with ``[deployment] num_infer_gpus = 1, num_train_gpus = 2`` on a CPU machine:
    the launcher starts a real vLLM server and 2 gloo trainer ranks. Batch n+1 is sampled by the
    weights of step n-1 while step n trains (lag 1), the weights reach the server through broadcasts/,
    a file per bucket of 0.25 MiB, gathered bucket by bucket on both ranks (the first push is checked:
    the server's logprobs are the trainer's), and the server then answers as the trained checkpoint
    does. Everything is gone afterwards."""
    from transformers import AutoTokenizer

    from scirl.run.backends import hf_generator

    run = tmp_path / "run"
    done = run_scirl(
        [
            "train",
            *train_args(
                questions,
                run,
                "--deployment.num-infer-gpus",
                "1",
                "--deployment.num-train-gpus",
                "2",
                "--max-steps",
                "3",
                "--max-async-level",
                "1",
                "--optim.lr",
                "5e-3",
                "--inference.kv-cache-gib",
                "0.25",
                "--deployment.weight-bucket-mib",
                "0.25",
            ),
        ]
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = rows(run)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    lags = {step: {r["lag"] for r in rollouts(run, step)} for step in (1, 2, 3)}
    assert lags == {1: {0}, 2: {1}, 3: {1}}  # step 1 has no older policy to lag behind
    assert [m["async/lag_max"] for m in metrics] == [0, 1, 1]
    assert {r["policy_version"] for r in rollouts(run, 3)} == {1}
    assert "Off-policy 1" in done.stdout
    assert sorted(p.name for p in (run / "broadcasts").glob("step_*")) == ["step_2", "step_3"]  # the newest two
    assert len(list((run / "broadcasts" / "step_3").glob("model-*-of-*.safetensors"))) > 3

    # the last version the server took is step 3's: a server started on it answers as the checkpoint does
    tokenizer = AutoTokenizer.from_pretrained(DEMO_BASE)
    prompts = [tokenizer.encode(text) for text in ("Question: what is 2+2?\nAnswer:", "The capital of France is")]
    trained = greedy_texts(hf_generator(str(run / "weights" / "step_3"), tokenizer=tokenizer).generate, prompts)
    broadcast = greedy_texts(hf_generator(str(run / "broadcasts" / "step_3"), tokenizer=tokenizer).generate, prompts)
    base = greedy_texts(hf_generator(str(DEMO_BASE), tokenizer=tokenizer).generate, prompts)
    assert broadcast == trained
    assert trained != base
    ports = json.loads((run / "ports.json").read_text())
    for url in ports["urls"]:  # the launcher stopped its server
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=2).close()


def test_the_server_answers_with_the_pushed_weights(server, questions, tmp_path):
    """A run through inference.urls leaves the server holding its last version: the server's greedy
    answers equal the trained checkpoint's (its float32 trainer state) under transformers, and differ from the base
    model's."""
    from transformers import AutoTokenizer

    from scirl.inference.remote import RemoteGenerator
    from scirl.run.backends import hf_generator

    _, url = server
    run = tmp_path / "run"
    assert (
        train_here(train_args(questions, run, "--inference.urls", url, "--max-steps", "2", "--optim.lr", "5e-3")) == 0
    )
    tokenizer = AutoTokenizer.from_pretrained(DEMO_BASE)
    prompts = [tokenizer.encode(text) for text in ("Question: what is 2+2?\nAnswer:", "The capital of France is")]
    remote = RemoteGenerator([url], tokenizer, model_name="policy", timeout_s=60)
    try:
        served = greedy_texts(remote.generate, prompts)
    finally:
        remote.close()
    from scirl.primerl.dcp_convert import convert

    # the trainer's float32 masters (the serving weights are in the base model's dtype, bf16), as the server got them
    masters = convert(run / "weights" / "step_2", tmp_path / "masters", dtype="float32").out
    trained = greedy_texts(hf_generator(str(masters), tokenizer=tokenizer).generate, prompts)
    base = greedy_texts(hf_generator(str(DEMO_BASE), tokenizer=tokenizer).generate, prompts)
    assert served == trained
    assert trained != base


def test_synchronous_server_run_equals_the_colocated_run(server, questions, tmp_path):
    """max_async_level 0 through a server is the colocated vLLM loop: same seeds, same samples, same
    updates. Rewards and counts are compared exactly; losses and norms (other processes) to 1e-5.
    With options shuffled per completion (one prompt each, sampled alone) the orchestrator shows and
    rewards exactly what the colocated loop does."""
    _, url = server
    # options shuffled per completion: each its own prompt, sampled alone, rewarded by a seeded coin
    common = (
        "--max-steps",
        "2",
        "--optim.lr",
        "5e-3",
        "--seed",
        "7",
        "--data.shuffle-options",
        "rollout",
        "--reward.mode",
        "random",
    )
    assert (
        train_here(
            train_args(
                questions,
                tmp_path / "colocated",
                "--inference.backend",
                "vllm",
                "--inference.kv-cache-gib",
                "0.25",
                *common,
            )
        )
        == 0
    )
    assert (
        train_here(
            train_args(questions, tmp_path / "servers", "--inference.urls", url, "--max-async-level", "0", *common)
        )
        == 0
    )
    for a, b in zip(rows(tmp_path / "colocated"), rows(tmp_path / "servers"), strict=True):
        # the weight checks measure two different samplers (and the server's first one runs before step 1)
        measured = ("time", "memory", "tokens_per_s", "weight_check")
        keys = {k for k in a if not k.startswith(measured)}
        assert keys == {k for k in b if not k.startswith(measured)}
        for key in sorted(keys):
            if isinstance(a[key], float):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
            else:
                assert b[key] == a[key], key
    for step in (1, 2):
        assert [(r["completion"], r["option_order"], r["reward"]) for r in rollouts(tmp_path / "colocated", step)] == [
            (r["completion"], r["option_order"], r["reward"]) for r in rollouts(tmp_path / "servers", step)
        ]
    orders = {(r["group"], tuple(r["option_order"])) for r in rollouts(tmp_path / "servers", 1)}
    assert len(orders) > len({group for group, _ in orders})  # a group's completions saw several orders


def test_an_async_run_killed_mid_checkpoint_resumes_with_every_step_once(server, questions, tmp_path):
    """kill -9 while checkpoint 4 is being written (checkpoints every 2 steps): the resume starts from
    checkpoint 2 and redoes steps 3 and 4 on the same questions, step 3 now sampled by version 2
    (on-policy: the run goes on from a consistent version), and every step appears exactly once."""
    _, url = server
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "scirl",
        "train",
        *train_args(
            questions,
            run,
            "--inference.urls",
            url,
            "--max-steps",
            "4",
            "--ckpt.interval",
            "2",
            "--max-async-level",
            "1",
        ),
    ]
    trainer = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1", "SCIRL_CKPT_WRITE_DELAY": "0.3"},
    )
    try:
        writing = run / "weights" / ".step_4.tmp"
        wait_for(lambda: any(writing.glob("*.safetensors")) or trainer.poll() is not None, 300)
        trainer.kill()
        trainer.wait(timeout=30)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert not (run / "weights" / "step_4").exists() and (run / "weights" / "step_2" / "manifest.json").is_file()
    killed = {step: [r["question_id"] for r in rollouts(run, step)] for step in (3, 4)}

    assert train_here([], resume=str(run)) == 0
    assert [m["step"] for m in rows(run)] == [1, 2, 3, 4]
    assert {step: [r["question_id"] for r in rollouts(run, step)] for step in (3, 4)} == killed
    versions = {step: {(r["policy_version"], r["lag"]) for r in rollouts(run, step)} for step in (1, 2, 3, 4)}
    assert versions == {1: {(0, 0)}, 2: {(0, 1)}, 3: {(2, 0)}, 4: {(2, 1)}}


def test_sdpo_through_the_server_one_step_ahead(server, questions, tmp_path):
    """SDPO on servers: the servers and the orchestrator sample as for GRPO, the orchestrator adds each
    sample's teacher prompt, the trainer runs the teacher forward; batch 2 comes from version 0 while step 1
    trains, and the clipped importance weight takes the lag."""
    _, url = server
    run = tmp_path / "run"
    assert (
        train_here(
            train_args(
                questions,
                run,
                "--inference.urls",
                url,
                "--max-steps",
                "2",
                "--optim.lr",
                "5e-3",
                "--max-async-level",
                "1",
                "--algorithm",
                "sdpo",
            )
        )
        == 0
    )
    metrics = rows(run)
    assert [m["async/lag_max"] for m in metrics] == [0, 1]
    assert all(m["sdpo/teacher_fraction"] > 0 and m["sdpo/divergence"] >= 0 and m["time/teacher"] > 0 for m in metrics)
    records = rollouts(run, 2)
    assert {r["teacher"] for r in records} <= {"solution", "feedback", "none"}
    assert any(r["teacher"] == "solution" and r["teacher_prompt_tokens"] > 0 for r in records)
    assert "SDPO teacher" in (run / "logs" / "train.log").read_text()
    from scirl.run.checkpoint import saved_keys

    assert any(key.startswith("algorithm.ema_teacher.") for key in saved_keys(run / "weights" / "step_2"))


# ---- pushes that go wrong on purpose: each ends the run in one line naming the server ----


def run_scirl_patched(patch: str, args: list[str]) -> subprocess.CompletedProcess:
    """``scirl`` with ``patch`` (Python) applied in its process first: a fault put into the push."""
    code = f"{patch}\nfrom scirl.cli import main\nraise SystemExit(main({args!r}))"
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=RUN_DEADLINE_S,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


PUSH_FAULT = """
import torch
import scirl.weights.filesystem as transport
write_weights = transport.write_weights
def faulty(named_tensors, out_dir, **kwargs):
    return write_weights(({fault}), out_dir, **kwargs)
transport.write_weights = faulty
"""


@pytest.mark.parametrize(
    "fault",
    [
        # one tensor left out of the push: the server keeps its old copy of it
        "(name, tensor) for name, tensor in named_tensors if name != 'model.layers.0.mlp.down_proj.weight'",
        # weights rounded to bf16 on the way to a float32 server
        "(name, tensor.to(torch.bfloat16).float()) for name, tensor in named_tensors",
    ],
    ids=["one-tensor-left-out", "bf16-rounded"],
)
def test_a_push_that_goes_wrong_ends_the_run_naming_the_server(server, questions, tmp_path, fault):
    _, url = server
    run = tmp_path / "run"
    done = run_scirl_patched(
        PUSH_FAULT.format(fault=fault),
        [
            "train",
            *train_args(
                questions,
                run,
                "--inference.urls",
                url,
                "--max-steps",
                "3",
                "--optim.lr",
                "5e-3",
                "--deployment.verify-interval",
                "1",
            ),
        ],
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    # version 0 already fails where the server held another run's weights (the module's server is shared)
    assert re.match(
        rf"scirl train: {re.escape(url)} does not hold the trainer's weights after the push of "
        r"version [01]: ",
        last,
    ), last
    assert "tolerance 0.001 for float32" in last and "Traceback" not in done.stderr
    assert not (run / "metrics.jsonl").exists()  # step 1's row comes after its push and check: none was written


def run_until_checkpoint_1(questions, run: Path, url: str, *extra: str) -> subprocess.Popen:
    """A long run on ``url``, returned once its first checkpoint is there (the server is warm by then)."""
    cmd = [
        sys.executable,
        "-m",
        "scirl",
        "train",
        *train_args(questions, run, "--inference.urls", url, "--max-steps", "50", "--ckpt.interval", "1", *extra),
    ]
    trainer = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    try:
        wait_for(lambda: (run / "weights" / "step_1").is_dir() or trainer.poll() is not None, 300)
        assert trainer.poll() is None, trainer.communicate()
    except BaseException:
        trainer.kill()
        raise
    return trainer


def assert_failed_naming(trainer: subprocess.Popen, err: str, url: str, run: Path) -> None:
    assert trainer.returncode not in (0, None)
    assert url in err and "Traceback" not in err, err[-3000:]
    assert (run / "weights" / "step_1" / "manifest.json").is_file()


def test_a_hung_server_ends_the_run_at_the_request_deadline(server, questions, tmp_path):
    """A server that stops answering (SIGSTOP) fails the run once a request passes its deadline,
    naming the server, and the last checkpoint stays usable."""
    proc, url = server
    run = tmp_path / "run"
    trainer = run_until_checkpoint_1(
        questions, run, url, "--deployment.request-timeout-s", "8", "--deployment.weight-sync-timeout-s", "8"
    )
    try:
        os.killpg(proc.pid, signal.SIGSTOP)
        _, err = trainer.communicate(timeout=120)  # the 8 s deadlines, plus the trainer's own exit
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
        if trainer.poll() is None:
            trainer.kill()
    assert_failed_naming(trainer, err, url, run)


def wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout_s}s")
        time.sleep(0.2)


def test_a_killed_server_ends_the_run_quickly(server, questions, tmp_path):
    """The module's last test: the server dies (kill -9) mid-run; the trainer stops with a one-line
    error naming it, not a hang, and the last checkpoint stays usable."""
    proc, url = server
    run = tmp_path / "run"
    trainer = run_until_checkpoint_1(questions, run, url)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _, err = trainer.communicate(timeout=60)  # a refused connection fails at once: no deadline to wait out
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert_failed_naming(trainer, err, url, run)
