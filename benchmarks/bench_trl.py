"""scirl vs TRL's GRPOTrainer: the same GRPO step, timed side by side, on CPU or on one CUDA GPU.

Both frameworks get the same local Qwen3 model, the same 8 chat-templated questions, the same
thread count, and do the same work per step: 8 questions x 16 completions = 128 completions of
exactly 256 tokens (EOS held back: scirl's ``min_tokens``; TRL's ``min_new_tokens`` through
transformers, ``min_tokens`` through vLLM), reward = scirl's lenient answer check, advantage =
reward - group mean (TRL: ``scale_rewards="none"``), no KL/reference model (TRL: ``beta=0``), no
gradient checkpointing, micro-batches of at most 32 completions with gradient accumulation to one AdamW step
(TRL: 32 a micro-batch; scirl: its packed rows, each group's prompt once, within its default budget of 8,192
tokens and at most 32 completions: ``--micro-batch-tokens`` changes the budget).

CPU (``--device cpu``, the default): a tiny model (hidden 256, 4 layers), fp32, both frameworks
sampling through transformers. CUDA (``--device cuda``): a random-init model with a Qwen3 release's
shapes (``--shape``, default 0.6b; ``gpu_check.build_model``), bf16 compute over fp32 weights, and
two pairs (``--sampler both``): both frameworks sampling through transformers, then both through an
in-process vLLM engine beside the trainer (scirl: ``inference.backend = "vllm"``, the engine asleep
during the train step and given the new weights after it; TRL: ``use_vllm=True``,
``vllm_mode="colocate"``, ``vllm_enable_sleep_mode=True``), with the same share of the GPU.

The scirl side calls ``scirl.run.train.one_step``, the very step function ``scirl train`` loops
over, with the generator and trainer ``scirl.run.backends`` builds (on the transformers sampler the
sampler shares the trained module; the vLLM engine is built first, as ``scirl train`` does) and the
colocated source and sink ``scirl.run.setup`` wires; only the run-directory logging and checkpoints
are left out. Each framework and sampler runs in a process of its own, one after the other (so GPU
memory and its peaks do not mix); a side that fails is reported with its last lines and the others
still run. The first ``--warmup`` steps are not timed; ``--rounds`` runs every side again, the order
reversed every other round, so a change in the machine's load hits them alike.

``--against REV`` adds a third side: scirl's step as another revision of this repository has it, that
revision's own copy of this script (``--only scirl``) run from a ``git worktree`` of it, with the same
settings and model, in the same run: today's step beside an older one's.

    pip install trl   # the benchmark's extra dependency; it keeps the installed torch
    python benchmarks/bench_trl.py --steps 3 --threads 1 [--rounds 2] [--against REV]
    python benchmarks/bench_trl.py --device cuda --steps 3 --json out.json   # one GPU, trl + vllm installed
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from gpu_check import SHAPES, DeviceMemoryPeak, build_model  # a sibling package: benchmarks/ is on sys.path
from sides import against_tree  # noqa: E402  (likewise)

REPO = Path(__file__).resolve().parents[1]

# scirl's default seq_len, which its engine takes as max_model_len; TRL's engine gets the same
MAX_MODEL_LEN = 4096
# both frameworks' engines get the same environment: vLLM's own PyTorch sampler (FlashInfer's needs the
# package, often absent offline), its logs on stderr at WARNING (stdout is discarded), no usage report
VLLM_ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
TAIL_LINES = 30  # of a failed side's stderr, shown and kept in the JSON


def build_inputs(work: Path, args) -> tuple[Path, list]:
    """The benchmark model (built once, reused) and the questions."""
    from scirl.synth.questions import generate_rows
    from scirl.synth.tiny_model import build_tiny_model
    from scirl.task.data import question_from_row

    if args.shape:
        # on the host: the parent process stays off the GPU, whose used memory is sampled per side
        model_dir = build_model(args.shape, work / f"model-{args.shape}-{args.dtype}", "cpu", args.dtype)
    else:
        model_dir = work / f"model-h{args.hidden}-l{args.layers}"
        if not (model_dir / "config.json").exists():
            build_tiny_model(
                model_dir,
                hidden_size=args.hidden,
                num_layers=args.layers,
                num_heads=args.hidden // 64,
                num_kv_heads=max(args.hidden // 128, 1),
            )
    rows = generate_rows(n_per_domain=max(args.questions, 4), seed=0, non_mcq=False)
    questions = [question_from_row(row, source=f"bench:{i}") for i, row in enumerate(rows)][: args.questions]
    return model_dir, questions


def peak_allocated_mb() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_initialized() else None


def run_scirl(model_dir: Path, questions: list, args) -> dict:
    import torch

    from scirl import algorithms
    from scirl.cpu.host_memory import keep_freed_memory
    from scirl.distributed import Dist, setup
    from scirl.inference.base import encode_messages
    from scirl.rollouts.contract import PromptedQuestion
    from scirl.rollouts.sampler import QuestionSampler
    from scirl.rollouts.source import ColocatedSource
    from scirl.run.backends import make_generator, make_trainer, make_vllm_generator
    from scirl.run.config import TrainConfig
    from scirl.run.setup import load_tokenizer
    from scirl.run.train import one_step
    from scirl.task.prompt import build_messages, render_prompt
    from scirl.trainer.model import compute_dtype, load_model
    from scirl.weights.check import WeightCheck
    from scirl.weights.inprocess import InProcessSink

    vllm = args.sampler == "vllm"
    # the engine as `scirl train --inference.backend vllm` sets it up: seq_len (MAX_MODEL_LEN) as its
    # max_model_len, on a GPU asleep (level 2) during each train step
    engine = (
        {
            "inference": {
                "backend": "vllm",
                "gpu_memory_utilization": args.gpu_memory_utilization,
                "enforce_eager": args.enforce_eager,
            }
        }
        if vllm
        else {}
    )
    budget = {"micro_batch_tokens": args.micro_batch_tokens} if args.micro_batch_tokens else {}
    cfg = TrainConfig(
        model=str(model_dir),
        batch_size=args.questions * args.group,
        group_size=args.group,
        micro_batch_size=args.micro_batch,
        max_completion_tokens=args.tokens,
        device=args.device,
        dtype=args.dtype,
        reward={"mode": "lenient"},
        optim={"lr": args.lr},
        filters={"zero_advantage": {"enforce": False}},
        **budget,
        **engine,
    )
    assert cfg.seq_len == MAX_MODEL_LEN
    dist, device = (Dist(), torch.device("cpu")) if args.device == "cpu" else setup(args.device)
    dtype = compute_dtype(cfg.dtype, device)
    if device.type == "cpu":
        keep_freed_memory()  # what `scirl train` does on a CPU
    tokenizer = load_tokenizer(cfg.model)
    # first, as `scirl train` does: vLLM sizes its memory from what is free when it starts
    generator = make_vllm_generator(cfg, cfg.model, tokenizer, device=device, dist=dist, dtype=dtype) if vllm else None
    model = load_model(cfg.model, device, dist, dtype, cfg.activation_checkpointing)
    trainer = make_trainer(model, cfg, algorithms.build(cfg), device=device, dist=dist, dtype=dtype)
    generator = generator or make_generator(trainer, cfg.model, tokenizer)
    batch = [
        PromptedQuestion(q, encode_messages(tokenizer, build_messages(q)), render_prompt(tokenizer, build_messages(q)))
        for q in questions
    ]
    # the benchmark's only addition to a training step: fixed-length completions (EOS held back)
    plain_generate, cpu_generate = generator.generate, []

    def fixed_length_generate(prompts, params):
        cpu = time.process_time()
        out = plain_generate(prompts, dataclasses.replace(params, min_tokens=args.tokens))
        cpu_generate.append(time.process_time() - cpu)
        return out

    generator.generate = fixed_length_generate
    # every step all 8 questions (one epoch each). The transformers sampler shares the module: nothing to push;
    # the vLLM engine sleeps in make_room and takes the new weights in push
    source = ColocatedSource(
        batch,
        QuestionSampler(len(batch), cfg.seed),
        generator,
        cfg.rollout_settings(),
        vocab_size=model.config.vocab_size,
        dist=dist,
    )
    sink = InProcessSink(generator, trainer, WeightCheck(trainer, (batch[0].prompt_ids, 1), interval=0))
    steps = []
    for step in range(1, args.steps + 1):
        t0, cpu0 = time.perf_counter(), time.process_time()
        result = one_step(step, source, trainer, sink)
        t1, cpu1 = time.perf_counter(), time.process_time()
        m = result.metrics
        tokens = sum(r["num_tokens"] for r in result.rollouts)
        assert result.stats["stepped"] and m["trainable/total"] == args.questions * args.group
        assert tokens == args.questions * args.group * args.tokens, f"scirl completions were not {args.tokens} long"
        steps.append(
            {
                "seconds": t1 - t0,
                "generate": m["time/generate"],
                "train": m["time/train"] + m["time/weight_sync"],
                "sync": m["time/weight_sync"],
                "completion_tokens": tokens,
                "cpu_seconds": cpu1 - cpu0,
                "cpu_generate": cpu_generate[-1],
                **{
                    key: m[f"train/{key}"]
                    for key in ("forward_tokens", "unique_tokens", "loss_tokens", "padding_tokens")
                },
            }
        )
        print(
            f"scirl ({args.sampler}) step {step}: {t1 - t0:.1f}s (generate {m['time/generate']:.1f}s, train "
            f"{m['time/train']:.1f}s, weight sync {m['time/weight_sync']:.1f}s), {tokens} tokens",
            file=sys.stderr,
            flush=True,
        )
    result = {
        "framework": "scirl",
        "sampler": args.sampler,
        "steps": steps,
        "training_batches": trainer.describe_batching(),
        "generator": type(generator).__name__,
        "peak_allocated_mb": peak_allocated_mb(),
    }
    if hasattr(generator, "close"):
        generator.close()
    return result


def time_calls(obj, name: str, totals: dict, key: str, busy: list) -> None:
    """Replace ``obj.name`` (on the instance) with a wrapper that adds its wall (and CPU) seconds to
    ``totals[key]``; calls made while another timed call runs (``busy``) are not counted again."""
    plain = getattr(obj, name)

    @functools.wraps(plain)
    def timed(*a, **kw):
        if busy:
            return plain(*a, **kw)
        busy.append(key)
        t, cpu = time.perf_counter(), time.process_time()
        try:
            return plain(*a, **kw)
        finally:
            totals[key] += time.perf_counter() - t
            totals[f"cpu_{key}"] += time.process_time() - cpu
            busy.pop()

    setattr(obj, name, timed)


def run_trl(model_dir: Path, questions: list, args) -> dict:
    vllm = args.sampler == "vllm"
    for key, value in VLLM_ENV.items():  # before TRL imports vLLM (the parent sets them too)
        os.environ.setdefault(key, value)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from scirl.task.prompt import build_messages, render_prompt
    from scirl.task.reward import score

    if vllm and args.enforce_eager:
        # TRL's colocated engine has no enforce_eager setting: added to the LLM(...) call TRL makes. (Its dtype is
        # the checkpoint's, written in --dtype: scirl's engine's on a GPU; vLLM's CPU platform makes float32 bf16.)
        import trl.generation.vllm_generation as trl_vllm

        trl_vllm.LLM = functools.partial(trl_vllm.LLM, enforce_eager=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # the same prompt text scirl tokenizes; TRL tokenizes a plain-string prompt as is
    dataset = Dataset.from_list(
        [{"prompt": render_prompt(tokenizer, build_messages(q)), "qi": i} for i, q in enumerate(questions)]
    )

    def reward(prompts, completions, qi, **kwargs):
        return [score(c, questions[i], "lenient").reward for c, i in zip(completions, qi)]

    per_step = args.questions * args.group
    # colocated vLLM with the engine's share of scirl's, asleep (level 2, as scirl's) outside generation; TRL's
    # other vLLM defaults stay (the importance-sampling correction's extra no-grad forward over the batch included)
    engine = (
        dict(
            use_vllm=True,
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=args.gpu_memory_utilization,
            vllm_enable_sleep_mode=args.device == "cuda",
            vllm_max_model_length=MAX_MODEL_LEN,
        )
        if vllm
        else {}
    )
    config = GRPOConfig(
        output_dir=str(Path(args.work) / f"trl-out-{args.sampler}"),
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=per_step // args.micro_batch,  # one generation of 128 per optimizer step
        num_generations=args.group,
        max_completion_length=args.tokens,
        # passed to transformers' generate, or as they are into vLLM's SamplingParams
        generation_kwargs={"min_tokens" if vllm else "min_new_tokens": args.tokens},
        temperature=1.0,
        top_p=1.0,
        beta=0.0,
        scale_rewards="none",
        learning_rate=args.lr,
        max_grad_norm=1.0,
        max_steps=args.steps,
        gradient_checkpointing=False,
        bf16=args.dtype == "bfloat16",  # TRL's bf16 mixed precision (autocast) over fp32 weights
        use_cpu=args.device == "cpu",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        disable_tqdm=True,
        **engine,
    )
    steps: list[dict] = []

    class Timer(TrainerCallback):
        def __init__(self):
            self.totals = collections.defaultdict(float)  # seconds per timed call kind, this step

        def on_step_begin(self, *_, **__):
            self.start, self.cpu_start = time.perf_counter(), time.process_time()
            self.totals.clear()

        def on_step_end(self, *_, **__):
            seconds, t = time.perf_counter() - self.start, self.totals
            steps.append(
                {
                    "seconds": seconds,
                    "generate": t["generate"],
                    "train": seconds - t["generate"],
                    "sync": t["sync"],
                    "cpu_seconds": time.process_time() - self.cpu_start,
                    "cpu_generate": t["cpu_generate"],
                }
            )
            print(
                f"trl ({args.sampler}) step {len(steps)}: {seconds:.1f}s (generate {t['generate']:.1f}s"
                + (f", weight sync {t['sync']:.1f}s)" if vllm else ")"),
                file=sys.stderr,
                flush=True,
            )

    timer = Timer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    busy: list = []
    if vllm:
        # vLLM warns once per tensor per step that TRL pushes float32 weights into a bf16 engine: expected, dropped
        for handler in logging.getLogger("vllm").handlers:
            handler.addFilter(lambda record: not record.getMessage().startswith("Attempted to load weight"))
        # generation: the engine's own generate call, as model.generate below; TRL's weight load and the
        # engine's sleep and wake-ups count as weight sync (scirl's time/weight_sync holds the same)
        backend = trainer.vllm_generation
        time_calls(backend.llm, "generate", timer.totals, "generate", busy)
        for obj, name in ((backend, "sync_weights"), (backend.llm, "sleep"), (backend.llm, "wake_up")):
            time_calls(obj, name, timer.totals, "sync", busy)
    else:
        time_calls(trainer.model, "generate", timer.totals, "generate", busy)
    trainer.train()
    lengths = [row["completions/mean_length"] for row in trainer.state.log_history if "completions/mean_length" in row]
    assert lengths and all(abs(x - args.tokens) < 1e-6 for x in lengths), (
        f"TRL completions were not {args.tokens} long: {lengths}"
    )
    for s, mean_length in zip(steps, lengths):
        s["completion_tokens"] = round(mean_length * per_step)
    return {"framework": "trl", "sampler": args.sampler, "steps": steps, "peak_allocated_mb": peak_allocated_mb()}


def summarize(timed: list[dict]) -> dict:
    if not timed:
        raise SystemExit("no timed steps: --steps must exceed --warmup")
    seconds = sum(s["seconds"] for s in timed) / len(timed)
    tokens = sum(s["completion_tokens"] for s in timed) / len(timed)
    return {
        "s_per_step": seconds,
        "s_per_step_median": statistics.median(s["seconds"] for s in timed),  # a neighbour's burst moves it less
        "generate_s": sum(s["generate"] for s in timed) / len(timed),
        "train_s": sum(s["train"] for s in timed) / len(timed),
        "sync_s": sum(s.get("sync", 0.0) for s in timed) / len(timed),
        "tokens_per_s": tokens / seconds,
        "cpu_s_per_step": sum(s["cpu_seconds"] for s in timed) / len(timed),
        "cpu_generate_s": sum(s["cpu_generate"] for s in timed) / len(timed),
        "timed_steps": len(timed),
    }


@dataclasses.dataclass(frozen=True)
class Side:
    """A column of the tables: ``framework`` (what ``--only`` runs) from ``source``, a tree of this repository (this
    one, or another revision's worktree: its own copy of this script and its own scirl)."""

    name: str
    framework: str
    source: Path = REPO


def run_side(side: Side, sampler: str, settings: list, env: dict, args) -> tuple[dict | None, dict | None]:
    """One side with one sampler in a fresh process: (its result, or None; its error, or None)."""
    result_path = Path(args.work) / f"result-{sampler}-{side.name}.json"
    result_path.unlink(missing_ok=True)
    script = side.source / "benchmarks" / "bench_trl.py"
    cmd = [
        sys.executable,
        script,
        *map(str, settings),
        "--sampler",
        sampler,
        "--only",
        side.framework,
        "--result",
        result_path,
    ]
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(side.source), env.get("PYTHONPATH")]))}
    tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
    timed_out = False
    # on a GPU the device's used memory (vLLM's pools included, which torch's statistics miss), sampled meanwhile
    with DeviceMemoryPeak() if args.device == "cuda" else contextlib.nullcontext() as device_peak:
        # its own process group, so that a side past --side-timeout-s is stopped with every process it started
        proc = subprocess.Popen(
            list(map(str, cmd)),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
        )

        def echo():  # shown as it comes; the last lines kept for a failure's report
            for line in proc.stderr:
                sys.stderr.write(line)
                tail.append(line.rstrip("\n"))

        def stop_group():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        reader = threading.Thread(target=echo, daemon=True)
        reader.start()
        try:
            returncode = proc.wait(timeout=args.side_timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_group()
            returncode = proc.wait()
        finally:
            if proc.poll() is None:  # interrupted: take its process group down with us
                stop_group()
        reader.join(timeout=10)
        stop_group()  # what it left behind (a compile worker, say) would hold its stderr and GPU memory
    result = json.loads(result_path.read_text()) if result_path.exists() else None
    if result is not None:
        result["device_peak_mb"] = getattr(device_peak, "peak_mb", None)
    if returncode == 0 and result is not None:
        return result, None
    why = f"timed out after {args.side_timeout_s:g}s" if timed_out else f"exit code {returncode}"
    error = {
        "framework": side.name,
        "sampler": sampler,
        "error": why,
        "completed": result is not None,
        "last_lines": list(tail),
    }
    print(
        f"\n{side.name} ({sampler} sampler) FAILED: {why}; its last lines:\n  " + "\n  ".join(tail) + "\n",
        file=sys.stderr,
        flush=True,
    )
    return result, error


def ratio(a, b):
    return a / b if a and b else None


RATIO_KEYS = (
    "s_per_step",
    "s_per_step_median",
    "generate_s",
    "train_s",
    "sync_s",
    "tokens_per_s",
    "cpu_s_per_step",
    "peak_allocated_mb",
    "device_peak_mb",
)


def pair_ratios(s: dict, over: str = "trl", under: str = "scirl") -> dict:
    """``over`` / ``under`` of every figure (by default TRL / scirl: above 1, TRL takes longer, or more memory)."""
    return {k: ratio(s[over].get(k), s[under].get(k)) for k in RATIO_KEYS} if s.get(over) and s.get(under) else {}


def print_cpu_pair(summaries: dict, header: str) -> None:
    print(header)
    print(f"{'':16}{'s/step':>10}{'generate s':>12}{'train s':>10}{'tokens/s':>10}{'CPU s/step':>12}{'CPU gen s':>11}")
    for name, s in summaries.items():
        if s is None:
            print(f"{name:16}  failed (see above)")
            continue
        print(
            f"{name:16}{s['s_per_step']:10.1f}{s['generate_s']:12.1f}{s['train_s']:10.1f}{s['tokens_per_s']:10.0f}"
            f"{s['cpu_s_per_step']:12.1f}{s['cpu_generate_s']:11.1f}"
        )
    r = pair_ratios(summaries)
    if r:
        # on a shared machine wall time swings with the neighbours' load; process CPU time much less
        print(
            f"\nscirl / TRL speed: {r['s_per_step']:.2f}x wall time, {r['cpu_s_per_step']:.2f}x CPU time, "
            f"{r['s_per_step_median']:.2f}x median wall time per step (goal >= 2x)"
        )


def print_gpu_pair(summaries: dict, header: str) -> None:
    def cell(value, width, digits):
        return f"{value:{width}.{digits}f}" if value is not None else f"{'n/a':>{width}}"

    print(header)
    print(
        f"{'':16}{'s/step':>8}{'generate s':>12}{'train s':>9}{'(sync s)':>10}{'tokens/s':>10}{'peak alloc MB':>15}"
        f"{'device MB':>11}"
    )
    rows = [(name, s, (2, 2, 2, 2, 0, 0, 0)) for name, s in summaries.items()] + [
        ("TRL/scirl", pair_ratios(summaries) or None, (2, 2, 2, 2, 2, 2, 2))
    ]
    for name, s, d in rows:
        if s is None:
            print(f"{name:16}  " + ("failed (see above)" if name != "TRL/scirl" else "n/a: a side failed"))
            continue
        keys = ("s_per_step", "generate_s", "train_s", "sync_s", "tokens_per_s", "peak_allocated_mb", "device_peak_mb")
        widths = (8, 12, 9, 10, 10, 15, 11)
        print(f"{name:16}" + "".join(cell(s.get(k), w, p) for k, w, p in zip(keys, widths, d)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where both frameworks run")
    parser.add_argument(
        "--sampler",
        choices=["hf", "vllm", "both"],
        default=None,
        help="hf: both sample through transformers; vllm: both through an in-process vLLM engine beside "
        "the trainer; both: one pair, then the other (default: hf on cpu, both on cuda)",
    )
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=None,
        help="a random-init model with this Qwen3 release's shapes (default: 0.6b on cuda; on cpu the "
        "tiny model of --hidden and --layers)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.35,
        help="vLLM's share of the GPU beside the trainer, the same in both frameworks",
    )
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM without CUDA graphs, in both frameworks")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per framework and round")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the figures")
    parser.add_argument("--rounds", type=int, default=1, help="run scirl then TRL this many times, alternating")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, the same for both")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256, help="completion length (forced)")
    parser.add_argument("--micro-batch", type=int, default=32, help="completions a micro-batch (scirl: at most)")
    parser.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=None,
        help="scirl's micro-batch token budget (default: scirl's, 8192; not passed to --against's side)",
    )
    parser.add_argument(
        "--against",
        metavar="REV",
        default=None,
        help="also run scirl's side as revision REV of this repository has it (a git worktree of it)",
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="compute dtype of both frameworks, over float32 master weights (scirl: a bf16 compute "
        "copy, as FSDP's mixed precision; TRL: autocast); default float32 on cpu, bfloat16 on cuda",
    )
    parser.add_argument(
        "--side-timeout-s",
        type=float,
        default=300,
        help="stop a framework's process after this long and go on with the others",
    )
    parser.add_argument("--work", default=None, help="directory for the model and TRL's output (default: a temp dir)")
    parser.add_argument("--only", choices=["scirl", "trl"], help="run one framework in this process (used internally)")
    parser.add_argument("--result", default=None, help="with --only: also write the result here (used internally)")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    args.sampler = args.sampler or ("both" if cuda else "hf")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.shape = args.shape or ("0.6b" if cuda else None)
    if (args.questions * args.group) % args.micro_batch:
        parser.error("--micro-batch must divide questions x group")
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    if not 0 < args.gpu_memory_utilization <= 1:
        parser.error("--gpu-memory-utilization must be in (0, 1]")

    if args.only:
        import torch

        if args.sampler == "both":
            parser.error("--only runs one sampler: hf or vllm")
        torch.set_num_threads(args.threads)
        torch.manual_seed(0)
        model_dir, questions = build_inputs(Path(args.work), args)
        result = (run_scirl if args.only == "scirl" else run_trl)(model_dir, questions, args)
        if args.result:
            Path(args.result).write_text(json.dumps(result))
        print(json.dumps(result), flush=True)
        if args.sampler == "vllm":
            sys.stderr.flush()
            os._exit(0)  # an in-process engine's threads can hold up the interpreter's exit; the result is out
        return 0

    samplers = ["hf", "vllm"] if args.sampler == "both" else [args.sampler]
    with (
        tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp,
        against_tree(args.against, Path(tmp), "bench_trl") as against,
    ):
        args.work = args.work or tmp
        Path(args.work).mkdir(parents=True, exist_ok=True)
        build_inputs(Path(args.work), args)  # once, outside the timed runs: every side reuses the model
        env = dict(
            os.environ,
            OMP_NUM_THREADS=str(args.threads),
            MKL_NUM_THREADS=str(args.threads),
            TOKENIZERS_PARALLELISM="false",
        )
        settings = [
            "--steps",
            args.steps,
            "--threads",
            args.threads,
            "--questions",
            args.questions,
            "--group",
            args.group,
            "--tokens",
            args.tokens,
            "--micro-batch",
            args.micro_batch,
            "--hidden",
            args.hidden,
            "--layers",
            args.layers,
            "--lr",
            args.lr,
            "--dtype",
            args.dtype,
            "--work",
            args.work,
            "--device",
            args.device,
            "--gpu-memory-utilization",
            args.gpu_memory_utilization,
        ]
        settings += (["--shape", args.shape] if args.shape else []) + (
            ["--enforce-eager"] if args.enforce_eager else []
        )
        sides = [Side("scirl", "scirl"), Side("trl", "trl")]
        if against is not None:
            sides.insert(1, Side(f"scirl@{args.against}", "scirl", against))
        own = ["--micro-batch-tokens", args.micro_batch_tokens] if args.micro_batch_tokens else []  # this tree's flag
        runs = {sampler: {side.name: [] for side in sides} for sampler in samplers}
        errors: list[dict] = []
        peaks: dict = collections.defaultdict(dict)
        report = functools.partial(write_report, args, runs, peaks, errors)
        # every side in turn, the order reversed every other round, so a change in the machine's load hits them alike
        for round_ in range(args.rounds):
            for sampler in samplers:
                side_env = {**VLLM_ENV, **env} if sampler == "vllm" else env
                for side in sides if round_ % 2 == 0 else sides[::-1]:
                    result, error = run_side(
                        side, sampler, settings + (own if side.source == REPO else []), side_env, args
                    )
                    if result is not None:
                        runs[sampler][side.name] += result["steps"][args.warmup :]
                        for key in ("peak_allocated_mb", "device_peak_mb"):
                            if result.get(key) is not None:
                                peaks[(sampler, side.name)][key] = max(
                                    result[key], peaks[(sampler, side.name)].get(key, 0)
                                )
                    if error is not None:
                        errors.append(error)
                    report(final=False)  # after each side: a run cut short keeps what it measured
        return report(final=True)


