"""The trainer's micro-batches: the layout choices a run still makes, measured on the trainer's own step.

Every micro-batch is one packed row with no padding (on CUDA, up to flex attention's 128-token block at its end):
that much is settled (``scirl/trainer/packing.py``). What a run still chooses, each against scirl's defaults
(each group's prompt once, micro-batches of 8,192 tokens, the device's attention):

- ``share_prompts = false``: every completion with its own copy of its prompt (the per-sequence forward), against
  each group's prompt once;
- ``micro_batch_tokens``: smaller token budgets (``--tokens``, 2,048 and 4,096 by default), so more micro-batches;
- ``attention``: flex attention (a block mask that skips the blocks no token attends to) against the SDPA path (the
  prompts and the completion rows gathered into batches of their own). Timed on CUDA only: torch's flex attention
  has no CPU backward, so on a CPU its forward alone runs (eagerly), to check its logprobs.

One step's samples: ``--questions`` groups of ``--group-size`` completions, prompts of the mission's lengths
(``gpu_check/model.py``: 100-350 tokens) and completions under a length distribution (``geometric``: the mission's,
EOS at 1/100 a token up to the limit; ``at the limit``: a random model's, a long-thinking policy's early on;
``bimodal``: half answer in under a sixth of the limit, half reason at length). Each setting gets a trainer as ``scirl
train`` builds it (``make_trainer``: GRPO, the block-wise head, AdamW) over the same random Qwen3 weights; printed
per setting: micro-batches, the positions the forwards computed (padding included) against the useful tokens (each
group's prompt once plus the completions), the seconds of a train step (after an untimed one, the median of
``--rounds``, the settings taking turns and the order reversed every other round, so that a shared machine's load
hits them alike) and its speed against the defaults' (above 1: faster), and the largest difference of its per-token
logprobs from the defaults' (the same computation: they must agree to round-off).

    python benchmarks/bench_packing.py [--questions 2] [--group-size 16] [--limit 256] [--tokens 2048,4096]
                                      [--rounds 3] [--threads 1] [--device cpu] [--dtype float32]
    python benchmarks/bench_packing.py --device cuda --questions 8 --hidden 1024 --layers 28 --vocab 151936 \
        --dtype bfloat16

(Before micro-batches were packed this script compared right-padded rows, sorted and not, with packed ones;
packing won once the attention stopped computing across sequences: ``benchmarks/README.md`` keeps those figures.)
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_check.model import completion_lengths, prompt_lengths  # noqa: E402  (a sibling package: benchmarks/ is on sys.path)

from scirl import algorithms  # noqa: E402
from scirl.distributed import Dist  # noqa: E402
from scirl.rollouts.contract import Sample  # noqa: E402
from scirl.run.backends import make_trainer  # noqa: E402
from scirl.run.config import TrainConfig  # noqa: E402

PROMPT_VOCAB = 1024  # prompt ids a tokenizer's text gives; completions range over the whole vocabulary
DISTRIBUTIONS = {
    "geometric": lambda rng, limit, n: completion_lengths(n, limit, seed=rng.randrange(1 << 30)),
    "at the limit": lambda rng, limit, n: [limit] * n,
    "bimodal": lambda rng, limit, n: [
        rng.randint(1, max(1, limit // 6))
        if rng.random() < 0.5
        else min(limit, rng.randint(limit // 2, int(1.2 * limit)))
        for _ in range(n)
    ],
}


def step_samples(distribution: str, questions: int, group: int, limit: int, vocab: int, seed: int = 0) -> list[Sample]:
    """One step's samples: a prompt per group of the mission's lengths, completions of the distribution's."""
    rng = random.Random(f"{distribution}-{seed}")
    lengths = DISTRIBUTIONS[distribution](rng, limit, questions * group)
    samples = []
    for g, prompt_length in enumerate(prompt_lengths(questions, seed)):
        prompt = [rng.randrange(PROMPT_VOCAB) for _ in range(prompt_length)]
        for i in range(group):
            completion = [rng.randrange(vocab) for _ in range(lengths[g * group + i])]
            samples.append(Sample(prompt, completion, [-8.0] * len(completion), (-1.0) ** i, g))
    return samples


def settings(device: torch.device, tokens: list[int]) -> list[tuple[str, dict]]:
    """(name, the run config's fields) of every setting, scirl's defaults first: the others are compared with them.
    On a CPU flex attention runs eagerly, a reference implementation that holds a row's whole score matrix: its
    check takes rows of 2,048 tokens (the logprobs do not depend on how a step is cut)."""
    other = (
        ("attention = sdpa", {"attention": "sdpa"})
        if device.type == "cuda"
        else ("attention = flex (2048-token rows)", {"attention": "flex", "micro_batch_tokens": 2048})
    )
    return (
        [("defaults", {}), ("share_prompts = false", {"share_prompts": False})]
        + [(f"micro_batch_tokens = {n}", {"micro_batch_tokens": n}) for n in tokens]
        + [other]
    )


def trainable(device: torch.device, fields: dict) -> bool:
    """Whether the setting's step can run here: flex attention trains on CUDA only (no CPU backward in torch)."""
    return device.type == "cuda" or fields.get("attention") != "flex"


