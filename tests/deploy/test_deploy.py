"""The deployment launcher (``scirl/deploy/``) with real processes: small HTTP servers stand in for vLLM
and a small program for the trainer (``tests/fakes/deploy_fakes.py``), so every path runs without vLLM or a
model: ports, preflight refusals, startup, supervision, stop on a signal, and no process left behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scirl.deploy import launch, ports, preflight, supervisor
from scirl.errors import PreflightError
from scirl.run.config_io import load_config

FAKES = Path(__file__).parents[1] / "fakes" / "deploy_fakes.py"
REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 60  # "within seconds", asserted generously for a loaded 2-core machine
QWEN3_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "intermediate_size": 12288,
    "vocab_size": 151936,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": False,
}


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def deploy_args(tiny_model_dir, out: Path, *extra: str) -> list[str]:
    return [
        "--model",
        str(tiny_model_dir),
        "--device",
        "cpu",
        "--output-dir",
        str(out),
        "--deployment.num-infer-gpus",
        "2",
        "--deployment.startup-timeout-s",
        "60",
        *extra,
    ]


def start_launcher(tmp_path: Path, args: list[str], **spec) -> tuple[subprocess.Popen, Path]:
    record = tmp_path / "record"
    record.mkdir()
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"args": args, "record": str(record), **spec}))
    proc = subprocess.Popen(
        [sys.executable, str(FAKES), "launch", str(path)],
        env=env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    return proc, record


def finish(proc: subprocess.Popen, deadline_s: float = DEADLINE_S) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the launcher did not finish within {deadline_s}s:\n{out[-2000:]}\n{err[-2000:]}")
    return proc.returncode, out, err


def wait_for(path: Path, proc: subprocess.Popen) -> dict:
    deadline = time.monotonic() + DEADLINE_S
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{path.name} never appeared (launcher exit {proc.poll()}): {proc.communicate()}")
        time.sleep(0.05)
    return json.loads(path.read_text())


def recorded_pids(record: Path) -> list[int]:
    rows = [json.loads(p.read_text()) for p in record.glob("*.json")]
    return [row["pid"] for row in rows] + [pid for row in rows for pid in row.get("server_processes", [])]


def assert_all_gone(pids: list[int]) -> None:
    assert pids
    assert [pid for pid in pids if supervisor.alive(pid)] == []


# ---- end to end, through the launcher process ----


@pytest.mark.slow
def test_a_finished_run_exits_0_with_every_process_gone_and_its_ports_recorded(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    proc, record = start_launcher(tmp_path, deploy_args(tiny_model_dir, out, "--deployment.num-train-gpus", "2"))
    code, stdout, err = finish(proc)
    assert code == 0, err
    recorded = json.loads((out / "ports.json").read_text())
    assert len(set(recorded["servers"] + [recorded["nccl"], recorded["rendezvous"]])) == 4
    ranks = [json.loads((record / f"trainer_{rank}.json").read_text()) for rank in (0, 1)]
    for rank in ranks:  # torchrun with two ranks, each told where the servers are; both servers answered
        assert rank["world_size"] == "2" and rank["urls"] == recorded["urls"] and rank["health"] == [200, 200]
        argv = rank["argv"]
        assert argv[argv.index("--deployment.nccl-port") + 1] == str(recorded["nccl"])
        assert argv[argv.index("--deployment.weight-sync") + 1] == "filesystem"
    assert "--rdzv-endpoint" in err and f"127.0.0.1:{recorded['rendezvous']}" in err
    assert "step 1 done" in stdout  # the trainer's output on the console...
    assert "step 1 done" in (out / "logs" / "trainer.log").read_text()  # ...and in its log
    assert "listening" in (out / "logs" / "inference_1.log").read_text()
    servers = [json.loads((record / f"server_{i}.json").read_text()) for i in (0, 1)]
    for server in servers:  # CPU servers: one OpenMP thread, on a core of its own where the machine has two
        assert server["env"]["OMP_NUM_THREADS"] == "1" and len(server["affinity"]) == 1
    assert_all_gone(recorded_pids(record))


@pytest.mark.slow
@pytest.mark.parametrize(
    "behave, status, last_line", [("crash", 1, "fake CUDA out of memory"), ("refuse", 2, "fake refusal of a bad input")]
)
def test_a_trainer_failure_stops_the_servers_and_shows_its_last_lines(
    tiny_model_dir, tmp_path, behave, status, last_line
):
    proc, record = start_launcher(tmp_path, deploy_args(tiny_model_dir, tmp_path / "run"), behave=behave)
    code, _, err = finish(proc)
    assert code == status  # the trainer's own: a refused input stays exit 2
    assert f"trainer exited with exit code {status}" in err and last_line in err
    assert "Traceback" not in err.split("Its last log lines")[0]  # the launcher's own report has none
    assert_all_gone(recorded_pids(record))


@pytest.mark.slow
def test_a_server_dying_mid_run_stops_the_whole_run_and_shows_its_log(tiny_model_dir, tmp_path):
    die = tmp_path / "die"
    proc, record = start_launcher(
        tmp_path, deploy_args(tiny_model_dir, tmp_path / "run"), behave="wait", die_when={"1": str(die)}
    )
    wait_for(record / "trainer_0.json", proc)  # the run is going
    die.touch()
    code, _, err = finish(proc)
    assert code == 1
    assert "inference server 1 exited with exit code 7" in err and "fake engine core died" in err
    assert_all_gone(recorded_pids(record))


@pytest.mark.slow
def test_a_server_that_never_becomes_healthy_is_named_after_the_startup_timeout(tiny_model_dir, tmp_path):
    args = deploy_args(tiny_model_dir, tmp_path / "run", "--deployment.startup-timeout-s", "2")
    proc, record = start_launcher(tmp_path, args, server_modes={"1": "never"})
    code, _, err = finish(proc)
    assert code == 1
    assert "inference server 1 was not ready" in err and "startup_timeout_s = 2s" in err and "listening" in err
    assert "its last answer: status 503" in err  # what it answered, not only that it was not ready
    assert "scirl train: waiting for inference server(s): http://127.0.0.1:" in err  # the wait said what it waits for
    assert not (record / "trainer_0.json").exists()  # the trainer never started
    assert_all_gone(recorded_pids(record))


@pytest.mark.slow
def test_a_server_that_exits_at_start_fails_the_run_at_once(tiny_model_dir, tmp_path):
    args = deploy_args(tiny_model_dir, tmp_path / "run", "--deployment.startup-timeout-s", "600")
    proc, record = start_launcher(tmp_path, args, server_modes={"0": "exit"})
    code, _, err = finish(proc)  # long before the 600 s startup timeout
    assert code == 1
    assert "inference server 0 exited with exit code 3 before it was ready" in err and "fake model load failed" in err
    assert_all_gone(recorded_pids(record))


@pytest.mark.slow
def test_sigterm_to_the_launcher_reaches_every_trainer_rank_stops_the_servers_and_ends_quietly(
    tiny_model_dir, tmp_path
):
    out = tmp_path / "run"
    args = deploy_args(tiny_model_dir, out, "--deployment.num-train-gpus", "2")
    proc, record = start_launcher(tmp_path, args, behave="wait")
    for rank in (0, 1):
        wait_for(record / f"trainer_{rank}.json", proc)
    proc.send_signal(signal.SIGTERM)
    code, stdout, err = finish(proc)
    assert code == 128 + signal.SIGTERM
    for rank in (0, 1):  # each rank got one SIGTERM (a second would have killed it before its checkpoint)
        assert (record / f"sigterm_{rank}.json").exists()
    assert "asked the trainer to checkpoint" in err
    # a stop the user asked for reads as one: the ranks' own lines, one resume line, and no crash report
    # (torchrun reports its ranks' deliberate exit 143 as a failure: that goes to the trainer's log)
    console = stdout + err
    assert "step 1 done" in stdout
    assert console.count(f"Stopped by SIGTERM after step 1; resume with: scirl train --resume {out}") == 1
    for crash_words in ("Traceback", "ChildFailedError", "FAILED", "exitcode"):
        assert crash_words not in console
    log = (out / "logs" / "trainer.log").read_text()
    assert "ChildFailedError" in log and "exitcode  : 143" in log
    assert_all_gone(recorded_pids(record))


@pytest.mark.slow
def test_a_server_that_cannot_take_new_weights_is_refused_with_a_fix(tiny_model_dir, tmp_path):
    proc, record = start_launcher(tmp_path, deploy_args(tiny_model_dir, tmp_path / "run"), dev_routes="no")
    code, _, err = finish(proc)
    assert code == 2
    last = err.strip().splitlines()[-1]  # after the launcher's progress lines, the refusal: one line
    assert last.startswith("scirl train: inference server 0: http://127.0.0.1:")
    assert "cannot take new weights" in last and "start it with VLLM_SERVER_DEV_MODE=1" in last
    assert not (record / "trainer_0.json").exists()
    assert_all_gone(recorded_pids(record))


def test_a_taken_port_is_one_line_naming_it_and_its_holder_before_anything_starts(tiny_model_dir, tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        argv = ["-m", "scirl", "train", *deploy_args(tiny_model_dir, tmp_path / "run", "--deployment.port", str(port))]
        done = subprocess.run([sys.executable, *argv], env=env(), capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"deployment.port {port}" in lines[0] and f"pid {os.getpid()}" in lines[0]
    assert "fix:" in lines[0]
    assert not (tmp_path / "run" / "logs").exists() and not (tmp_path / "run" / "ports.json").exists()


def test_a_run_dir_holding_a_run_is_refused_before_the_servers_start(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.toml").write_text("")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    done = subprocess.run(
        [sys.executable, "-m", "scirl", "train", *deploy_args(tiny_model_dir, out)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "--resume" in done.stderr
    assert not (out / "ports.json").exists()


def test_a_run_dir_in_use_is_refused_before_the_servers_start(tiny_model_dir, tmp_path):
    from scirl.run import rundir

    out = tmp_path / "run"
    held = rundir.lock(out)  # as a live trainer holds it
    try:
        done = subprocess.run(
            [sys.executable, "-m", "scirl", "train", *deploy_args(tiny_model_dir, out)],
            env=env(),
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
        )
    finally:
        held.close()
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "in use" in done.stderr
    assert not (out / "ports.json").exists()


def test_under_torchrun_the_launcher_refuses_to_start(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from scirl.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", *deploy_args(tiny_model_dir, tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "without torchrun" in err


# ---- the parts, in process ----


def test_ports_are_distinct_and_a_given_nccl_port_is_checked():
    picked = ports.allocate("127.0.0.1", first_server_port=0, n_servers=3, nccl_port=0, rendezvous=True)
    assert len({*picked.servers, picked.nccl, picked.rendezvous}) == 5
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(PreflightError, match=f"deployment.nccl_port {port} .* in use by pid {os.getpid()}"):
            ports.allocate("127.0.0.1", first_server_port=0, n_servers=1, nccl_port=port, rendezvous=False)


def test_the_trainer_command_for_one_rank_and_for_torchrun(tmp_path):
    cfg = load_config(["--output-dir", str(tmp_path), "--deployment.num-infer-gpus", "2"])
    picked = ports.Ports("0.0.0.0", [8001, 8002], 9000, None)
    argv = launch.trainer_argv(cfg, ["@", "x.toml"], picked, "nccl", resume=True, clean=False)
    assert argv == [
        sys.executable,
        "-m",
        "scirl",
        "train",
        "@",
        "x.toml",
        "--resume",
        str(tmp_path),
        "--inference.urls",
        "http://127.0.0.1:8001,http://127.0.0.1:8002",
        "--deployment.nccl-port",
        "9000",
        "--deployment.weight-sync",
        "nccl",
    ]
    assert load_config(argv[8:]).inference.urls == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    cfg = load_config(["--deployment.num-infer-gpus", "6", "--deployment.num-train-gpus", "2"])
    argv = launch.trainer_argv(cfg, [], ports.Ports("127.0.0.1", [8001], 9000, 9001), "nccl", resume=False, clean=True)
    assert argv[:11] == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:9001",
    ]
    assert argv[11:15] == ["-m", "scirl", "train", "--clean"]


def test_a_resume_forgets_the_servers_its_launcher_started_last_time(tmp_path):
    picked = ports.Ports("127.0.0.1", [8001], 9000, None)
    ports.write(picked, tmp_path / "ports.json")
    saved = {"inference": {"urls": ["http://127.0.0.1:8001"], "backend": "auto"}, "deployment": {"nccl_port": 9000}}
    assert launch.forget_launched_servers(saved, tmp_path) == {"inference": {"backend": "auto"}, "deployment": {}}
    mine = {"inference": {"urls": ["http://elsewhere:8000"]}, "deployment": {"nccl_port": 7777}}
    assert launch.forget_launched_servers(mine, tmp_path) == mine  # a user's own servers stay


def test_the_launchers_files_neither_block_a_fresh_run_nor_fall_to_clean(tmp_path):
    from scirl.run import rundir

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "inference_0.log").write_text("live server log\n")
    (tmp_path / "ports.json").write_text("{}")
    rundir.prepare(tmp_path, resume=False, clean=False)  # no refusal: no results yet
    (tmp_path / "config.toml").write_text("")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    rundir.prepare(tmp_path, resume=False, clean=True)
    assert not (tmp_path / "metrics.jsonl").exists()
    assert (tmp_path / "logs" / "inference_0.log").read_text() == "live server log\n"


def test_parameter_count_from_safetensors_and_from_a_config(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert preflight.parameter_count(str(tiny_model_dir)) == sum(p.numel() for p in model.parameters())
    assert preflight.config_parameters(QWEN3_8B) == pytest.approx(8.19e9, rel=0.01)  # Qwen3-8B: 8.19B


def test_checkpoints_on_disk_counts_those_kept_plus_the_one_being_written():
    assert preflight.checkpoints_on_disk(30, 10, 2) == 3  # steps 10, 20, 30; keep 2 + 1 in flight
    assert preflight.checkpoints_on_disk(30, None, None) == 1  # the final one only
    assert preflight.checkpoints_on_disk(25, 10, None) == 3  # 10, 20 and the final 25


def test_too_little_disk_is_one_line_with_the_size_and_a_fix(tiny_model_dir, tmp_path, monkeypatch):
    cfg = load_config(["--model", str(tiny_model_dir), "--output-dir", str(tmp_path / "run"), "--ckpt.interval", "1"])
    total, one = preflight.disk_needed(cfg, "filesystem")
    monkeypatch.setattr(preflight, "free_bytes", lambda path: total - 1)
    with pytest.raises(PreflightError) as caught:
        preflight.check_disk(cfg, "filesystem")
    message = str(caught.value)
    assert "\n" not in message and "disk:" in message and "--ckpt.keep 1" in message and "fix:" in message
    monkeypatch.setattr(preflight, "free_bytes", lambda path: total)
    assert preflight.check_disk(cfg, "filesystem") == one


def test_an_sdpo_run_with_an_ema_teacher_budgets_its_copy_in_every_checkpoint(tiny_model_dir, tmp_path):
    base = ["--model", str(tiny_model_dir), "--output-dir", str(tmp_path / "run")]
    params = preflight.parameter_count(str(tiny_model_dir))
    serving = 4  # the tiny model's config says float32: its serving weights are float32 too
    assert preflight.disk_needed(load_config(base), "nccl")[1] == params * (12 + serving)
    assert preflight.disk_needed(load_config([*base, "--algorithm", "sdpo"]), "nccl")[1] == params * (16 + serving)
    current = load_config([*base, "--algorithm", "sdpo", "--sdpo.teacher", "current"])
    assert preflight.disk_needed(current, "nccl")[1] == params * (12 + serving)
    demo_base = REPO / "scirl" / "assets" / "demo-base"
    assert preflight.serving_bytes_per_param(str(demo_base)) == 2  # bf16


def test_a_missing_vllm_is_one_line_with_the_install_command(monkeypatch):
    real = preflight.importlib.util.find_spec
    monkeypatch.setattr(preflight.importlib.util, "find_spec", lambda name: None if name == "vllm" else real(name))
    with pytest.raises(PreflightError, match=r"not installed; fix: pip install 'scirl\[gpu\]'"):
        preflight.check_packages(cuda=True)


def test_gpus_too_few_or_busy_are_refused_and_the_rest_split_in_order(monkeypatch):
    monkeypatch.setattr(preflight, "visible_gpus", lambda: ["0", "1", "2", "3"])
    monkeypatch.setattr(preflight, "gpu_memory_used", lambda gpus: {gpu: 300 for gpu in gpus})
    plan = preflight.plan_gpus(3, 1)
    assert (plan.infer, plan.train) == (["0", "1", "2"], ["3"])
    with pytest.raises(PreflightError, match="needs 6 GPUs .* 4 are visible"):
        preflight.plan_gpus(4, 2)
    monkeypatch.setattr(preflight, "gpu_memory_used", lambda gpus: {gpu: 40000 if gpu == "2" else 300 for gpu in gpus})
    with pytest.raises(PreflightError, match=r"busy: GPU 2 \(40000 MiB in use\); fix:"):
        preflight.plan_gpus(3, 1)


def test_a_failure_report_leads_with_the_first_error_when_noise_follows_it(tmp_path):
    log = tmp_path / "inference_0.log"
    noise = [f" - leaked function f{i}" for i in range(50)]
    log.write_text(
        "\n".join(
            [
                "INFO loading",
                "WARNING quoted `OSError: x` in a warning",
                "(Worker pid=9) ERROR [executor.py:10] RuntimeError: Unsupported CPU attention",
                "EngineDeadError: engine died",
                *noise,
            ]
        )
        + "\n"
    )
    report = supervisor.Child("inference server 0", None, log).tail().splitlines()
    assert report[0] == "first error: (Worker pid=9) ERROR [executor.py:10] RuntimeError: Unsupported CPU attention"
    assert report[2:] == noise[-supervisor.TAIL_LINES :]
    log.write_text("step 1\nscirl train: generation failed: status 500\n")  # within the tail: shown once
    assert supervisor.Child("trainer", None, log).tail() == "step 1\nscirl train: generation failed: status 500"
