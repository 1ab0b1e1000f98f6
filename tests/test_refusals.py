"""Refusals that depend on the machine, and Ctrl-C (issue 43, item 2): a back-end, a device or an output directory
this machine lacks is one line and exit 2 before any work; Ctrl-C ends every command with 130.

(Refusals of bad input alike on every machine are the table of tests/test_cli_errors.py.)
"""

from __future__ import annotations

import builtins
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import scirl.commands.data
import scirl.demo.run
from scirl.cli import main as cli_main
from scirl.errors import RunDirError
from scirl.run.config_io import load_config, write_config
from scirl.run.rundir import lock
from scirl.synth.questions import generate_rows, write_jsonl


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(generate_rows(n_per_domain=4, seed=2), tmp_path_factory.mktemp("refusals") / "rows.jsonl")


def train_argv(model, data, out) -> list[str]:
    return ["train", "--model", str(model), "--data.source", str(data), "--output-dir", str(out), "--device", "cpu",
            "--max-steps", "1", "--batch-size", "8", "--group-size", "8", "--max-completion-tokens", "4", "--seq-len", "256"]


def test_the_vllm_backend_without_vllm_is_refused_before_any_work(tiny_model_dir, data, tmp_path, monkeypatch, capsys):
    """`--inference.backend vllm` where vLLM is not installed: two chained tracebacks, after the demo had spent its
    base evaluation. Now one line naming the fix, and nothing written."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # what a machine without vLLM has: find_spec None, import fails
    run_dir = tmp_path / "run"
    assert cli_main(train_argv(tiny_model_dir, data, run_dir) + ["--inference.backend", "vllm"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "vLLM is not installed" in line and "--inference.backend hf" in line
    assert not run_dir.exists()
    demo_dir = tmp_path / "demo"
    assert cli_main(["demo", "--output-dir", str(demo_dir), "--no-progress", "--inference.backend", "vllm"]) == 2
    assert "vLLM is not installed" in one_line(capsys.readouterr().err)
    assert not demo_dir.exists()  # no base evaluation, no questions written


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: --device cuda is fine here")
def test_cuda_on_a_machine_without_it_is_refused_in_one_line(tiny_model_dir, data, tmp_path, capsys):
    """On a CPU build of torch, `--device cuda` raised AttributeError (torch._C has no _cuda_setDevice)."""
    argv = train_argv(tiny_model_dir, data, tmp_path / "run")
    argv[argv.index("--device") + 1] = "cuda"
    assert cli_main(argv) == 2
    assert "no CUDA device" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def test_flex_attention_where_it_cannot_train_is_refused_before_any_work(tiny_model_dir, data, tmp_path, capsys):
    """`--attention flex` on a CPU (torch's flex attention has no backward there) ended in a traceback at the first
    backward, after the model had loaded and sampled: one line naming the fix, exit 2, nothing written."""
    for device in ("cpu", "auto") if not torch.cuda.is_available() else ("cpu",):
        argv = train_argv(tiny_model_dir, data, tmp_path / "run") + ["--attention", "flex"]
        argv[argv.index("--device") + 1] = device
        assert cli_main(argv) == 2
        line = one_line(capsys.readouterr().err)
        assert "attention = 'flex' trains on CUDA only" in line and "--attention sdpa" in line, line
        assert not (tmp_path / "run").exists()


def test_an_output_directory_that_cannot_be_written_is_refused(tiny_model_dir, data, tmp_path, monkeypatch, capsys):
    """A read-only --output-dir (exit 1 and a traceback from the run's lock file): one line, exit 2."""
    locked = tmp_path / "read-only"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != locked and real_access(path, mode, **kw))
    assert cli_main(train_argv(tiny_model_dir, data, locked)) == 2
    assert "cannot write in it" in one_line(capsys.readouterr().err)
    assert cli_main(train_argv(tiny_model_dir, data, locked / "run")) == 2  # a new directory inside it
    assert "cannot write in" in one_line(capsys.readouterr().err)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only directory anyway")
def test_a_read_only_output_directory_is_refused(tiny_model_dir, data, tmp_path, capsys):
    locked = tmp_path / "read-only"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        assert cli_main(train_argv(tiny_model_dir, data, locked)) == 2
        assert "cannot write in it" in one_line(capsys.readouterr().err)
    finally:
        locked.chmod(0o755)


def test_the_run_directory_lock_refuses_a_directory_it_cannot_write_in(tmp_path, monkeypatch):
    """The library's own check (a launcher's trainer, a test calling train()): a RunDirError, not a PermissionError."""
    real_open = builtins.open

    def no_write(path, *args, **kwargs):
        if Path(path).name == ".lock":
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_write)
    with pytest.raises(RunDirError, match="cannot write in the run directory"):
        lock(tmp_path / "run")


