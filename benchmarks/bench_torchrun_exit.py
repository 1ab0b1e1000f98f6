"""How often does a finished 2-rank training exit 0? N short torchrun trainings, exit codes counted.

Each run is `torchrun --nproc-per-node 2 -m scirl train` on a tiny local model and generated
questions, 1 step, gloo on CPU. Before scirl's teardown fix about 3 runs in 30 ended with rank 1
aborting after "Training finished" (scirl/distributed.py says why). The race needs a loaded
machine; `--parallel K` runs K trainings at once to provide the load.

`--what step` runs, instead, the bare pattern the race comes from: 2 ranks load the model with
FSDP2, take one train step, gather the full state dict, then end either as scirl does
(`teardown()` + `exit_process()`) or, with `--plain-exit`, by destroying the process group and
returning to the interpreter (what scirl did before).

    python benchmarks/bench_torchrun_exit.py --runs 30 --parallel 3
    python benchmarks/bench_torchrun_exit.py --what step --runs 60 --parallel 6 [--plain-exit]
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

STEP_SCRIPT = """
import sys, torch
from scirl import algorithms
from scirl.run.config import TrainConfig
from scirl.distributed import exit_process, setup, teardown
from scirl.rollouts.contract import Sample
from scirl.trainer.model import load_model
from scirl.trainer import Trainer
dist, device = setup("cpu")
cfg = TrainConfig()
model = load_model(sys.argv[1], device, dist, torch.float32)
trainer = Trainer(
    model, cfg.optim, algorithms.build(cfg), temperature=1.0, device=device, dist=dist, dtype=torch.float32
)
g = torch.Generator().manual_seed(0)
samples = [
    Sample(
        torch.randint(10, 500, (4 + i,), generator=g).tolist(),
        torch.randint(10, 500, (3,), generator=g).tolist(),
        [-1.0, -2.0, -0.5],
        0.5 - i % 2,
        i,
    )
    for i in range(6)
]
trainer.train_step(trainer.batches(samples[dist.rank::2]))
state = trainer.full_state_dict()
ENDING
"""
SCIRL_ENDING = "teardown()\nexit_process(0)"
PLAIN_ENDING = "torch.distributed.destroy_process_group()"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--parallel", type=int, default=1, help="trainings at once (load makes the exit race likelier)")
    parser.add_argument(
        "--what", choices=("train", "step"), default="train", help="a scirl train run, or the bare step"
    )
    parser.add_argument("--plain-exit", action="store_true", help="with --what step: end the old way (no exit_process)")
    args = parser.parse_args(argv)

    from scirl.synth.questions import generate_rows, write_jsonl
    from scirl.synth.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-exit-") as tmp:
        work = Path(tmp)
        model = build_tiny_model(work / "model")
        data = write_jsonl(generate_rows(n_per_domain=12, seed=1), work / "rows.jsonl")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        step_script = work / "step.py"
        step_script.write_text(STEP_SCRIPT.replace("ENDING", PLAIN_ENDING if args.plain_exit else SCIRL_ENDING))

        def one(i: int) -> tuple[int, str]:
            launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
            if args.what == "step":
                cmd = launch + [str(step_script), str(model)]
            else:
                cmd = launch + [
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
                    str(work / f"run{i}"),
                    "--max-steps",
                    "1",
                    "--batch-size",
                    "16",
                    "--group-size",
                    "8",
                    "--micro-batch-size",
                    "8",
                    "--max-completion-tokens",
                    "4",
                    "--seq-len",
                    "512",
                    "--device",
                    "cpu",
                    "--dtype",
                    "float32",
                ]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            aborted = "terminate called" in proc.stdout + proc.stderr
            return proc.returncode, "aborted at exit" if aborted else ""

        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            results = list(pool.map(one, range(args.runs)))
    codes = collections.Counter(code for code, _ in results)
    aborts = sum(1 for _, note in results if note)
    what = (
        "scirl train"
        if args.what == "train"
        else ("bare step, plain exit" if args.plain_exit else "bare step, scirl's exit")
    )
    print(
        f"{what}: {codes.get(0, 0)}/{args.runs} runs exited 0; exit codes {dict(sorted(codes.items()))}; "
        f"{aborts} printed 'terminate called' ({args.parallel} at a time)"
    )
    return 0 if codes.get(0, 0) == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
