"""``benchmarks/gpu_check.sh`` on a CPU: the GPU check's own code paths with a tiny model.

- bad input: one line, exit 2; the budget: a stage that cannot fit is skipped, not started; the first GPU call's
  stages (``--stage targets``) in the order of what matters, within the default budget;
- the completion lengths the model is built for: the sampler of the sweep's batch against the stated distribution;
- what the GPU call measures, each against the real library where a CPU has it: torch.compile's counts (dynamo's
  counters on compiled functions, a row's steps on unseen batches, a new trainer's cleared caches), the probe's
  compile check with a missing compiler; against a stand-in of torch.cuda's allocator statistics with their
  contract: the training peak without generation's KV cache, a row's timed peak, cache and retries; the memory
  plan's verdicts behind the 20 GB row; the peer's figures from bench_trl's own report.

Its stages run whole in ``tests/e2e/test_gpu_check_cpu.py``; stage B where vLLM does not import, here.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers.gpu_check import REPO, import_gpu_check, run_check
from scirl.distributed import Dist
from scirl.trainer.model import load_model
from scirl.trainer.packing import count_unique_tokens


@pytest.mark.parametrize(
    "args, says",
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--steps", "1"], "--steps must be at least 2"),
        (["--budget-s", "soon"], "--budget-s: invalid float value"),
        (["--shape", "70b"], "--shape: invalid choice"),
        (["--stage", "b", "--no-vllm"], "contradict"),
        (["--stage", "targets", "--resume"], "--stage targets leaves the resume check out"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, says):
    done = run_check([*args, "--out", str(tmp_path)], tmp_path, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1 and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_stage_that_cannot_fit_the_budget_left_is_skipped_with_its_reason(tmp_path):
    gpu_check = import_gpu_check()
    _, args = gpu_check.parse_args(["--cpu", "--budget-s", "100", "--out", str(tmp_path)])
    check = gpu_check.Check(args, tmp_path)
    check.deadline = time.monotonic() + 30  # 30 s left, minus the reserve: the stage's estimate is 45 s
    entry = check.run("a_resume", {"out": str(tmp_path), "budget": {"a_resume": (45, 360)}})
    assert entry["status"] == "skipped" and entry["reason"].startswith("needs ~45s (an estimate)")
    assert not (tmp_path / "stages" / "a_resume.log").exists()  # never started
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["stages"]["a_resume"] == entry


def test_stage_b_where_vllm_does_not_import_is_skipped_with_its_reason(tmp_path, monkeypatch):
    """A vLLM that is installed but does not import (a broken wheel, a build for another torch): b_colocated, run in
    its own process, skips with the import's error; the disaggregated stage and the eval skip with the same reason;
    the JSON's ``stage_b`` says so, and a call that asked for stage B alone fails. The probe's and the model's results
    are given here (they run whole in ``tests/e2e/test_gpu_check_cpu.py``)."""
    gpu_check = import_gpu_check()
    shim = tmp_path / "shim" / "vllm"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text('raise ImportError("a stand-in vllm that does not import")\n')
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(shim.parent), os.environ.get("PYTHONPATH")])))
    given = {
        "probe": {"cuda_available": False, "vllm_found": True, "scirl_imports": True},
        "model": {"trains": True, "trains_reason": ""},
    }
    real_run = gpu_check.Check.run

    def run(self, stage, ctx):
        if stage in given:
            return self.record(stage, {"status": "ok", "figures": given[stage]})
        return real_run(self, stage, ctx)

    monkeypatch.setattr(gpu_check.Check, "run", run)
    out = tmp_path / "out"
    parser, args = gpu_check.parse_args(["--cpu", "--stage", "b", "--disaggregated", "--out", str(out)])
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        status = gpu_check.orchestrate(parser, args)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    result = json.loads((out / "gpu_check.json").read_text())
    stages = result["stages"]
    for stage in ("b_colocated", "b_disaggregated", "b_eval"):
        assert stages[stage]["status"] == "skipped", stages[stage]
        assert stages[stage]["reason"].startswith("vLLM does not import: ImportError: a stand-in vllm"), stages[stage]
    assert result["stage_b"].startswith("skipped: vLLM does not import")
    assert status == 1 and result["status"] != "ok"  # stage B alone was asked for, and nothing of it measured


def settled(gpu_check, argv: list[str], gpu: bool = True, memory_gb: float = 150.0) -> dict:
    parser, args = gpu_check.parse_args([*argv, "--out", "unused"])
    info = {"cuda_available": gpu, "gpu_memory_gb": memory_gb, "gpu_count": 1}
    return gpu_check.settle(parser, args, info, gpu, Path("unused"))


def estimate(ctx: dict, stages: list[str]) -> float:
    return sum(ctx["budget"][s][0] for s in stages)


def test_the_first_calls_stages_fit_the_default_budget_in_the_order_of_what_matters():
    """``--stage targets`` (the first GPU call): issue 41's figures (the sweep's targets rows at 0.6b, the peer, the
    default row at 1.7b) fit the default budget by their estimates; a_train comes last, on what they leave; the sweep's
    timeout leaves the peer its time. ``--stage a --no-sweep`` (a_train, the resume check) fits a call of its own."""
    gpu_check = import_gpu_check()
    _, args = gpu_check.parse_args(["--out", "unused"])
    left = args.budget_s - gpu_check.RESERVE_S
    first = settled(gpu_check, ["--stage", "targets"])
    assert (first["shape"], first["steps"], first["resume"], first["sweep_rows"], first["second_shape"]) == (
        "0.6b",
        3,
        False,
        "targets",
        "1.7b",
    )
    assert gpu_check.STAGE_A["targets"] == ("a_sweep", "a_peer", "a_sweep2", "a_train")
    assert estimate(first, ["probe", "model", "a_sweep", "a_peer", "a_sweep2"]) <= left
    assert first["budget"]["a_sweep"][1] + estimate(first, ["probe", "model", "a_peer"]) <= left
    second = settled(gpu_check, ["--stage", "a", "--no-sweep"])
    assert (second["steps"], second["resume"]) == (4, True)
    assert estimate(second, ["probe", "model", "a_train", "a_resume"]) <= left
    larger = settled(gpu_check, ["--shape", "1.7b", "--no-sweep"])
    assert (larger["steps"], larger["resume"]) == (2, False)  # its checkpoints take a minute each
    assert estimate(larger, ["probe", "model", "a_train"]) <= left
    # asked for, the resume check comes back, and its estimate grows with the steps asked for
    asked = settled(gpu_check, ["--shape", "1.7b", "--resume", "--steps", "4"])
    assert (
        asked["resume"]
        and asked["budget"]["a_resume"][0]
        > settled(gpu_check, ["--shape", "1.7b", "--resume"])["budget"]["a_resume"][0]
    )
    small = settled(gpu_check, [])
    assert larger["budget"]["a_sweep"][0] == 2 * small["budget"]["a_sweep"][0]  # the sweep does not depend on steps
    assert larger["budget"]["a_sweep2"] == small["budget"]["a_sweep2"]  # at its own shape
    # a second shape that cannot train on this GPU is left out; the first's own
    assert settled(gpu_check, ["--stage", "targets"], memory_gb=30.0)["second_shape"] is None


def test_one_step_is_enough_without_the_resume_check_and_refused_with_it(tmp_path):
    gpu_check = import_gpu_check()
    assert settled(gpu_check, ["--shape", "1.7b", "--steps", "1"])["steps"] == 1
    done = run_check(["--steps", "1", "--resume", "--out", str(tmp_path)], tmp_path, timeout=60)
    assert done.returncode == 2 and "--steps must be at least 2" in done.stderr and len(done.stderr.splitlines()) == 1


@pytest.mark.slow
def test_the_deterministic_launch_runs_scirl_train():
    """On a GPU, stage A launches ``scirl train`` through a prelude that sets the deterministic kernels: the same
    CLI."""
    launch, common = import_gpu_check("launch"), import_gpu_check("common")
    cmd = launch.scirl_command(
        ["train", "--dry-run", "--max-steps", "3", "--inference.backend", "hf"], deterministic=True
    )
    done = subprocess.run(cmd, capture_output=True, text=True, env=common.python_env(), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "max_steps = 3" in done.stdout and 'backend = "hf"' in done.stdout


def test_the_completion_lengths_are_the_stated_geometric_distribution():
    """The sweep's batch draws its lengths from ``completion_lengths``, the runs' model is biased to the same rate:
    at the 256-token limit EOS at 1/100 a token gives a mean of 92.4 tokens, a median of 69 and 7.6% at the limit."""
    model = import_gpu_check("model")
    assert model.eos_rate(256) == pytest.approx(0.01)
    stated = model.length_distribution(256)
    assert stated["mean"] == pytest.approx(92.37, abs=0.01) and stated["median"] == 69
    assert stated["at_limit"] == pytest.approx(0.0763, abs=1e-4)
    drawn = model.completion_lengths(20_000, 256, seed=0)
    # the mean of 20,000 draws of a distribution whose standard deviation is 77.1: within 4 sigma of 0.545
    assert abs(sum(drawn) / len(drawn) - stated["mean"]) < 2.2 and max(drawn) == 256 and min(drawn) == 1
    # the share that reaches the limit, no EOS in the first 255 tokens: within 4 sigma of 0.0019
    assert abs(sum(n == 256 for n in drawn) / len(drawn) - 0.99**255) < 0.0076
    # a CPU's 32-token limit keeps the shape: the same share of completions reaches it
    assert model.length_distribution(32)["at_limit"] == pytest.approx(stated["at_limit"], rel=1e-9)


class CudaMemory:
    """A stand-in for torch.cuda's allocator statistics with their contract: the peaks are the largest allocated and
    reserved bytes since the last ``reset_peak_memory_stats``, which sets them to what is allocated and reserved now;
    freed blocks stay reserved (the caching allocator keeps them); the device's used memory is a context plus what
    is reserved; ``num_alloc_retries`` counts the allocator's retries."""

    def __init__(self, total: int = 80 * 10**9, context: int = 10**9):
        self.total, self.context = total, context
        self.allocated = self.peak = self.reserved = self.peak_reserved = self.retries = 0

    def allocate(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, n: int) -> None:
        self.allocated -= n

    def max_memory_allocated(self, device=None) -> int:
        return self.peak

    def max_memory_reserved(self, device=None) -> int:
        return self.peak_reserved

    def reset_peak_memory_stats(self, device=None) -> None:
        self.peak, self.peak_reserved = self.allocated, self.reserved

    def memory_stats(self, device=None) -> dict:
        return {"num_alloc_retries": self.retries, "allocated_bytes.all.peak": self.peak}

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return self.total - self.context - self.reserved, self.total

    def synchronize(self, device=None) -> None:
        pass


