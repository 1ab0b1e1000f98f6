"""A checkpoint's cost to training: the synchronous save of an earlier revision vs this tree's background one.

    python benchmarks/bench_checkpoint.py [--against 513947f] [--rounds 2] [--checkpoints 3] [--json out.json]

A random-init Qwen3 of ~239M parameters (hidden 1536, 7 layers; its config says bf16, as Qwen3's do), float32
masters and fused AdamW's state after one step: a trainer state of ~2.9 GB (12 bytes a parameter), the serving
weights ~0.5 GB in bf16. Each side trains in one process and under torchrun on 2 gloo ranks (FSDP2), one thread a
rank, and takes ``--checkpoints`` checkpoints, with training steps between them (one tiny micro-batch each:
forward, backward, the AdamW step over every parameter):

- ``sync``: revision ``--against`` (default 513947f, before this change) as its ``scirl.run.train.save`` does it,
  run from a ``git worktree`` of it with its own ``scirl`` first on the module path: rank 0 gathers the full float32
  weights and optimizer state, writes ``model.safetensors`` and ``optimizer.pt``, seals (sha256, fsync) and commits,
  the other ranks wait at a barrier. Training is blocked for all of it.
- ``background``: this tree's ``Checkpointer`` (``scirl/run/checkpointer.py``): the step hands the state's
  references over, the writer stages them into reused host buffers while the next step computes, and that step's
  optimizer update waits for the staging if it must; the writes, hashing and fsyncs run beside training, a step at a
  time until the checkpoint is committed (the next checkpoint comes only then, as with any ``ckpt.interval`` longer
  than the write).

Printed per side and rank count: the seconds training was blocked per checkpoint (median: the save call and every
wait of the following updates for it), the ratio to the synchronous save's, the background write's seconds
(submission to the trainer state's commit, while training ran), the bytes a checkpoint wrote (every rank's) and
their throughput. The order of the sides is reversed every other round, so a change in a shared machine's load
hits them alike. ``--json`` keeps every number.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHAPE = {"hidden_size": 1536, "num_layers": 7, "num_heads": 16, "num_kv_heads": 4, "intermediate_size": 6144}


# ---------------------------------------------------------------------------------------------------------------
# one side, in its own process (or 2 under torchrun)


def tiny_samples():
    from scirl.rollouts.contract import Sample

    return [
        Sample(
            prompt_ids=list(range(10, 26)),
            completion_ids=list(range(30, 38)),
            logprobs=[-1.0] * 8,
            advantage=1.0 if i % 2 else -1.0,
            group=i,
        )
        for i in range(4)
    ]


def worker(args) -> None:
    import torch

    from scirl import algorithms
    from scirl.distributed import exit_process, setup, teardown
    from scirl.run import checkpoint
    from scirl.run.config_io import load_config
    from scirl.trainer import Trainer
    from scirl.trainer.model import load_model
    from scirl.trainer.packing import make_micro_batches

    torch.set_num_threads(1)
    dist, device = setup("cpu")
    sync = hasattr(checkpoint, "save_checkpoint")  # the earlier revision's single-writer save
    cfg = load_config(
        [
            "--model",
            args.model,
            "--output-dir",
            args.run_dir,
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--ckpt.keep",
            "1",
        ]
    )
    group = None
    if not sync:
        from scirl.run.checkpointer import checkpoint_group

        group = checkpoint_group(dist.world_size)
    model = load_model(args.model, device, dist, torch.float32)
    trainer = Trainer(
        model, cfg.optim, algorithms.build(cfg), temperature=1.0, device=device, dist=dist, dtype=torch.float32
    )
    samples = tiny_samples()[dist.rank :: dist.world_size]

    def step() -> None:
        trainer.train_step(make_micro_batches(samples, max_rows=2))

    step()  # AdamW's state exists from here
    Path(args.run_dir).mkdir(parents=True, exist_ok=True)
    if sync:
        records = sync_side(args, trainer, dist, step)
    else:
        records = background_side(args, cfg, trainer, dist, group, device, step)
    if dist.is_main:
        Path(args.out).write_text(json.dumps(records))
    teardown()
    exit_process(0)


def sync_side(args, trainer, dist, step) -> list[dict]:
    """The earlier revision's ``scirl.run.train.save``, body for body (its API: this process runs its scirl)."""
    import torch
    from transformers import AutoTokenizer

    from scirl import distributed
    from scirl.run import checkpoint

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    records = []
    for n in range(1, args.checkpoints + 1):
        started = time.perf_counter()
        state = trainer.full_state_dict(all_ranks=False)
        bad = [name for name, tensor in state.items() if not bool(torch.isfinite(tensor).all())]
        assert not bad
        checkpoint.save_checkpoint(
            args.run_dir,
            n,
            trainer.model,
            tokenizer,
            state_dict=state,
            adapter=None,
            optimizer_state=trainer.optimizer_state_dict(),
            data_position={"epoch": 0, "cursor": n},
            extra={"consecutive_empty_steps": 0},
            keep=1,
            algorithm_state=trainer.algorithm.state_files(all_ranks=False),
        )
        distributed.barrier(dist)
        blocked = time.perf_counter() - started
        del state
        records.append({"blocked_s": blocked, "background_s": 0.0, "bytes": written(args.run_dir, n), "steps": 1})
        step()
    return records


