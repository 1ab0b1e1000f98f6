"""The LM head's forward and backward with Qwen3's 151,936-token vocabulary: seconds and peak memory a call.

One call of the block-wise head (``scirl/trainer/head.py``) as a micro-batch's step makes it: the sampled tokens'
logprobs and entropies from ``--tokens`` final hidden states, then the backward of a loss over the logprobs into
the hidden states and the head weight (float32, as a CPU trains). Sides, each in its own process with its own
``scirl`` on the module path, taking turns call by call (the order reversed every other round, so that a shared
machine's load hits them alike):

- ``eager``: this tree's head as a CPU runs it (``kernels = eager``);
- ``compiled``: this tree's head as CUDA runs it (``kernels = compile``: ``FusedHeadLogprobs``), compiled before the
  timed calls;
- ``REV`` (``--against REV``): the head of another revision of this repository, from a ``git worktree`` of it.

Printed per side: the median seconds of a forward and backward (``--rounds`` calls after an untimed one), its CPU
seconds, the peak memory the call adds (the process's resident peak, reset before the call, less its resident
size before: the head's [block x vocabulary] tensors and the weight's gradient), the speed against each other
side (above 1: faster), and the largest difference of its logprobs and gradients from the first side's (the same
computation: round-off). A CPU's ratio of arithmetic to memory traffic is a GPU's at a far smaller hidden size:
at ``--hidden 64`` the head's matmuls weigh against its elementwise passes about as a 0.6B model's do on an H100;
``--hidden 1024`` (0.6B's own) shows the matmul-bound end.

    python benchmarks/bench_head.py [--tokens 2048] [--hidden 64] [--block 512] [--rounds 5] [--against 513947f]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sides import REPO, against_tree, stop, turn  # a sibling module: benchmarks/ is on sys.path

QWEN3_VOCAB = 151_936


def status_kib(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def worker(args) -> None:
    """One side: build the inputs, warm up (compile), then one timed call per line read from stdin."""
    import torch

    import scirl
    from scirl.trainer.head import Head

    assert Path(scirl.__file__).resolve().is_relative_to(Path(os.environ["PYTHONPATH"]).resolve()), scirl.__file__
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g) / args.hidden**0.5).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    upstream = torch.randn(args.tokens, generator=g)
    head = Head(args.temperature, args.top_p, args.block, **({"fused": True} if args.side == "compiled" else {}))

    def call() -> dict:
        logprobs, entropy = head.token_logprobs(hidden, weight, targets)
        (logprobs * upstream).sum().backward()
        return {"logprobs": logprobs.detach(), "entropy": entropy, "hidden": hidden.grad, "weight": weight.grad}

    torch.save(call(), args.outputs)  # untimed: compiles the compiled side's graphs
    print("ready", flush=True)
    for _ in sys.stdin:
        hidden.grad = weight.grad = None  # the call makes its own
        Path("/proc/self/clear_refs").write_text("5")  # the resident peak from here
        before = status_kib("VmRSS")
        wall, cpu = time.perf_counter(), time.process_time()
        call()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(json.dumps({"s": wall, "cpu_s": cpu, "peak_mb": (status_kib("VmHWM") - before) / 1024}), flush=True)


def start(side: str, source: Path, args, work: Path) -> subprocess.Popen:
    command = [
        sys.executable,
        __file__,
        "--worker",
        side,
        "--outputs",
        str(work / f"{side}.pt"),
        *(
            f"--{k}={getattr(args, k)}"
            for k in ("tokens", "hidden", "vocab", "block", "temperature", "top_p", "threads")
        ),
    ]
    env = {**os.environ, "PYTHONPATH": str(source), "OMP_NUM_THREADS": str(args.threads)}
    process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if process.stdout.readline().strip() != "ready":
        sys.exit(f"bench_head: the {side} side failed to start (see its error above)")
    return process


def largest_differences(a: dict, b: dict) -> float:
    """The largest absolute difference of the outputs and gradients, each over its largest magnitude."""
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)) for k in b)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="loss tokens: the head's rows")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=QWEN3_VOCAB)
    parser.add_argument("--block", type=int, default=512, help="head_block_tokens")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top_p", "--top-p", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--against", metavar="REV", help="also run this revision's head (a git worktree of it)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--outputs", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.side = args.worker
        worker(args)
        return 0

    import torch

    with (
        tempfile.TemporaryDirectory(prefix="bench-head-") as tmp,
        against_tree(args.against, Path(tmp), "bench_head") as tree,
    ):
        work = Path(tmp)
        sides = {**({args.against: tree} if tree else {}), "eager": REPO, "compiled": REPO}
        workers = {side: start(side, source, args, work) for side, source in sides.items()}
        runs = {side: [] for side in sides}
        for round_ in range(args.rounds):
            for side, reply in turn(workers, "run", reverse=round_ % 2 == 1).items():
                runs[side].append(reply)
        stop(workers)
        outputs = {side: torch.load(work / f"{side}.pt") for side in sides}
    first = next(iter(sides))
    print(
        f"bench_head: {args.tokens} loss tokens, hidden {args.hidden}, vocabulary {args.vocab:,}, blocks of "
        f"{args.block}, temperature {args.temperature}, top_p {args.top_p}, float32, {args.threads} thread(s), "
        f"{args.rounds} rounds; load average {os.getloadavg()[0]:.2f}"
    )
    medians = {side: statistics.median(r["s"] for r in runs[side]) for side in sides}
    print(
        f"{'side':>10} {'s/call':>8} {'min s':>7} {'cpu s':>7} {'peak MB':>8} {'max rel diff':>13}  speed vs "
        + ", ".join(sides)
    )
    for side in sides:
        r = runs[side]
        speed = ", ".join(f"{medians[other] / medians[side]:.2f}x" for other in sides)
        print(
            f"{side:>10} {medians[side]:>8.3f} {min(x['s'] for x in r):>7.3f} "
            f"{statistics.median(x['cpu_s'] for x in r):>7.3f} {max(x['peak_mb'] for x in r):>8.0f} "
            f"{largest_differences(outputs[side], outputs[first]):>13.1e}  {speed}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
