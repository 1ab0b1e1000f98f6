"""Running ``scirl train`` as a user runs it (stages A and B): its flags, the deterministic launch, the device's
memory sampled meanwhile, and its step lines echoed."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .common import REPO, StageError, python_env, say

# On a GPU, what makes a run's result depend on its inputs alone (``scirl_run --deterministic`` sets it). cuBLAS needs
# a fixed workspace to repeat itself; torch's deterministic algorithms (warn_only: the sampler's CUDA cumsum has
# none and would raise) make the backward of the trainer's index_select (the packed rows' gathers: a prompt's last
# position predicts every completion's first token) a sorted sum instead of atomic adds. The attention: flex
# attention's Triton backward (CUDA's default) gives each program one block of dQ or of dK/dV and sums in a fixed
# order, with no atomic adds (torch/_inductor/kernel/flex/flex_attention.py), so it needs no switch; the SDPA path
# (attention = "sdpa") goes through SDPA's math kernel, whose backward is plain matmuls (the flash,
# memory-efficient and cuDNN kernels' backward passes accumulate in a nondeterministic order unless warn_only is off).
DETERMINISM_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
DETERMINISTIC_SETTINGS = {
    **DETERMINISM_ENV,
    "use_deterministic_algorithms": "True, warn_only=True",
    "sdpa": "math (flash, memory-efficient and cuDNN kernels off; the flex path needs no switch)",
}


class DeviceMemoryPeak:
    """The GPU's used memory as nvidia-smi reports it, sampled in a thread: the whole training process,
    vLLM's own memory pools included (torch's allocator statistics miss those)."""

    def __init__(self, interval: float = 0.5):
        self.interval, self.peak_mb, self._stop = interval, None, threading.Event()
        # the device torch calls cuda:0 (nvidia-smi numbers them all)
        self.gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
        self._thread = threading.Thread(target=self._run, daemon=True) if shutil.which("nvidia-smi") else None

    def _run(self):
        while not self._stop.is_set():
            try:
                text = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", self.gpu],
                    capture_output=True,
                    text=True,
                    timeout=10,
                ).stdout
                value = float(text.split()[0])
                self.peak_mb = value if self.peak_mb is None else max(self.peak_mb, value)
            except (subprocess.SubprocessError, ValueError, IndexError, OSError):
                pass
            self._stop.wait(self.interval)

    def __enter__(self):
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)


def train_flags(
    ctx: dict,
    run_dir: Path,
    *,
    activation_checkpointing: bool,
    ckpt_interval: int,
    engine: list[str],
    reward: list[str] = (),
) -> list[str]:
    """``scirl train``'s flags for the check's run: its shapes, the micro-batch token budget asked for (else scirl's
    default), the kernels and attention the device defaults to."""
    flags = [
        "--model",
        ctx["model_dir"],
        "--output-dir",
        str(run_dir),
        "--data.source",
        ctx["data"],
        "--data.eval-per-domain",
        "5",
        "--max-steps",
        str(ctx["steps"]),
        "--batch-size",
        str(ctx["questions"] * ctx["group_size"]),
        "--group-size",
        str(ctx["group_size"]),
        "--max-completion-tokens",
        str(ctx["max_tokens"]),
        "--seq-len",
        str(ctx["seq_len"]),
        "--temperature",
        "1.0",
        "--device",
        ctx["device"],
        "--dtype",
        ctx["dtype"],
        "--seed",
        "0",
        "--ckpt.interval",
        str(ckpt_interval),
        *engine,
        *reward,
        # a random model: no reward, ids past the tokenizer, repeats; monitor only, so every completion is trained on
        "--filters.gibberish.no-enforce",
        "--filters.repetition.no-enforce",
        "--filters.zero-advantage.no-enforce",
    ]
    if ctx.get("micro_batch_tokens"):
        flags += ["--micro-batch-tokens", str(ctx["micro_batch_tokens"])]
    if activation_checkpointing:
        flags.append("--activation-checkpointing")
    return flags


def scirl_command(args: list[str], deterministic: bool, steps_file: Path | None = None) -> list[str]:
    """``scirl ARGS`` through ``scirl_run``: with the deterministic settings, and each step's training peak and
    compile counts written to ``steps_file``, as asked."""
    options = (["--deterministic"] if deterministic else []) + (["--steps", str(steps_file)] if steps_file else [])
    return [sys.executable, "-m", f"{__package__}.scirl_run", *options, "--", *args]


def launch(ctx: dict, cmd: list[str], log_path: Path, env_extra: dict | None = None, kill_when=None) -> dict:
    """Run ``scirl train``, its step lines echoed and its whole output in ``log_path``. ``kill_when``: a
    callable polled every 20 ms; once true, the run gets SIGKILL. Returns wall seconds, the device's peak
    MB (nvidia-smi), each checkpoint's seconds (``saves``: its background write, from its "Saved ..." line;
    ``blocked``: what the save blocked the step, from its "Checkpoint ...: handed to the writer" line) and whether
    it was killed."""
    say(f"  scirl {' '.join(cmd[cmd.index('train') :])}\n    (log: {log_path})")
    env = python_env(**(env_extra or {}))
    if ctx["device"] == "cpu":
        env["OMP_NUM_THREADS"] = str(ctx["threads"])
    saves: dict[int, float] = {}
    blocked: dict[int, float] = {}
    started = time.perf_counter()
    with DeviceMemoryPeak() as memory, open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)

        def read():
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if line.startswith(
                    ("Step ", "Training ", "Saved ", "Resuming ", "Skipped ", "Checkpoint ", "Waiting ")
                ):
                    say("    " + line.rstrip())
                # "Saved checkpoint weights/step_N (12.3s)", or, written in the background, "(...; 12.3s in the
                # background)": the write's seconds either way
                saved = re.match(
                    r"Saved checkpoint weights/step_(\d+) \((?:.*; )?([\d.]+)s(?: in the background)?\)", line
                )
                if saved:
                    saves[int(saved.group(1))] = float(saved.group(2))
                handed = re.match(r"Checkpoint weights/step_(\d+): handed to the writer \(([\d.]+)s blocked\)", line)
                if handed:
                    blocked[int(handed.group(1))] = float(handed.group(2))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        killed = False
        try:
            if kill_when is None:
                proc.wait()
            else:
                while proc.poll() is None:
                    if kill_when():
                        proc.send_signal(signal.SIGKILL)  # kill -9: no handler, no cleanup, as a crash
                        killed = True
                        break
                    time.sleep(0.02)
                proc.wait()
        finally:
            if proc.poll() is None:  # this stage was told to stop: the run goes with it
                proc.kill()
                proc.wait()
        reader.join(timeout=30)
    if proc.returncode != 0 and not killed:
        raise StageError(
            f"scirl train exited {proc.returncode}; the end of {log_path.name} is in log_tail",
            log_path.read_text(errors="replace").splitlines()[-30:],
        )
    return {
        "wall_s": time.perf_counter() - started,
        "device_peak_mb": memory.peak_mb,
        "saves": saves,
        "blocked": blocked,
        "killed": killed,
    }