def background_side(args, cfg, trainer, dist, group, device, step) -> list[dict]:
    """This tree's: ``Checkpointer.save``, then training steps until the write is committed."""
    from transformers import AutoTokenizer

    from scirl.run.checkpoint import capture_rng_state
    from scirl.run.setup import make_checkpointer

    writer = make_checkpointer(
        cfg, trainer, AutoTokenizer.from_pretrained(args.model), args.model, dist, group, device, lambda text: None
    )
    trainer.before_update = writer.wait_for_staging
    records = []
    for n in range(1, args.checkpoints + 1):
        writer.save(n, {"step": n, "rng": capture_rng_state()} if dist.is_main else None, full=True)
        steps, background = 0, None
        while background is None or steps == 0:
            step()  # its update waits for the staging if it is not done
            steps += 1
            background = writer.poll()
            if background is None and steps >= 50:
                writer.finish()  # a write slower than 50 steps: wait for it, counted as blocked
                background = writer.poll()
        records.append(
            {
                "blocked_s": writer.take_blocked(),
                "background_s": background,
                "bytes": written(args.run_dir, n),
                "steps": steps,
            }
        )
    writer.close()
    return records


def written(run_dir: str, n: int) -> int:
    """Every file of checkpoint ``n``, both parts, as its manifests list them."""
    step = Path(run_dir) / "weights" / f"step_{n}"
    total = 0
    for manifest in (step / "manifest.json", step / "trainer_state" / "manifest.json"):
        if manifest.is_file():
            total += sum(entry["size"] for entry in json.loads(manifest.read_text())["files"].values())
    return total


# ---------------------------------------------------------------------------------------------------------------
# the driver


def build_model(out: Path, shape: dict) -> Path:
    """The benchmark's model: random init, float32 weights, a config that says bf16 (what the serving weights take)."""
    from scirl.synth.tiny_model import build_tiny_model

    build_tiny_model(out, **shape)
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@contextlib.contextmanager
def against_tree(rev: str, tmp: Path):
    """A ``git worktree`` of revision ``rev`` of this repository for the duration."""
    tree = tmp / f"against-{rev}"
    made = subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), rev], capture_output=True, text=True
    )
    if made.returncode != 0:
        raise SystemExit(
            f"bench_checkpoint: --against {rev}: git worktree add failed: {made.stderr.strip().splitlines()[-1]}"
        )
    try:
        yield tree
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)


def run_side(root: Path, ranks: int, model: Path, tmp: Path, checkpoints: int) -> list[dict]:
    """One side in its own process(es), with ``root``'s scirl first on the module path."""
    out, run_dir = tmp / "records.json", tmp / f"run-{time.monotonic_ns()}"
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] if ranks > 1 else []
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            sys.executable,
            *launcher,
            str(Path(__file__).resolve()),
            "--worker",
            "--model",
            str(model),
            "--run-dir",
            str(run_dir),
            "--out",
            str(out),
            "--checkpoints",
            str(checkpoints),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if done.returncode != 0:
        raise SystemExit(f"bench_checkpoint: a side failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    records = json.loads(out.read_text())
    subprocess.run(["rm", "-rf", str(run_dir)], check=False)
    return records


def summary(records: list[dict]) -> dict:
    blocked = [r["blocked_s"] for r in records]
    background = [r["background_s"] for r in records]
    gb = statistics.median(r["bytes"] for r in records) / 1e9
    return {
        "blocked_s": statistics.median(blocked),
        "blocked_all_s": blocked,
        "background_s": statistics.median(background),
        "gb": gb,
        "gb_per_s": gb / statistics.median(background) if statistics.median(background) else None,
        "steps_between": [r["steps"] for r in records],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default="513947f", help="the revision whose synchronous save is compared")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--checkpoints", type=int, default=3, help="checkpoints a side takes in one run")
    parser.add_argument("--ranks", default="1,2", help="the rank counts to run (default: 1 and 2)")
    parser.add_argument("--layers", type=int, default=SHAPE["num_layers"], help="decoder layers (fewer: a quick look)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    sys.path.insert(0, str(REPO))
    with (
        tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp_name,
        against_tree(args.against, Path(tmp_name)) as old,
    ):
        tmp = Path(tmp_name)
        shape = {**SHAPE, "num_layers": args.layers}
        model = build_model(tmp / "model", shape)
        sides = [(f"sync@{args.against}", old), ("background", REPO)]
        results: dict[str, list] = {}
        for ranks in (int(r) for r in args.ranks.split(",")):
            for round_ in range(args.rounds):
                for name, root in sides if round_ % 2 == 0 else sides[::-1]:
                    results.setdefault(f"{name} x{ranks}", []).extend(
                        run_side(root, ranks, model, tmp, args.checkpoints)
                    )
    table = {key: summary(records) for key, records in results.items()}
    print(f"{'side':<22} {'blocked s/ckpt':>14} {'vs sync':>8} {'background s':>13} {'GB':>6} {'GB/s':>6}")
    for key, row in table.items():
        name, ranks = key.rsplit(" ", 1)
        sync_row = table[f"sync@{args.against} {ranks}"]
        ratio = row["blocked_s"] / sync_row["blocked_s"]
        rate = f"{row['gb_per_s']:.2f}" if row["gb_per_s"] else "-"
        background = f"{row['background_s']:.1f}" if row["background_s"] else "-"
        print(f"{key:<22} {row['blocked_s']:>14.2f} {ratio:>7.1%} {background:>13} {row['gb']:>6.2f} {rate:>6}")
    if args.json:
        Path(args.json).write_text(json.dumps({"against": args.against, "shape": shape, "sides": table}, indent=1))


if __name__ == "__main__":
    main()
