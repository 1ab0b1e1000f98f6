"""How often does a finished 2-rank training exit 0? N short torchrun trainings, exit codes counted.

Each run is `torchrun --nproc-per-node 2 -m scirl train` on a tiny local model and generated
questions, 1 step, gloo on CPU. Before scirl's teardown fix about 3 runs in 30 ended with rank 1
aborting after "Training finished" (scirl/distributed.py says why). The race needs a loaded
machine; `--parallel K` runs K trainings at once to provide the load.

    python benchmarks/bench_torchrun_exit.py --runs 30 --parallel 3
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--parallel", type=int, default=1, help="trainings at once (load makes the exit race likelier)")
    args = parser.parse_args(argv)

    from scirl.synthetic import generate_rows, write_jsonl
    from scirl.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-exit-") as tmp:
        work = Path(tmp)
        model = build_tiny_model(work / "model")
        data = write_jsonl(generate_rows(n_per_domain=12, seed=1), work / "rows.jsonl")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}

        def one(i: int) -> tuple[int, str]:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   "-m", "scirl", "train", "--model", str(model), "--data.source", str(data),
                   "--data.eval-per-domain", "2", "--output-dir", str(work / f"run{i}"), "--max-steps", "1",
                   "--batch-size", "16", "--group-size", "8", "--micro-batch-size", "8",
                   "--max-completion-tokens", "4", "--seq-len", "512", "--device", "cpu", "--dtype", "float32"]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            aborted = "terminate called" in proc.stdout + proc.stderr
            return proc.returncode, "aborted at exit" if aborted else ""

        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            results = list(pool.map(one, range(args.runs)))
    codes = collections.Counter(code for code, _ in results)
    aborts = sum(1 for _, note in results if note)
    print(f"{codes.get(0, 0)}/{args.runs} runs exited 0; exit codes {dict(sorted(codes.items()))}; "
          f"{aborts} printed 'terminate called' ({args.parallel} at a time)")
    return 0 if codes.get(0, 0) == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