def test_the_training_peak_leaves_generations_kv_cache_out(monkeypatch, tmp_path):
    """a_train's runs record each step's training peak from inside the process: the allocator's peak is reset before
    the trainer's half of the step, so the KV cache generation took (and freed) before it is not in it."""
    import scirl.run.train as train

    scirl_run = import_gpu_check("scirl_run")
    memory, gb = CudaMemory(), 10**9
    memory.allocate(5 * gb)  # the masters, the compute copy, AdamW's moments

    def learn(batch, trainer):  # the step's activations, freed by its end
        memory.allocate(3 * gb)
        memory.free(3 * gb)
        return {"stepped": True}

    monkeypatch.setattr(train, "learn", learn)
    scirl_run.record_steps(tmp_path / "steps.jsonl", memory)
    trainer = SimpleNamespace(device=torch.device("cuda", 0))
    for step in (1, 2):
        memory.allocate(8 * gb)  # generation's KV cache
        memory.free(8 * gb)
        assert train.learn(SimpleNamespace(step=step), trainer) == {"stepped": True}  # one_step calls it so
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert [line["train_peak_bytes"] for line in lines] == [8 * gb, 8 * gb]  # the state and the activations alone
    assert lines[0]["peak_before_train_bytes"] == 13 * gb  # the state and generation's KV cache
    assert set(lines[0]) >= {"graphs", "graph_breaks", "recompile_limit_hits"}