def write_report(args, runs: dict, peaks: dict, errors: list, final: bool) -> int:
    """The tables (when ``final``) and the JSON file; exit status 1 when a side failed."""
    pairs = {}
    for sampler, steps in runs.items():
        summaries = {
            name: ({**summarize(timed), **peaks[(sampler, name)]} if timed else None) for name, timed in steps.items()
        }
        pairs[sampler] = {
            "results": summaries,
            "ratios": pair_ratios(summaries),
            "errors": [e for e in errors if e["sampler"] == sampler],
        }
        if args.against:  # this tree's scirl against the other revision's: above 1, the other revision takes longer
            pairs[sampler]["against_ratios"] = pair_ratios(summaries, f"scirl@{args.against}", "scirl")
    if final:
        per_step = args.questions * args.group
        model = f"{args.shape} shapes" if args.shape else f"model hidden {args.hidden} x {args.layers} layers"
        for sampler, pair in pairs.items():
            s = pair["results"]
            timed = next((x["timed_steps"] for x in s.values() if x), 0)
            header = (
                f"\n{args.questions} questions x {args.group} = {per_step} completions x {args.tokens} tokens per "
                f"step, {model}, {args.threads} thread(s), {timed} timed step(s) each over {args.rounds} round(s)\n"
            )
            if args.device == "cpu":
                print_cpu_pair(s, header if sampler == "hf" else header.replace("\n", "\n[vLLM sampler] ", 1))
            else:
                engine = (
                    f", vLLM colocated at {args.gpu_memory_utilization:g} of the GPU"
                    f"{', eager' if args.enforce_eager else ''}"
                    if sampler == "vllm"
                    else ""
                )
                print_gpu_pair(
                    s,
                    f"\n{'vLLM' if sampler == 'vllm' else 'transformers'} sampler, {args.dtype}{engine}: "
                    + header.lstrip("\n"),
                )
            if pair.get("against_ratios"):
                r = {k: f"{v:.2f}x" if v is not None else "n/a" for k, v in pair["against_ratios"].items()}
                print(
                    f"scirl@{args.against} / scirl (this tree): train {r['train_s']}, step {r['s_per_step']} "
                    f"(median {r['s_per_step_median']}), CPU time {r['cpu_s_per_step']} (above 1: this tree is faster)"
                )
        for e in errors:
            print(f"FAILED: {e['framework']} ({e['sampler']} sampler): {e['error']}")
    if args.json:
        out = {
            "config": {k: v for k, v in vars(args).items() if k != "work"},
            "pairs": pairs,
            "errors": errors,
            "complete": final,
        }
        hf = pairs.get("hf", {}).get("ratios")
        if args.device == "cpu" and hf:  # the keys this file has always had
            out.update(
                results=pairs["hf"]["results"],
                ratio=hf["s_per_step"],
                cpu_ratio=hf["cpu_s_per_step"],
                median_ratio=hf["s_per_step_median"],
            )
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
