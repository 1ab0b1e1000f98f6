"""``scirl train`` as the check launches it (``launch.scirl_command``):

    python -m gpu_check.scirl_run [--deterministic] [--steps FILE] -- train ARGS...

- ``--deterministic``: what makes a run's result depend on its inputs alone on a GPU (``launch.DETERMINISM_ENV`` says
  why each), set before scirl starts;
- ``--steps FILE``: each step's training measured from inside the process, one JSON line a step: the allocator's
  peak during the step's training alone (its peak statistic reset just before the trainer's half of the step, so
  generation's KV cache, which is freed by then, is not in it), the peak before that reset (at step 1: the model,
  its state and step 1's generation), and what torch.compile did so far (``compiles.py``). Reading the allocator's
  statistics does not synchronise the device.

The reset makes the run's own ``memory/peak_mb`` the training (and weight push) peak too. Then scirl's CLI runs
as ``python -m scirl`` would.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .compiles import compile_counts


def deterministic_kernels() -> None:
    import torch

    # warn_only: the sampler's CUDA cumsum has no deterministic kernel and would raise
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)


def record_steps(path: Path, memory=None) -> None:
    """Wrap the trainer's half of every step (``scirl.run.train.learn``, which ``one_step`` calls) so that each step
    appends its line to ``path``. ``memory``: torch.cuda's allocator statistics (a stand-in in tests)."""
    import scirl.run.train as train

    if memory is None:
        import torch

        memory = torch.cuda
    plain = train.learn

    def learn(batch, trainer):
        device = trainer.device
        cuda = device.type == "cuda"
        before = memory.max_memory_allocated(device) if cuda else None
        if cuda:
            memory.reset_peak_memory_stats(device)
        stats = plain(batch, trainer)
        line = {
            "step": batch.step,
            "train_peak_bytes": memory.max_memory_allocated(device) if cuda else None,
            "peak_before_train_bytes": before,
            **compile_counts(),
        }
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
        return stats

    train.learn = learn


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: python -m gpu_check.scirl_run [--deterministic] [--steps FILE] -- train ARGS...", file=sys.stderr)
        return 2
    split = argv.index("--")
    options, args = argv[:split], argv[split + 1 :]
    if "--deterministic" in options:
        deterministic_kernels()
    if "--steps" in options:
        record_steps(Path(options[options.index("--steps") + 1]))
    from scirl.cli import main as scirl_main

    return scirl_main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