def test_compile_counts_see_graphs_graph_breaks_and_the_recompile_limit():
    """Dynamo's own counters, read as differences: two static shapes compile a graph on each side of a graph break;
    the third shape hits the recompile limit of 2 (the function then runs eagerly)."""
    compiles = import_gpu_check("compiles")
    # dynamo's defaults past the limit (the function runs eagerly), whatever an earlier trainer in this process set
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=False):
        torch._dynamo.reset()

        @torch.compile(backend="eager", dynamic=False)
        def f(x):
            y = x * 2
            torch._dynamo.graph_break()
            return y + 1

        before = compiles.compile_counts()
        for n in (3, 4, 5):
            assert torch.equal(f(torch.ones(n)), torch.full((n,), 3.0))
        counted = compiles.counts_since(before)
    assert counted == {"graphs": 4, "graph_breaks": 2, "recompile_limit_hits": 1}


def test_a_rows_steps_show_what_compiled_on_batches_it_had_not_seen_and_the_peak_of_its_timed_steps():
    """A row's warm-up compiles its shapes; the timed steps on the same batch compile nothing; a step on a batch of
    new lengths compiles again where the region specialises on lengths (here: static shapes), which only steps on
    unseen batches can show. The allocator's peak covers the timed steps, not the warm-up's own allocations."""
    sweep = import_gpu_check("sweep")
    torch._dynamo.reset()

    @torch.compile(backend="eager", dynamic=False)
    def forward(x):
        return (x * 2).sum()

    memory, warm, mb = CudaMemory(), [True], 10**6

    def step(n: int) -> dict:
        extra = 500 * mb if warm else 0  # the first call's compilation workspace
        warm.clear()
        memory.allocate(n * mb + extra)
        memory.free(n * mb + extra)
        memory.retries += 1
        return {"loss": float(forward(torch.ones(n)))}

    out = sweep.measure_steps(step, 8, [16, 24], repeats=2, memory=memory)
    assert out["compiles"] == {
        "warmup": {"graphs": 1, "graph_breaks": 0, "recompile_limit_hits": 0},
        "timed": {"graphs": 0, "graph_breaks": 0, "recompile_limit_hits": 0},
        "fresh": {"graphs": 2, "graph_breaks": 0, "recompile_limit_hits": 0},
    }
    assert out["stats"] == {"loss": 16.0} and [s["loss"] for _, s in out["fresh"]] == [32.0, 48.0]
    assert len(out["steps_s"]) == 2 and out["step_s"] > 0 and all(seconds > 0 for seconds, _ in out["fresh"])
    assert out["peak_mb"] == 24  # the largest timed step's, not the warm-up's 508
    assert out["reserved_mb"] == 508 and out["device_used_mb"] == 1000 + 508  # cached blocks and the context
    assert out["alloc_retries"] == 4  # the timed steps': 2 on the seen batch, 2 on unseen ones
    on_a_cpu = sweep.measure_steps(step, 8, [8], repeats=1)
    assert on_a_cpu["peak_mb"] is None and on_a_cpu["alloc_retries"] is None


