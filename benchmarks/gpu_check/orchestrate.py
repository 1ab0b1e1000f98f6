"""The orchestrator: the flags, the device's settings and time budget, each stage in its own process within it,
and the JSON kept current (``OUT/gpu_check.json``, rewritten atomically whenever a stage starts or ends).

A stage starts only when its estimate fits in what is left of ``--budget-s`` (else it is skipped, the reason
recorded), and its timeout is cut to what is left. A stage past its timeout gets SIGTERM (its worker stops what it
started), then SIGKILL; servers a stage started in sessions of their own are ended through the ids it left.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import common
from .common import REPO, StageError, error_text, python_env, say, stage_result, write_json_atomic
from .figures import (
    print_a_peer,
    print_a_resume,
    print_a_sweep,
    print_a_train,
    print_b_colocated,
    print_b_disaggregated,
    print_b_eval,
)
from .model import SHAPES, model_stage, parameter_count
from .peer import a_peer_stage
from .probe import probe_stage
from .stage_a import a_resume_stage, a_train_stage
from .stage_b import b_colocated_stage, b_disaggregated_stage
from .sweep import a_sweep2_stage, a_sweep_stage

# stage B, per shape on one H200 (141 GB): the engine's share (weights + KV, awake during generation while the
# trainer keeps its ~18 bytes/parameter) and activation checkpointing; micro-batches are scirl's default budget
GPU_SETTINGS = {
    "0.6b": dict(gpu_memory_utilization=0.35, activation_checkpointing=False),
    "1.7b": dict(gpu_memory_utilization=0.3, activation_checkpointing=False),
    "4b": dict(gpu_memory_utilization=0.25, activation_checkpointing=True),
    "8b": dict(gpu_memory_utilization=0.5, activation_checkpointing=True),
}
TRAIN_BYTES_PER_PARAM = 4 + 4 + 8 + 2  # float32 master + gradient + AdamW's two moments + the bf16 compute copy
H200_BF16_TFLOPS = 989.0  # dense, the datasheet's (the SXM part)

STAGES = (
    "probe",
    "model",
    "a_train",
    "a_sweep",
    "a_resume",
    "a_peer",
    "a_sweep2",
    "b_colocated",
    "b_disaggregated",
    "b_eval",
)
# stage A's stages in the order they run: --stage a (and all), and --stage targets, the first GPU call's (issue 41's
# figures first: the sweep's targets rows at 0.6b, the peer, the default row at 1.7b; then a_train, whose mid-run
# checkpoint gives issue 48's blocked seconds)
STAGE_A = {"a": ("a_train", "a_sweep", "a_resume", "a_peer"), "targets": ("a_sweep", "a_peer", "a_sweep2", "a_train")}
# (estimate, timeout) in seconds per stage at the defaults. GPU: one H200 (an H100 alike), 0.6b, 4 steps. Stage B's
# measured there (2026-12-04). Stage A's are GUESSES until a GPU runs the packed trainer: the steps as the earlier
# trainer measured them (generation ~8-13 s of a step through transformers, training ~1-2 s), a checkpoint of 7.8 GB
# at the ~400 MB/s measured (~20 s; a_train takes two), and each process's first steps compiling the decoder layer
# with flex attention (static, then dynamic) and the block mask: 1-3 minutes cold per process by the first-contact
# reading, ~90 s taken here; a later process of the same call finds inductor's cache warm for the same shapes.
# The probe compiles a tiny function (seconds). a_sweep's estimate is its targets' rows (the default, checkpointed
# and smaller rows: a compile, the checkpointed graph's, ~4 x 5 s of steps), the rest of its rows running while its
# timeout allows (each row is kept as it ends); a_peer: bench_trl's two sides (the model built on the host, scirl's
# side compiling, two steps each); a_sweep2: a 1.7b model built, saved and loaded, a cold compile at its shapes, a row.
# CPU: tiny, 2 steps, 1 thread, a busy 2-core machine.
GPU_BUDGET = {
    "probe": (20, 90),
    "model": (40, 150),
    "a_train": (200, 330),
    "a_sweep": (150, 330),
    "a_resume": (150, 330),
    "a_peer": (130, 240),
    "a_sweep2": (110, 200),
    "b_colocated": (210, 330),
    "b_disaggregated": (190, 330),
}
CPU_BUDGET = {
    "probe": (20, 90),
    "model": (15, 120),
    "a_train": (20, 240),
    "a_sweep": (20, 240),
    "a_resume": (45, 360),
    "a_peer": (30, 240),
    "a_sweep2": (15, 120),
    "b_colocated": (45, 420),
    "b_disaggregated": (45, 420),
}
TARGETS_SWEEP_CAP = 240  # --stage targets: a_sweep's timeout, so that a slow compile leaves the peer its time
SHAPE_TIME = {"tiny": 1, "0.6b": 1, "1.7b": 2, "4b": 4, "8b": 4}  # the train stages' time relative to 0.6b
# GPU defaults by shape: steps, and whether the resume check runs. A 1.7b checkpoint (float32 masters and AdamW's
# moments) is ~24 GB, ~60 s to write at the 400 MB/s measured, and the resume check writes four: left out by
# default there (--resume runs it, with a budget to match)
SHAPE_STEPS = {"0.6b": 4, "1.7b": 2, "4b": 2, "8b": 2}
TARGETS_STEPS = 3  # --stage targets: a_train's steps (a checkpoint after step 2 blocks step 3)
SECOND_SHAPE = {"0.6b": "1.7b", "tiny": "tiny"}  # a_sweep2's (a CPU: the same tiny shapes again, the code path)
BUDGET_STEPS = {"cuda": 4, "cpu": 2}  # the steps the estimates above are for
RESUME_BY_DEFAULT = {"tiny", "0.6b"}
FIXED_SHARE = 0.4  # the share of a train stage's estimate at the default steps that does not grow with steps
RESERVE_S = 5  # kept back from the budget for the last write of the JSON
KILL_GRACE_S = 20  # a stage past its timeout: SIGTERM (it stops its children), then SIGKILL after this


DESCRIPTION = "GPU check: GRPO on one GPU, offline, in stages that fit a time budget; every figure lands in a JSON file"


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2: no usage block
        self.exit(2, f"gpu_check: {message} (see --help)\n")


def parse_args(argv):
    parser = Parser(prog="benchmarks/gpu_check.sh", description=DESCRIPTION)
    parser.add_argument(
        "--stage",
        choices=("all", "a", "b", "targets"),
        default="all",
        help="a: no vLLM (the transformers backend, the sweep, the resume check, the peer); b: "
        "vLLM; all (default): A, then B where vLLM imports; targets: the first GPU call's, the "
        "targets' figures first (the sweep's targets rows, the peer, the default row at 1.7b), "
        "then a_train",
    )
    parser.add_argument("--no-vllm", action="store_true", help="the same as --stage a")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=480.0,
        help="seconds for the whole check (default 480); a stage that cannot fit what is left is skipped",
    )
    parser.add_argument("--cpu", action="store_true", help="the CPU check (default where CUDA is not available)")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="model shapes (default: 0.6b on a GPU, tiny on a CPU)")
    parser.add_argument(
        "--steps",
        type=int,
        help="GRPO steps (default: 4 on a GPU at 0.6b, 2 at larger shapes and on a "
        "CPU; at least 2 for the resume check)",
    )
    parser.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="stage A: the kill -9 resume check (a_resume; default: at 0.6b and tiny, not at larger shapes, "
        "whose checkpoints take a minute each to write)",
    )
    parser.add_argument("--questions", type=int, help="questions per step (default: 8 on a GPU, 4 on a CPU)")
    parser.add_argument("--group-size", type=int, help="completions per question (default: 16 on a GPU, 4 on a CPU)")
    parser.add_argument("--max-tokens", type=int, help="completion token limit (default: 256 on a GPU, 32 on a CPU)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument(
        "--micro-batch-tokens",
        type=int,
        help="the runs' micro-batch token budget (scirl's --micro-batch-tokens; default: scirl's, 8192)",
    )
    parser.add_argument("--eager", action="store_true", help="vLLM without CUDA graphs / compilation (always on a CPU)")
    parser.add_argument("--kv-cache-gib", type=float, default=0.25, help="CPU only: the engine's KV cache")
    parser.add_argument("--threads", type=int, default=1, help="CPU only: torch threads")
    parser.add_argument(
        "--resume-atol",
        type=float,
        default=0.0,
        help="largest |difference| allowed between the resumed and the uninterrupted run's final "
        "weights (default 0: bit-equal)",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        help="the peak MFU is taken against (default: 989, H200 bf16 dense, on a GPU; none on a CPU)",
    )
    parser.add_argument(
        "--keep-weights",
        action="store_true",
        help="keep the runs' checkpoints (default: removed once compared; they are GBs)",
    )
    parser.add_argument("--out", type=Path, help="work directory (default: a fresh temporary one, kept)")
    parser.add_argument(
        "--json", type=Path, help="also write the JSON here, at every update (e.g. where results are collected)"
    )
    parser.add_argument(
        "--disaggregated",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="stage B: also run the steps with a vLLM server generating (default: on a GPU)",
    )
    parser.add_argument(
        "--no-colocated",
        action="store_true",
        help="stage B: leave b_colocated out (the server stages alone, e.g. to rerun them)",
    )
    parser.add_argument(
        "--no-sweep",
        action="store_true",
        help="stage A: leave a_sweep out (the training step alone by micro-batch tokens, checkpointing, "
        "kernels and attention)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a stage's own process
    parser.add_argument("--context", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is None:
        for name in ("steps", "questions", "group_size", "max_tokens", "threads", "micro_batch_tokens"):
            value = getattr(args, name)
            if value is not None and value < 1:
                parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        resume = args.resume if args.resume is not None else (args.shape or "0.6b") in RESUME_BY_DEFAULT
        if args.steps is not None and args.steps < 2 and resume and args.stage in ("a", "all"):
            parser.error("--steps must be at least 2: the resume check kills the run in checkpoint 2's write")
        if not args.budget_s > 0:
            parser.error(f"--budget-s must be positive, got {args.budget_s}")
        if args.no_vllm and args.stage == "b":
            parser.error("--no-vllm and --stage b contradict each other")
        if args.stage == "targets" and args.resume:
            parser.error("--stage targets leaves the resume check out: --stage a runs it")
        if args.resume_atol < 0 or (args.peak_tflops is not None and not args.peak_tflops > 0):
            parser.error("--resume-atol must be >= 0 and --peak-tflops > 0")
    return parser, args


class Interrupted(Exception):
    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


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
            return self.skip(
                stage,
                f"needs ~{estimate:.0f}s (an estimate), {max(left, 0):.0f}s of the "
                f"--budget-s {self.args.budget_s:.0f} left",
            )
        timeout = min(cap, left)
        stage_dir = self.out / "stages"
        stage_dir.mkdir(parents=True, exist_ok=True)
        result_path, log_path = stage_dir / f"{stage}.json", stage_dir / f"{stage}.log"
        result_path.unlink(missing_ok=True)
        ctx_path = stage_dir / "context.json"
        # a stage that runs children of its own sizes their timeouts by its own
        write_json_atomic(ctx_path, {**ctx, "stage_timeout_s": timeout})
        say(f"[{stage}] started (estimate ~{estimate:.0f}s, timeout {timeout:.0f}s; log {log_path})")
        self.record(stage, {"status": "running", "estimate_s": estimate, "timeout_s": round(timeout)})
        started = time.monotonic()
        with open(log_path, "w") as log:
            # stdout: the stage's report lines, shown and logged; stderr: everything else, to the log only
            proc = subprocess.Popen(
                [sys.executable, "-m", __package__, "--worker", stage, "--context", str(ctx_path)],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=python_env(),
                cwd=REPO,
                start_new_session=True,
            )
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
    stage_b = args.stage in ("all", "b") and not args.no_vllm
    stage_a = args.stage != "b"
    check.result["asked"] = {"stage": "a" if args.no_vllm else args.stage, "argv": sys.argv[1:]}

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
        check.result.update(
            device=ctx["device"],
            dtype=ctx["dtype"],
            shape=ctx["shape"],
            settings={
                k: ctx[k] for k in ("steps", "questions", "group_size", "max_tokens", "seq_len", "micro_batch_tokens")
            },
        )
        say(
            f"gpu_check: {ctx['shape']} shapes on "
            f"{'the GPU (' + info.get('gpu_name', '?') + ')' if gpu else 'the CPU'}, {ctx['steps']} steps of "
            f"{ctx['questions']} x {ctx['group_size']} completions x <= {ctx['max_tokens']} tokens"
        )
        if not info.get("scirl_imports", True):
            check.skip("model", f"scirl does not import here: {info['scirl_error']}")
            return finish(check, "failed")
        model = check.run("model", ctx)
        if model["status"] != "ok":
            return finish(check, "failed")
        ctx.update(model["figures"])

        plan = STAGE_A["targets" if args.stage == "targets" else "a"]
        if not stage_a:
            for stage in plan:
                check.skip(stage, "not asked for (--stage b)")
        elif not ctx["trains"]:
            for stage in plan:
                check.skip(stage, ctx["trains_reason"])
        else:
            run_stage_a(check, ctx, args, plan)

        b_reason = None
        if not stage_b:
            b_reason = "not asked for (--no-vllm)" if args.no_vllm else f"not asked for (--stage {args.stage})"
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
            elif not ctx["trains"]:
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
        check.result["stage_b"] = (
            "ran" if b["status"] == "ok" else f"skipped: {b['reason']}" if b["status"] == "skipped" else b["status"]
        )
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


PRINT = {
    "a_train": print_a_train,
    "a_sweep": print_a_sweep,
    "a_sweep2": print_a_sweep,
    "a_peer": lambda f, ctx: print_a_peer(f),
    "a_resume": lambda f, ctx: print_a_resume(f),
}


def report(stage: str, figures: dict, ctx: dict) -> None:
    """A stage's printed report; one that fails to print says so in one line (its figures are in the JSON already)
    and the check goes on."""
    try:
        PRINT[stage](figures, ctx)
    except Exception as e:  # a figure the report did not expect: the check's next stages matter more
        say(f"[{stage}] its report could not be printed ({error_text(e)}); its figures are in the JSON")


def run_stage_a(check: Check, ctx: dict, args, plan: tuple[str, ...]) -> None:
    """Stage A's stages in ``plan``'s order, each printed as it ends (a stage cut by its timeout with figures kept, as
    a sweep's finished rows, too)."""
    done: dict[str, dict] = {}
    for stage in plan:
        if stage == "a_sweep" and args.no_sweep:
            entry = check.skip(stage, "not asked for (--no-sweep)")
        elif stage == "a_resume" and not ctx["resume"]:
            entry = check.skip(stage, f"not asked for at {ctx['shape']} (--resume runs it)")
        elif stage == "a_resume" and done.get("a_train", {}).get("status") != "ok":
            entry = check.skip(stage, "it compares against a_train's run, which did not finish")
        elif stage == "a_sweep2" and ctx["second_shape"] is None:
            entry = check.skip(
                stage, f"no second shape after {ctx['shape']} (on a GPU: 1.7b after 0.6b, where it trains)"
            )
        else:
            stage_ctx = {**ctx, "reference": done["a_train"]["figures"]} if stage == "a_resume" else ctx
            entry = check.run(stage, stage_ctx)
            if entry.get("figures") is not None:
                report(stage, entry["figures"], ctx)
        done[stage] = entry
    if "a_resume" not in plan:
        check.skip("a_resume", f"not in --stage {args.stage} (--stage a runs it)")


def settle(parser, args, info: dict, gpu: bool, out: Path) -> dict:
    """The run's settings: the device's defaults under what was asked; bad combinations exit 2."""
    defaults = (
        dict(shape="0.6b", steps=SHAPE_STEPS["0.6b"], questions=8, group_size=16, max_tokens=256)
        if gpu
        else dict(shape="tiny", steps=2, questions=4, group_size=4, max_tokens=32)
    )
    shape = args.shape or defaults["shape"]
    if gpu and shape == "tiny":
        parser.error("--shape tiny is the CPU check's; on a GPU take 0.6b, 1.7b, 4b or 8b")
    targets = args.stage == "targets"
    if gpu:
        defaults["steps"] = TARGETS_STEPS if targets else SHAPE_STEPS[shape]
    chosen = {key: getattr(args, key) if getattr(args, key) is not None else value for key, value in defaults.items()}
    resume = False if targets else args.resume if args.resume is not None else shape in RESUME_BY_DEFAULT
    if resume and chosen["steps"] < 2:
        parser.error("--steps must be at least 2: the resume check kills the run in checkpoint 2's write")
    if chosen["max_tokens"] >= args.seq_len:
        parser.error(f"--max-tokens {chosen['max_tokens']} leaves no room for a prompt in --seq-len {args.seq_len}")
    budget = GPU_BUDGET if gpu else CPU_BUDGET
    if targets:
        budget = {**budget, "a_sweep": (budget["a_sweep"][0], TARGETS_SWEEP_CAP)}
    # a train stage: a fixed part (starts, loads, the final checkpoint) and a part per step, both slower at larger
    # shapes than at the estimates' (0.6b, BUDGET_STEPS); the sweep and the peer do not depend on the steps, a_sweep2
    # runs at its own shape
    per_steps = FIXED_SHARE + (1 - FIXED_SHARE) * chosen["steps"] / BUDGET_STEPS["cuda" if gpu else "cpu"]

    def scaled(stage: str, est: float, cap: float) -> tuple[float, float]:
        if stage == "a_sweep2" or not stage.startswith(("a_", "b_")):
            return est, cap
        steps = 1 if stage in ("a_sweep", "a_peer") else per_steps
        return est * SHAPE_TIME[shape] * steps, cap * SHAPE_TIME[shape] * max(1.0, steps)

    budget = {stage: scaled(stage, est, cap) for stage, (est, cap) in budget.items()}
    ctx = dict(
        chosen,
        out=str(out),
        device="cuda" if gpu else "cpu",
        dtype="bfloat16" if gpu else "float32",
        seq_len=args.seq_len,
        eager=args.eager or not gpu,
        kv_cache_gib=args.kv_cache_gib,
        threads=args.threads,
        resume_atol=args.resume_atol,
        keep_weights=args.keep_weights,
        budget=budget,
        peak_tflops=args.peak_tflops if args.peak_tflops is not None else (H200_BF16_TFLOPS if gpu else None),
        settings=GPU_SETTINGS.get(shape, dict(gpu_memory_utilization=0.5, activation_checkpointing=False)),
        micro_batch_tokens=args.micro_batch_tokens,
        gpu_count=info.get("gpu_count", 0),
        resume=resume,
        sweep_rows="targets" if targets else "all",
        second_shape=SECOND_SHAPE.get(shape),
    )
    ctx["trains"], ctx["trains_reason"] = True, ""
    if gpu:
        have_gb = info["gpu_memory_gb"]
        for name in filter(None, (shape, ctx["second_shape"])):
            need_gb = parameter_count(name) * TRAIN_BYTES_PER_PARAM / 1e9
            if need_gb > 0.9 * have_gb and name == shape:
                ctx["trains"] = False
                ctx["trains_reason"] = (
                    f"{shape}: training needs ~{need_gb:.0f} GB for float32 masters, gradients, "
                    f"AdamW and the bf16 copy alone, this GPU has {have_gb:.0f} GB (stage B "
                    "measures generation only)"
                )
            elif need_gb > 0.9 * have_gb:
                ctx["second_shape"] = None
    return ctx


def finish(check: Check, status: str) -> int:
    check.result["status"] = status
    check.save()
    say(
        f"gpu_check: {status}; wall {time.monotonic() - check.started:.0f}s; all figures in "
        f"{check.out / 'gpu_check.json'}"
    )
    return 0 if status == "ok" else 1


def worker(stage: str, ctx_path: Path) -> int:
    # say() keeps the pipe to the orchestrator; whatever else writes to stdout (vLLM's engine, progress
    # bars, warnings) goes where stderr goes: the stage's log
    sys.stdout.flush()
    common.REPORT = os.fdopen(os.dup(1), "w", buffering=1)
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
        write_json_atomic(result_path, {"error": str(e), "log_tail": e.log_tail})
        return 1
    write_json_atomic(result_path, data)
    return 0


WORKERS = {
    "probe": probe_stage,
    "model": model_stage,
    "a_train": a_train_stage,
    "a_sweep": a_sweep_stage,
    "a_resume": a_resume_stage,
    "a_peer": a_peer_stage,
    "a_sweep2": a_sweep2_stage,
    "b_colocated": b_colocated_stage,
    "b_disaggregated": b_disaggregated_stage,
}


def main(argv: list[str] | None = None) -> int:
    parser, args = parse_args(argv)
    if args.worker is not None:
        if args.worker not in WORKERS or args.context is None:
            parser.error(f"--worker takes one of {', '.join(WORKERS)} with --context")
        return worker(args.worker, args.context)
    return orchestrate(parser, args)
