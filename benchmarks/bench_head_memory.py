"""A training step's memory with Qwen3's 151,936-token vocabulary, measured from outside: max RSS of ``scirl train``.

A tiny Qwen3 (hidden 64, 2 layers, tied embeddings) with the real vocabulary, so the LM head and its softmax
are most of a step's memory: one step of 64 completions (8 prompts x 8), micro-batches of 8, float32, on a
CPU, once with completions of ``--short`` tokens and once of ``--long`` tokens. The difference of the two max
RSS is what the longer completions cost: the [tokens x vocabulary] tensors a full-logits step holds grow with
it, the block-wise head's (``scirl/trainer/head.py``) do not. A random model samples past its end-of-turn
token for the whole limit, so every completion is ``--long`` tokens; all three rollout filters monitor only,
so every completion is trained on.

``--against REV`` runs the same two trainings with the source of another revision of this repository (a
``git worktree`` of it on the module path) in the same run, and prints the ratio.

    python benchmarks/bench_head_memory.py [--short 16] [--long 384] [--against 8d66aba] [--keep DIR]

Each training is its own process; its max RSS comes from ``wait4``, that process's alone.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from scirl.run.memory import KNOWN_SHAPES  # noqa: E402
from scirl.synth.questions import generate_rows, write_jsonl  # noqa: E402
from scirl.synth.tiny_model import build_tiny_model  # noqa: E402

QWEN3_VOCAB = KNOWN_SHAPES["qwen3-8b"].vocab  # every Qwen3 dense model's: 151,936


def big_vocabulary_model(out: Path) -> Path:
    """The tiny model with Qwen3's vocabulary size: the offline tokenizer's 1,024 tokens stay the ones that
    decode to text; the sampled ids past them decode to nothing, as they would for any random model."""
    import torch
    from transformers import AutoConfig, Qwen3ForCausalLM

    small = build_tiny_model(out / "small", hidden_size=64, num_layers=2)
    config = AutoConfig.from_pretrained(small)
    config.vocab_size = QWEN3_VOCAB
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(out / "model")
    for f in small.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (out / "model" / f.name).write_bytes(f.read_bytes())
    return out / "model"


def train_rss_mb(source: Path, model: Path, data: Path, out: Path, completion_tokens: int) -> tuple[float, float]:
    """(max RSS in MB, wall seconds) of one ``scirl train`` step run from ``source``'s code."""
    command = [
        sys.executable,
        "-m",
        "scirl",
        "train",
        "--model",
        str(model),
        "--data.source",
        str(data),
        "--data.eval-per-domain",
        "2",
        "--output-dir",
        str(out),
        "--max-steps",
        "1",
        "--batch-size",
        "64",
        "--group-size",
        "8",
        "--micro-batch-size",
        "8",
        "--max-completion-tokens",
        str(completion_tokens),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--filters.gibberish.no-enforce",
        "--filters.repetition.no-enforce",
        "--filters.zero-advantage.no-enforce",
    ]
    env = {**os.environ, "PYTHONPATH": str(source), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=out.parent)
        _, status, usage = os.wait4(process.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(
            f"scirl train ({source}, {completion_tokens} tokens) failed with {code}: see {out.with_suffix('.log')}"
        )
    return usage.ru_maxrss / 1024, time.perf_counter() - start  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", type=int, default=16, help="completion tokens of the baseline run")
    parser.add_argument("--long", type=int, default=384, help="completion tokens of the measured run")
    parser.add_argument(
        "--against",
        metavar="REV",
        help="also measure this revision's code (e.g. the one before the block-wise head, 8d66aba)",
    )
    parser.add_argument("--keep", type=Path, help="work here and keep it (default: a temporary directory)")
    args = parser.parse_args()

    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-head-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    model = big_vocabulary_model(work)
    data = write_jsonl(generate_rows(n_per_domain=20, seed=0), work / "rows.jsonl")
    sides = {"this tree": REPO}
    against = work / "against"
    try:
        if args.against:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "add", "--detach", str(against), args.against],
                check=True,
                capture_output=True,
            )
            sides[args.against] = against
        extra = {}
        print(f"1 step, 64 completions, micro-batch 8, float32, vocabulary {QWEN3_VOCAB:,}, 1 thread")
        print(
            f"{'code':>12}  {'RSS ' + str(args.short) + ' tok':>12}  {'RSS ' + str(args.long) + ' tok':>12}  "
            f"{'extra MB':>9}  {'wall s':>7}"
        )
        for name, source in sides.items():
            short, _ = train_rss_mb(source, model, data, work / f"{name.replace(' ', '_')}-{args.short}", args.short)
            long, wall = train_rss_mb(source, model, data, work / f"{name.replace(' ', '_')}-{args.long}", args.long)
            extra[name] = long - short
            print(f"{name:>12}  {short:>12,.0f}  {long:>12,.0f}  {extra[name]:>9,.0f}  {wall:>7.1f}")
        if args.against:
            print(f"extra memory, this tree / {args.against}: {extra['this tree'] / extra[args.against]:.2f}")
    finally:
        if args.against:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(against)],
                check=False,
                capture_output=True,
            )
    print(f"work directory: {work}")


if __name__ == "__main__":
    main()