def test_each_new_trainer_of_the_sweep_starts_with_dynamos_caches_cleared(tiny_model_dir):
    """Rows on one trainer share its compiled graphs; a row that builds a new trainer (other kernels or attention)
    starts from cleared caches, so its graphs do not count against the recompile limit of the variants before it."""
    sweep, compiles = import_gpu_check("sweep"), import_gpu_check("compiles")
    ctx = {
        "model_dir": str(tiny_model_dir),
        "device": "cpu",
        "dtype": "float32",
        "max_tokens": 16,
        "seq_len": 512,
        "questions": 2,
        "group_size": 4,
    }
    cpu = torch.device("cpu")
    trainers = sweep.Trainers(load_model(ctx["model_dir"], cpu, Dist(), torch.float32), ctx, cpu, torch.float32)

    @torch.compile(backend="eager")
    def f(x):
        return x + 1

    def graphs_of_a_call() -> int:
        before = compiles.compile_counts()
        f(torch.ones(3))
        return compiles.counts_since(before)["graphs"]

    row = {"kernels": "eager", "attention": "sdpa", "micro_batch_tokens": 512, "activation_checkpointing": False}
    first = trainers.get(row)
    assert graphs_of_a_call() == 1 and graphs_of_a_call() == 0
    assert trainers.get({**row, "micro_batch_tokens": 256, "activation_checkpointing": True}) is first
    assert first.batching.micro_batch_tokens == 256 and graphs_of_a_call() == 0  # the same trainer: caches kept
    assert trainers.get({**row, "kernels": "compile"}) is not first
    assert graphs_of_a_call() == 1  # a new trainer: compiled again


