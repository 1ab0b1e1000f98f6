"""The host's packing: milliseconds a step to build the micro-batches, at the mission's shapes.

A step's samples as ``bench_packing.step_samples`` makes them (``--questions`` groups of ``--group-size``
completions, prompts of 100-350 tokens, completions geometric at 1/100 a token up to ``--limit``), cut into
micro-batches by ``make_micro_batches`` (``scirl/trainer/packing.py``) as the trainer's step does before its first
forward, in the two layouts a run uses: ``flex`` (CUDA's: rows padded to flex attention's 128-token block, one
grid) and ``sdpa`` (a CPU's: up to four grids of similar lengths). ``--against REV`` builds the same with another
revision's ``scirl`` (a ``git worktree`` of it) in the same run. Each side runs in its own process (1 thread); the
sides take turns, ``--calls`` calls a turn, the order reversed every other round. Printed per side and layout:
the median and least wall milliseconds of a step's packing, the median CPU milliseconds (what the packing itself
costs, whatever else the machine runs), and whether the micro-batches equal the first side's, tensor for tensor.

    python benchmarks/bench_host_packing.py [--questions 8] [--group-size 16] [--limit 256] [--rounds 5]
                                            [--against 513947f]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sides import REPO, against_tree, stop, turn  # a sibling module: benchmarks/ is on sys.path

LAYOUTS = {"flex": {"pad_to": 128, "max_grids": 1}, "sdpa": {"pad_to": 1, "max_grids": 4}}


def digest(value, h) -> None:
    """Every tensor and number of a micro-batch (nested dataclasses), in field order, into the hash ``h``."""
    import torch

    if isinstance(value, torch.Tensor):
        h.update(f"{value.dtype}{tuple(value.shape)}".encode())
        h.update(value.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, list):
        for v in value:
            digest(v, h)
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            digest(getattr(value, f.name), h)
    else:
        h.update(repr(value).encode())


def worker(args) -> None:
    import torch

    import scirl  # the side's, from PYTHONPATH: first, before bench_packing puts this tree on the path
    from scirl.trainer.packing import make_micro_batches

    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_packing import step_samples

    assert Path(scirl.__file__).resolve().is_relative_to(Path(os.environ["PYTHONPATH"]).resolve()), scirl.__file__
    torch.set_num_threads(1)
    samples = step_samples("geometric", args.questions, args.group_size, args.limit, 151_936)
    hashes = {}
    for layout, fields in LAYOUTS.items():
        h = hashlib.sha256()
        for mb in make_micro_batches(samples, max_tokens=args.max_tokens, **fields):
            digest(mb, h)
        hashes[layout] = h.hexdigest()
    print(json.dumps(hashes), flush=True)
    for line in sys.stdin:
        fields = LAYOUTS[line.strip()]
        times = []
        for _ in range(args.calls):
            wall, cpu = time.perf_counter(), time.thread_time()
            make_micro_batches(samples, max_tokens=args.max_tokens, **fields)
            times.append(((time.perf_counter() - wall) * 1e3, (time.thread_time() - cpu) * 1e3))
        print(json.dumps(times), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--limit", type=int, default=256, help="completion token limit")
    parser.add_argument("--max-tokens", type=int, default=8192, help="micro_batch_tokens")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20, help="steps packed a turn")
    parser.add_argument("--against", metavar="REV", help="also pack with this revision's scirl (a git worktree of it)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    with (
        tempfile.TemporaryDirectory(prefix="bench-host-packing-") as tmp,
        against_tree(args.against, Path(tmp), "bench_host_packing") as tree,
    ):
        sides = {**({args.against: tree} if tree else {}), "this tree": REPO}
        workers, hashes = {}, {}
        names = ("questions", "group_size", "limit", "max_tokens", "calls")
        flags = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in names]
        for side, source in sides.items():
            workers[side] = subprocess.Popen(
                [sys.executable, __file__, "--worker", *flags],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONPATH": str(source), "OMP_NUM_THREADS": "1"},
            )
            hashes[side] = json.loads(workers[side].stdout.readline())
        runs = {(side, layout): [] for side in sides for layout in LAYOUTS}
        for round_ in range(args.rounds):
            for layout in LAYOUTS:
                for side, reply in turn(workers, layout, reverse=round_ % 2 == 1).items():
                    runs[side, layout] += reply
        stop(workers)
    first = next(iter(sides))
    print(
        f"bench_host_packing: {args.questions} groups x {args.group_size} completions (geometric, <= {args.limit} "
        f"tokens), prompts 100-350 tokens, micro_batch_tokens {args.max_tokens}; {args.rounds} rounds of "
        f"{args.calls} steps a side; load average {os.getloadavg()[0]:.2f}"
    )
    print(f"{'layout':>6} {'side':>10} {'ms/step':>8} {'min ms':>7} {'cpu ms':>7} {'speed':>6}  same micro-batches")
    for layout in LAYOUTS:
        base = statistics.median(wall for wall, _ in runs[first, layout])
        for side in sides:
            walls, cpus = [w for w, _ in runs[side, layout]], [c for _, c in runs[side, layout]]
            same = "yes" if hashes[side][layout] == hashes[first][layout] else "NO"
            print(
                f"{layout:>6} {side:>10} {statistics.median(walls):>8.2f} {min(walls):>7.2f} "
                f"{statistics.median(cpus):>7.2f} {base / statistics.median(walls):>5.2f}x  {same}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