def run_config(args, fields: dict) -> TrainConfig:
    return TrainConfig(
        model="bench-packing-random-qwen3",
        device=args.device,
        dtype=args.dtype,
        kernels=args.kernels,
        batch_size=args.questions * args.group_size,
        group_size=args.group_size,
        max_completion_tokens=args.limit,
        seq_len=4096,
        **fields,
    )


def logprobs_of(trainer, samples: list[Sample]) -> torch.Tensor:
    """Every completion token's logprob under the trainer's forward, sample by sample, in one flat tensor."""
    out = []
    with torch.no_grad():
        for mb in trainer.batches(samples):
            logprobs, _, mask, _ = trainer.forward_logprobs(trainer.on_device(mb))
            out.append(logprobs[mask].float().cpu())  # row by row: the samples' order
    return torch.cat(out)


def timed_step(trainer, batches: list, device: torch.device) -> tuple[float, dict]:
    """(seconds, the trainer's statistics) of one train step."""
    started = time.perf_counter()
    stats = trainer.train_step(batches)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started, stats


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=2, help="groups in the step")
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--limit", type=int, default=256, help="completion token limit")
    parser.add_argument("--tokens", default="2048,4096", help="micro_batch_tokens to compare with the default 8192")
    parser.add_argument("--rounds", type=int, default=3, help="timed steps of each setting, the settings taking turns")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--vocab",
        type=int,
        default=4096,
        help="small by default: the head runs on loss tokens only, the same in every layout",
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the compute dtype (bfloat16: a GPU's; over float32 master weights, as scirl trains)",
    )
    parser.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "eager", "compile", "liger"],
        help="the decoder layers (auto: compiled on CUDA, eager on a CPU)",
    )
    parser.add_argument(
        "--distributions", default=",".join(DISTRIBUTIONS), help="which completion-length distributions"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    try:
        tokens = [int(n) for n in args.tokens.split(",") if n]
    except ValueError:
        parser.error(f"--tokens takes comma-separated integers, got {args.tokens!r}")
    unknown = [d for d in args.distributions.split(",") if d not in DISTRIBUTIONS]
    if unknown:
        parser.error(f"--distributions: unknown {', '.join(unknown)} (known: {', '.join(DISTRIBUTIONS)})")
    if args.threads:
        torch.set_num_threads(args.threads)
    # a CPU's flex row runs eagerly on purpose (its forward alone, to check the logprobs): torch's advice is for speed
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    )
    model = Qwen3ForCausalLM(config).to(device).train()  # float32 masters, as load_model gives them
    start = {name: t.detach().clone() for name, t in model.state_dict().items()}
    print(
        f"bench_packing: Qwen3 hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}, {device}, "
        f"{args.dtype}, kernels {args.kernels}; {args.questions} groups x {args.group_size} completions <= "
        f"{args.limit} tokens, prompts of 100-350 tokens"
    )
    print(
        f"{'lengths':>12} {'setting':>34} {'mbs':>4} {'forward':>8} {'useful':>7} {'/ useful':>8} {'s/step':>8} "
        f"{'speed':>6} {'max |dlogprob|':>14}"
    )
    for distribution in args.distributions.split(","):
        samples = step_samples(distribution, args.questions, args.group_size, args.limit, args.vocab)
        reference, runs = None, []
        for name, fields in settings(device, tokens):
            model.load_state_dict(start)  # every setting's logprobs from the same weights: they must agree
            cfg = run_config(args, fields)
            trainer = make_trainer(model, cfg, algorithms.build(cfg), device=device, dist=Dist(), dtype=dtype)
            logprobs = logprobs_of(trainer, samples)
            reference = logprobs if reference is None else reference
            run = {"name": name, "diff": float((logprobs - reference).abs().max()), "times": []}
            if trainable(device, fields):
                run.update(trainer=trainer, batches=trainer.batches(samples))
                trainer.train_step(run["batches"])  # untimed: new shapes, compilation on CUDA
            runs.append(run)
        timed = [run for run in runs if "trainer" in run]
        for round_ in range(
            args.rounds
        ):  # the settings in turn, reversed every other round: the machine's load hits all
            for run in timed if round_ % 2 == 0 else timed[::-1]:
                seconds, run["stats"] = timed_step(run["trainer"], run["batches"], device)
                run["times"].append(seconds)
        base = statistics.median(runs[0]["times"])
        for run in runs:
            row = f"{distribution:>12} {run['name']:>34}"
            if "trainer" not in run:
                print(
                    f"{row} {'':>4} {'':>8} {'':>7} {'':>8} {'n/a':>8} {'n/a':>6} {run['diff']:>14.2e}  "
                    f"(flex attention has no backward on {device.type}: its forward alone)"
                )
                continue
            seconds, stats = statistics.median(run["times"]), run["stats"]
            print(
                f"{row} {len(run['batches']):>4} {stats['forward_tokens']:>8} {stats['unique_tokens']:>7} "
                f"{stats['forward_tokens'] / stats['unique_tokens']:>8.2f} {seconds:>8.3f} {base / seconds:>6.2f} "
                f"{run['diff']:>14.2e}"
            )
        del runs, timed
    return 0


if __name__ == "__main__":
    sys.exit(main())