# ---- Ctrl-C: 130 ----


def test_ctrl_c_in_any_command_is_one_line_and_130(monkeypatch, capsys):
    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(scirl.commands.data, "main", interrupted)
    assert cli_main(["data", "stats"]) == 130
    assert one_line(capsys.readouterr().err) == "scirl data: interrupted"


def test_a_demo_whose_training_is_stopped_by_ctrl_c_exits_130(tmp_path, monkeypatch, capsys):
    """The trainer stops on Ctrl-C after its step and checkpoint and returns 130; the demo exited 1 ("training
    stopped (status 130)"). Now it says where the run is and exits 130, as the shell expects of Ctrl-C."""
    monkeypatch.setattr(scirl.demo.run, "train", lambda cfg, **kwargs: 128 + signal.SIGINT)
    out = tmp_path / "demo"
    assert cli_main(["demo", "--output-dir", str(out), "--no-report", "--no-progress", "--train-per-domain", "2",
                     "--eval-per-domain", "1"]) == 130
    line = [line for line in capsys.readouterr().err.splitlines() if line.startswith("scirl demo:")]
    assert len(line) == 1 and "SIGINT" in line[0] and str(out) in line[0]
    assert (out / "eval_base.json").is_file()  # what was done before the stop stays


def test_ctrl_c_stops_a_server_with_130(tiny_model_dir):
    """`scirl serve` exited 0 on Ctrl-C (uvicorn shut down, then raised it again, and the command swallowed it)."""
    proc = subprocess.Popen([sys.executable, "-m", "scirl", "serve", str(tiny_model_dir), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # the server says when it serves: wait for that, not for a time
            if "ready at" in line:
                break
        else:
            pytest.fail(f"the server ended before serving: {proc.stderr.read()}")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err


def test_ctrl_c_that_uvicorn_swallows_still_ends_the_server_with_130(tiny_model_dir, monkeypatch, capsys):
    """uvicorn raises the SIGINT it caught again on its way out, after putting back the handler it found; in a
    process started with SIGINT ignored (a script's background job, `nohup`) that raise is ignored and the server
    exited 0. The server remembers the signal itself."""
    import uvicorn

    def caught_sigint_and_returned(self, sockets=None):
        self.handle_exit(signal.SIGINT, None)  # what uvicorn's handler does with Ctrl-C

    monkeypatch.setattr(uvicorn.Server, "run", caught_sigint_and_returned)
    assert cli_main(["serve", str(tiny_model_dir), "--port", "0"]) == 130
    assert "scirl serve: interrupted; the server is stopped" in capsys.readouterr().err


def test_a_dry_run_of_a_run_whose_model_moved_plans_without_a_traceback(tmp_path, capsys):
    """A resume reads its checkpoint, not the model its config names, so that model may be gone; the memory plan
    of `--device cuda --dry-run` asked the hub cache about the path and raised HFValidationError."""
    run_dir = tmp_path / "run"
    write_config(load_config(["--model", str(tmp_path / "moved-model"), "--output-dir", str(run_dir)]),
                 run_dir / "config.toml")
    assert cli_main(["train", "--resume", str(run_dir), "--device", "cuda", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "no memory plan" in out and "moved-model" in out