def test_the_sweeps_rows_put_issue_41s_targets_first_and_the_20_gb_row_is_the_checkpointed_one():
    """At 0.6B on a GPU: the default row (8,192 tokens, no checkpointing), the checkpointed one, then 4,096 and 2,048
    tokens without; the memory plan puts the defaults far out of reach of 20 GB and the checkpointed row well within
    it (the smaller rows between: about 21 and 16 GB in tensors as written): why the checkpointed row is the 20 GB
    row, and the smaller ones its alternative."""
    sweep, plan = import_gpu_check("sweep"), import_gpu_check("plan")
    defaults = {"kernels": "compile", "attention": "flex"}
    ctx = {
        "model_dir": "Qwen/Qwen3-0.6B",
        "shape": "0.6b",
        "device": "cuda",
        "dtype": "bfloat16",
        "max_tokens": 256,
        "seq_len": 1024,
        "questions": 8,
        "group_size": 16,
    }
    samples = sweep.sweep_samples(ctx)
    step_tokens = count_unique_tokens(samples)  # 12,997: a budget of 16,384 holds the whole step
    rows = sweep.sweep_settings("cuda", defaults, 8192, step_tokens, "targets")
    assert [(r["role"], r["micro_batch_tokens"], r["activation_checkpointing"]) for r in rows] == [
        ("default", 8192, False),
        ("checkpointed", 8192, True),
        ("smaller", 4096, False),
        ("smaller", 2048, False),
    ]
    assert sweep.sweep_settings("cuda", defaults, 8192, step_tokens, "default") == rows[:1]
    rest = sweep.sweep_settings("cuda", defaults, 8192, step_tokens, "all")[4:]
    assert [(r["micro_batch_tokens"], r["activation_checkpointing"], r["role"]) for r in rest] == [
        (16384, False, None),
        (2048, True, None),
        (4096, True, None),
        (16384, True, None),
    ]
    longest = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    gb = {
        (r["micro_batch_tokens"], r["activation_checkpointing"]): plan.plan_figures(plan.train_config(ctx, r), longest)
        for r in rows
    }
    assert gb[8192, False]["plan_allocated_mb"] > 25e3 and gb[8192, True]["plan_peak_mb"] <= 16e3
    in_tensors = [gb[tokens, False]["plan_allocated_mb"] for tokens in (8192, 4096, 2048)]
    assert in_tensors == sorted(in_tensors, reverse=True)
    # fresh batches: other prompts and lengths than the warm-up's, the same shapes' distributions
    fresh = sweep.sweep_samples(ctx, 1)
    assert [len(s.completion_ids) for s in fresh] != [len(s.completion_ids) for s in samples]
    assert len(fresh) == len(samples) == 128


def test_a_missing_compiler_is_one_line_in_the_probe():
    probe = import_gpu_check("probe")
    with torch._inductor.config.patch({"cpp.cxx": (None, "/nonexistent/c++")}):
        got = probe.compile_smoke("cpu", cold=True)
    assert not got["ok"] and got["seconds"] is None and "\n" not in got["error"]
    assert "No working C++ compiler" in got["error"] and len(got["error"]) <= 300


