"""SDPO's train step against GRPO's, on the demo's model and batch shape, in one process, interleaved.

One batch is sampled once with the demo base (``scirl/assets/demo-base``), the demo's config
(``configs/demo.toml``: 8 questions x 8 completions, up to ``--completion-tokens`` tokens; ``--min-tokens``
holds EOS back to lengthen them) and SDPO's teacher prompts; then a GRPO trainer and an SDPO trainer,
each on its own copy of the base, take ``--rounds`` train steps on that same batch, alternating, so a
neighbour's burst on a shared machine hits both. Printed: generation time (the same for both: the
sampler does not change), and per algorithm the minimum and the median train-step seconds and, for SDPO,
the teacher forwards' share. The minimum is the figure a shared machine spoils least.

    python benchmarks/bench_sdpo.py --rounds 15 --threads 2 [--completion-tokens 64 --min-tokens 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--completion-tokens", type=int, default=8)
    parser.add_argument("--min-tokens", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from scirl import algorithms
    from scirl.demo.run import BASE_MODEL_DIR, write_questions
    from scirl.rollouts.generate import generate_batch, prompt_for
    from scirl.run.backends import hf_generator, make_trainer
    from scirl.run.config_io import load_config
    from scirl.task.data import load_splits
    from scirl.trainer.model import load_model

    work = Path("outputs") / "bench-sdpo"
    data = write_questions(work / "questions.jsonl", 250, 50, 0)
    cfg = load_config(
        [
            "@",
            str(ROOT / "configs" / "demo.toml"),
            "--model",
            str(BASE_MODEL_DIR),
            "--data.source",
            str(data),
            "--algorithm",
            "sdpo",
            "--max-completion-tokens",
            str(args.completion_tokens),
        ]
    )
    tokenizer = AutoTokenizer.from_pretrained(BASE_MODEL_DIR)
    questions = [
        prompt_for(q, tokenizer)
        for q in load_splits(
            str(data), eval_per_domain=50, split_method=cfg.data.split_method, seed=cfg.data.split_seed
        ).train[: cfg.questions_per_step]
    ]
    generator = hf_generator(str(BASE_MODEL_DIR), tokenizer=tokenizer, device="cpu", dtype="float32")
    if args.min_tokens:  # longer completions: EOS held back (the sampler's min_tokens)
        original = generator.generate
        generator.generate = lambda prompts, params: original(
            prompts, dataclasses.replace(params, min_tokens=args.min_tokens)
        )
    batch = generate_batch(1, questions, generator, cfg.rollout_settings(), vocab_size=len(tokenizer))
    taught = sum(s.teacher_prompt_ids is not None for s in batch.samples)
    print(
        f"generation {batch.time_generate:.3f}s; {len(batch.samples)} samples, {taught} with a teacher; "
        f"completion tokens {statistics.fmean(len(s.completion_ids) for s in batch.samples):.1f} on average"
    )

    trainers = {}
    for algorithm in ("grpo", "sdpo"):
        run_cfg = cfg.model_copy(update={"algorithm": algorithm})
        model = load_model(str(BASE_MODEL_DIR), torch.device("cpu"), _one_process(), torch.float32)
        trainers[algorithm] = make_trainer(
            model,
            run_cfg,
            algorithms.build(run_cfg),
            device=torch.device("cpu"),
            dist=_one_process(),
            dtype=torch.float32,
        )
    seconds = {name: [] for name in trainers}
    teacher = []
    for _ in range(args.rounds):
        for name, trainer in trainers.items():
            started = time.perf_counter()
            stats = trainer.train_step(trainer.batches(batch.samples))
            seconds[name].append(time.perf_counter() - started)
            if name == "sdpo":
                teacher.append(stats["time/teacher"])
    for name, values in seconds.items():
        print(f"{name}: train step min {min(values):.3f}s, median {statistics.median(values):.3f}s")
    ratio = min(seconds["sdpo"]) / min(seconds["grpo"])
    print(
        f"sdpo / grpo (min): {ratio:.2f}x; teacher forwards: min {min(teacher):.3f}s, median "
        f"{statistics.median(teacher):.3f}s"
    )


def _one_process():
    from scirl.distributed import Dist

    return Dist()


if __name__ == "__main__":
    main()
