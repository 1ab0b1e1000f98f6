"""scirl vs TRL's GRPOTrainer: the same GRPO step, timed side by side on CPU.

Both frameworks get the same tiny local Qwen3 model, the same 8 chat-templated
questions, the same thread count, and do the same work per step: 8 questions x 16
completions = 128 completions of exactly 256 tokens (EOS held back: scirl's
``min_tokens``, TRL's ``min_new_tokens``), reward = scirl's lenient answer check,
advantage = reward - group mean (TRL: ``scale_rewards="none"``), no KL/reference
model (TRL: ``beta=0``), fp32, no gradient checkpointing, micro-batches of 32 with
gradient accumulation to one AdamW step.

The scirl side calls ``scirl.run.train.one_step``, the very step function ``scirl train`` loops
over, with the generator and trainer ``scirl.run.backends`` builds for a CPU run (the sampler
shares the trained module) and the colocated source and sink ``scirl.run.setup`` wires; only the
run-directory logging and checkpoints are left out. Each framework runs in its own
subprocess, one after the other. The first ``--warmup`` steps are not timed.

    pip install trl   # the benchmark's extra dependency; it keeps the installed torch
    python benchmarks/bench_trl.py --steps 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build_inputs(work: Path, args) -> tuple[Path, list]:
    """The benchmark model (built once, reused) and the questions."""
    from scirl.task.data import question_from_row
    from scirl.synth.questions import generate_rows
    from scirl.synth.tiny_model import build_tiny_model

    model_dir = work / f"model-h{args.hidden}-l{args.layers}"
    if not (model_dir / "config.json").exists():
        build_tiny_model(model_dir, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.hidden // 64,
                         num_kv_heads=max(args.hidden // 128, 1))
    rows = generate_rows(n_per_domain=max(args.questions, 4), seed=0, non_mcq=False)
    questions = [question_from_row(row, source=f"bench:{i}") for i, row in enumerate(rows)][: args.questions]
    return model_dir, questions


def run_scirl(model_dir: Path, questions: list, args) -> dict:
    import dataclasses

    import torch

    from scirl import algorithms
    from scirl.run.backends import make_generator, make_trainer
    from scirl.run.config import TrainConfig
    from scirl.cpu.host_memory import keep_freed_memory
    from scirl.distributed import Dist
    from scirl.inference.base import encode_messages
    from scirl.task.prompt import build_messages, render_prompt
    from scirl.rollouts.contract import PromptedQuestion
    from scirl.rollouts.sampler import QuestionSampler
    from scirl.rollouts.source import ColocatedSource
    from scirl.run.setup import load_tokenizer
    from scirl.run.train import one_step
    from scirl.trainer.model import compute_dtype, load_model
    from scirl.weights.check import WeightCheck
    from scirl.weights.inprocess import InProcessSink

    cfg = TrainConfig(model=str(model_dir), batch_size=args.questions * args.group, group_size=args.group,
                      micro_batch_size=args.micro_batch, max_completion_tokens=args.tokens, device="cpu", dtype=args.dtype,
                      reward={"mode": "lenient"}, optim={"lr": args.lr},
                      filters={"zero_advantage": {"enforce": False}})
    dist, device = Dist(), torch.device("cpu")
    dtype = compute_dtype(cfg.dtype, device)
    keep_freed_memory()  # what `scirl train` does on a CPU
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, device, dist, dtype, cfg.activation_checkpointing)
    trainer = make_trainer(model, cfg, algorithms.build(cfg), device=device, dist=dist, dtype=dtype)
    generator = make_generator(trainer, cfg.model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else generator.eos_ids[0]
    batch = [PromptedQuestion(q, encode_messages(tokenizer, build_messages(q)), render_prompt(tokenizer, build_messages(q)))
             for q in questions]
    # the benchmark's only addition to a training step: fixed-length completions (EOS held back)
    plain_generate, cpu_generate = generator.generate, []

    def fixed_length_generate(prompts, params):
        cpu = time.process_time()
        out = plain_generate(prompts, dataclasses.replace(params, min_tokens=args.tokens))
        cpu_generate.append(time.process_time() - cpu)
        return out

    generator.generate = fixed_length_generate
    # every step all 8 questions (one epoch each); the sampler shares the module, so nothing to push or check
    source = ColocatedSource(batch, QuestionSampler(len(batch), cfg.seed), generator, cfg.rollout_settings(),
                             vocab_size=model.config.vocab_size, dist=dist)
    sink = InProcessSink(generator, trainer, WeightCheck(trainer, (batch[0].prompt_ids, 1), interval=0))
    steps = []
    for step in range(1, args.steps + 1):
        t0, cpu0 = time.perf_counter(), time.process_time()
        result = one_step(step, source, trainer, sink, micro_batch_size=cfg.micro_batch_size, pad_id=pad_id)
        t1, cpu1 = time.perf_counter(), time.process_time()
        m = result.metrics
        tokens = sum(r["num_tokens"] for r in result.rollouts)
        assert result.stats["stepped"] and m["trainable/total"] == args.questions * args.group
        steps.append({"seconds": t1 - t0, "generate": m["time/generate"], "train": m["time/train"] + m["time/weight_sync"],
                      "completion_tokens": tokens, "cpu_seconds": cpu1 - cpu0, "cpu_generate": cpu_generate[-1]})
        print(f"scirl step {step}: {t1 - t0:.1f}s (generate {m['time/generate']:.1f}s, train {m['time/train']:.1f}s), "
              f"{tokens} tokens", file=sys.stderr, flush=True)
    return {"framework": "scirl", "steps": steps, "training_batches": type(trainer).__name__}


def run_trl(model_dir: Path, questions: list, args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from scirl.task.prompt import build_messages, render_prompt
    from scirl.task.reward import score

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # the same prompt text scirl tokenizes; TRL tokenizes a plain-string prompt as is
    dataset = Dataset.from_list([{"prompt": render_prompt(tokenizer, build_messages(q)), "qi": i} for i, q in enumerate(questions)])

    def reward(prompts, completions, qi, **kwargs):
        return [score(c, questions[i], "lenient").reward for c, i in zip(completions, qi)]

    per_step = args.questions * args.group
    config = GRPOConfig(
        output_dir=str(Path(args.work) / "trl-out"),
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=per_step // args.micro_batch,  # one generation of 128 per optimizer step
        num_generations=args.group,
        max_completion_length=args.tokens,
        generation_kwargs={"min_new_tokens": args.tokens},
        temperature=1.0,
        top_p=1.0,
        beta=0.0,
        scale_rewards="none",
        learning_rate=args.lr,
        max_grad_norm=1.0,
        max_steps=args.steps,
        gradient_checkpointing=False,
        bf16=args.dtype == "bfloat16",  # TRL's bf16 mixed precision (autocast) over fp32 weights
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        disable_tqdm=True,
    )
    steps: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.start, self.cpu_start, self.generate, self.cpu_generate = time.perf_counter(), time.process_time(), 0.0, 0.0

        def on_step_end(self, *_, **__):
            seconds = time.perf_counter() - self.start
            steps.append({"seconds": seconds, "generate": self.generate, "train": seconds - self.generate,
                          "cpu_seconds": time.process_time() - self.cpu_start, "cpu_generate": self.cpu_generate})
            print(f"trl step {len(steps)}: {seconds:.1f}s (generate {self.generate:.1f}s)", file=sys.stderr, flush=True)

    timer = Timer()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer,
                          callbacks=[timer])
    plain_generate = trainer.model.generate

    def timed_generate(*a, **kw):
        t, cpu = time.perf_counter(), time.process_time()
        out = plain_generate(*a, **kw)
        timer.generate += time.perf_counter() - t
        timer.cpu_generate += time.process_time() - cpu
        return out

    trainer.model.generate = timed_generate
    trainer.train()
    lengths = [row["completions/mean_length"] for row in trainer.state.log_history if "completions/mean_length" in row]
    assert lengths and all(abs(x - args.tokens) < 1e-6 for x in lengths), f"TRL completions were not {args.tokens} long: {lengths}"
    for s, mean_length in zip(steps, lengths):
        s["completion_tokens"] = round(mean_length * per_step)
    return {"framework": "trl", "steps": steps}


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
        "tokens_per_s": tokens / seconds,
        "cpu_s_per_step": sum(s["cpu_seconds"] for s in timed) / len(timed),
        "cpu_generate_s": sum(s["cpu_generate"] for s in timed) / len(timed),
        "timed_steps": len(timed),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per framework and round")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the figures")
    parser.add_argument("--rounds", type=int, default=1, help="run scirl then TRL this many times, alternating")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, the same for both")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256, help="completion length (forced)")
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="compute dtype of both frameworks, over float32 master weights (scirl: a bf16 compute "
                        "copy, as FSDP's mixed precision; TRL: autocast)")
    parser.add_argument("--work", default=None, help="directory for the model and TRL's output (default: a temp dir)")
    parser.add_argument("--only", choices=["scirl", "trl"], help="run one framework in this process (used internally)")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args(argv)
    if (args.questions * args.group) % args.micro_batch:
        parser.error("--micro-batch must divide questions x group")

    if args.only:
        import torch

        torch.set_num_threads(args.threads)
        torch.manual_seed(0)
        model_dir, questions = build_inputs(Path(args.work), args)
        result = (run_scirl if args.only == "scirl" else run_trl)(model_dir, questions, args)
        print(json.dumps(result))
        return 0

    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        args.work = args.work or tmp
        Path(args.work).mkdir(parents=True, exist_ok=True)
        build_inputs(Path(args.work), args)  # once, outside the timed runs
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
                   TOKENIZERS_PARALLELISM="false")
        results: dict[str, list] = {"scirl": [], "trl": []}
        settings = ["--steps", args.steps, "--threads", args.threads, "--questions", args.questions, "--group", args.group,
                    "--tokens", args.tokens, "--micro-batch", args.micro_batch, "--hidden", args.hidden,
                    "--layers", args.layers, "--lr", args.lr, "--dtype", args.dtype, "--work", args.work]
        # alternate the frameworks so a change in the machine's load hits both alike
        for _ in range(args.rounds):
            for framework in ("scirl", "trl"):
                cmd = [sys.executable, __file__, *map(str, settings), "--only", framework]
                out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True).stdout
                results[framework] += json.loads(out.strip().splitlines()[-1])["steps"][args.warmup:]
        summaries = {name: summarize(steps) for name, steps in results.items()}

    per_step = args.questions * args.group
    print(f"\n{args.questions} questions x {args.group} = {per_step} completions x {args.tokens} tokens per step, "
          f"model hidden {args.hidden} x {args.layers} layers, {args.threads} thread(s), "
          f"{summaries['scirl']['timed_steps']} timed step(s) each over {args.rounds} round(s)\n")
    print(f"{'':8}{'s/step':>10}{'generate s':>12}{'train s':>10}{'tokens/s':>10}{'CPU s/step':>12}{'CPU gen s':>11}")
    for name, s in summaries.items():
        print(f"{name:8}{s['s_per_step']:10.1f}{s['generate_s']:12.1f}{s['train_s']:10.1f}{s['tokens_per_s']:10.0f}"
              f"{s['cpu_s_per_step']:12.1f}{s['cpu_generate_s']:11.1f}")
    ratio = summaries["trl"]["s_per_step"] / summaries["scirl"]["s_per_step"]
    cpu_ratio = summaries["trl"]["cpu_s_per_step"] / summaries["scirl"]["cpu_s_per_step"]
    # on a shared machine wall time swings with the neighbours' load; process CPU time much less
    median_ratio = summaries["trl"]["s_per_step_median"] / summaries["scirl"]["s_per_step_median"]
    print(f"\nscirl / TRL speed: {ratio:.2f}x wall time, {cpu_ratio:.2f}x CPU time, {median_ratio:.2f}x median wall time "
          f"per step (goal >= 2x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": {k: v for k, v in vars(args).items() if k != "work"},
                                               "results": summaries, "ratio": ratio, "cpu_ratio": cpu_ratio,
                                               "median_ratio": median_ratio}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