def import_bench_trl():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return importlib.import_module("bench_trl")
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def test_the_peer_stage_reads_the_pair_bench_trl_reports(tmp_path, capsys):
    """a_peer's figures from the JSON bench_trl.py writes (its own report function): scirl's training half over TRL's;
    a side that failed is the stage's failure, with its last lines."""
    bench_trl, peer, common = import_bench_trl(), import_gpu_check("peer"), import_gpu_check("common")
    out = tmp_path / "bench_trl.json"
    args = SimpleNamespace(
        questions=8,
        group=16,
        tokens=256,
        shape="0.6b",
        hidden=256,
        layers=4,
        threads=1,
        rounds=1,
        steps=2,
        warmup=1,
        device="cuda",
        dtype="bfloat16",
        sampler="hf",
        gpu_memory_utilization=0.35,
        enforce_eager=False,
        against=None,
        json=str(out),
    )

    def step(seconds: float, generate: float) -> dict:
        return {
            "seconds": seconds,
            "generate": generate,
            "train": seconds - generate,
            "sync": 0.0,
            "completion_tokens": 32768,
            "cpu_seconds": seconds,
            "cpu_generate": generate,
        }

    runs = {"hf": {"scirl": [step(8.0, 6.0)], "trl": [step(12.0, 8.0)]}}
    assert bench_trl.write_report(args, runs, defaultdict(dict), [], final=True) == 0
    figures = peer.peer_figures(json.loads(out.read_text()))
    assert figures["train_half"] == pytest.approx(0.5) and figures["timed_steps"] == 1
    assert figures["ratios"]["train_s"] == pytest.approx(2.0) and figures["scirl"]["s_per_step"] == 8.0
    failed = [{"framework": "trl", "sampler": "hf", "error": "exit code 1", "completed": False, "last_lines": ["Boom"]}]
    runs["hf"]["trl"] = []
    assert bench_trl.write_report(args, runs, defaultdict(dict), failed, final=True) == 1
    with pytest.raises(common.StageError, match="trl failed \\(exit code 1\\)") as caught:
        peer.peer_figures(json.loads(out.read_text()))
    assert caught.value.log_tail == ["Boom"]


def gpu_row(sweep, ctx: dict, setting: dict, seconds: float, peak_gb: float, plan_gb: tuple[float, float]) -> dict:
    """A sweep row as a GPU fills it: ``measure_steps``' output shape with the allocator's figures, through the
    sweep's own ``row_figures``."""
    stats = {"forward_tokens": 13100, "unique_tokens": 12997, "loss_tokens": 11800, "padding_tokens": 103}
    none = {"graphs": 0, "graph_breaks": 0, "recompile_limit_hits": 0}
    measured = {
        "step_s": seconds,
        "steps_s": [seconds, seconds],
        "stats": stats,
        "fresh": [(seconds * 1.05, stats), (seconds * 0.95, stats)],
        "compiles": {"warmup": {**none, "graphs": 3}, "timed": none, "fresh": none},
        "peak_mb": peak_gb * 1e3,
        "reserved_mb": peak_gb * 1.05e3,
        "device_used_mb": peak_gb * 1.1e3 + 700,
        "alloc_retries": 0,
    }
    plan = {
        "plan_peak_mb": plan_gb[1] * 1e3,
        "plan_moment": "head's backward",
        "plan_allocated_mb": plan_gb[0] * 1e3,
        "plan_allocated_moment": "head's backward",
    }
    batches = [SimpleNamespace(packed=SimpleNamespace(forward_tokens=n)) for n in (8192, 4908)]
    return {**setting, **plan, **sweep.row_figures(ctx, plan, measured, batches)}


def test_a_gpu_sweeps_report_names_the_targets_and_the_20_gb_rows_cost(monkeypatch):
    """On a GPU the sweep's report ends with the targets at its shape: the default row's MFU against 25% at 0.6B, the
    20 GB row's allocator peak against 20 GB and its MFU as a share of the default row's, the smaller rows likewise."""
    sweep, figures, common = import_gpu_check("sweep"), import_gpu_check("figures"), import_gpu_check("common")
    ctx = {"dense_parameters": 440_000_000, "head_parameters": 155_582_464, "peak_tflops": 989.0}
    rows = sweep.sweep_settings("cuda", {"kernels": "compile", "attention": "flex"}, 8192, 12997, "targets")
    seconds_peak_plan = [
        (0.20, 26.0, (29.6, 33.1)),
        (0.25, 12.0, (12.7, 13.6)),
        (0.21, 19.0, (20.9, 23.1)),
        (0.22, 15.0, (16.5, 18.0)),
    ]
    measured = [gpu_row(sweep, ctx, row, *figures_of_row) for row, figures_of_row in zip(rows, seconds_peak_plan)]
    flops = 6 * 440_000_000 * 12997 + 6 * 155_582_464 * 11800
    assert measured[0]["mfu"] == pytest.approx(flops / 0.20 / 989e12)
    assert measured[0]["plan_allocated_over_peak"] == pytest.approx(29.6 / 26.0)
    assert measured[0]["plan_over_device"] == pytest.approx(33.1 / (26.0 * 1.1 + 0.7))
    assert measured[0]["fresh_step_s"] == pytest.approx(0.20) and measured[0]["fresh_mfu"] > 0
    batch = {
        "completions": 128,
        "unique_tokens": 12997,
        "prompt_mean": 225.0,
        "completion_mean": 92.0,
        "longest_row": 538,
    }
    result = {
        "settings": measured,
        "shape": "0.6b",
        "batch": batch,
        "fresh_batches": [batch, batch],
        "not_run": [],
        "profile": {
            "wall_s": 0.21,
            "gpu_busy_s": 0.19,
            "gpu_busy_share": 0.9,
            "setting": "compile kernels",
            "time": "GPU",
            "top_ops": [{"name": "aten::mm", "seconds": 0.1, "calls": 3}],
            "table": "t",
        },
    }
    out = io.StringIO()
    monkeypatch.setattr(common, "REPORT", out)
    figures.print_a_sweep(result, ctx)
    text = out.getvalue()
    assert f"targets at 0.6b: MFU {100 * measured[0]['mfu']:.1f}% with the default kernels at 8192 tokens" in text
    assert "target >= 25%" in text and "GPU busy 0.190s (90%)" in text
    assert "the 20 GB row (8192 tokens, checkpointing on): allocator peak 12.0 GB (within 20 GB)" in text
    assert "MFU" in text and "0.80x the default row's" in text  # 0.20 s against 0.25 s
    assert "smaller (4096 tokens, checkpointing off): allocator peak 19.0 GB (within 20 GB)" in text
    assert "default (8192 tokens, checkpointing off): allocator peak 26.0 GB (over 20 GB)" in text
    assert "    default compile flex   8192  off  no   2   13100  103  0.200" in text
    assert "  3/0/0   0  26.0  29.6" in text


def test_a_gpu_peers_report_says_the_training_half_against_its_target(monkeypatch):
    peer, figures, common = import_gpu_check("peer"), import_gpu_check("figures"), import_gpu_check("common")
    side = {"s_per_step": 8.0, "generate_s": 6.0, "train_s": 2.0, "peak_allocated_mb": 30000.0, "timed_steps": 1}
    report = {
        "config": {"device": "cuda", "dtype": "bfloat16", "questions": 8, "group": 16, "tokens": 256},
        "pairs": {
            "hf": {
                "results": {"scirl": side, "trl": {**side, "s_per_step": 12.0, "train_s": 5.0}},
                "ratios": {"s_per_step": 1.5, "train_s": 2.5},
                "errors": [],
            }
        },
    }
    out = io.StringIO()
    monkeypatch.setattr(common, "REPORT", out)
    figures.print_a_peer(peer.peer_figures(report))
    assert "scirl's training half 0.40x TRL's (target <= 0.5); its whole step 0.67x TRL's" in out.getvalue()
