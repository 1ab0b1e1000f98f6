"""``scirl train @ configs/X.toml [--field value ...] [--resume RUN_DIR] [--clean] [--dry-run]``."""

from __future__ import annotations

import argparse
import os
import sys

from scirl.commands.parser import Parser, device_problem, in_train_terms, refused, train_config, unwritable_dir

EPILOG = """\
config: '@ FILE.toml' (several are deep-merged left to right), then any field as a dotted flag,
kebab- or snake-case: --max-steps 30 --output-dir outputs/run --optim.lr 1e-5
--filters.zero-advantage.no-enforce --ckpt.interval 10. Unknown fields are errors. Every field, with
its default and what it means, is listed below; --dry-run prints the values a run would use.
Multi-GPU: torchrun --nproc-per-node N -m scirl train @ configs/X.toml
With inference servers (deployment.num_infer_gpus > 0): scirl train @ configs/X.toml starts the
vLLM servers and torchrun itself (logs/inference_<i>.log, logs/trainer.log, ports.json).
"""


def main(argv: list[str]) -> int:
    from scirl.run.config_io import field_reference

    parser = Parser(
        prog="scirl train",
        description="Cold-start RL training (GRPO; --algorithm NAME for another, docs/algorithms.md).",
        epilog=f"{EPILOG}\nconfig fields, with their defaults:\n{field_reference()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue RUN_DIR from its last complete checkpoint "
        "(its config.toml is the base; flags given here override it, e.g. a larger --max-steps)",
    )
    parser.add_argument(
        "--clean", action="store_true", help="delete the artifacts of a previous run in the output dir first"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    args, rest = parser.parse_known_args(argv)

    from scirl.errors import ConfigError
    from scirl.run.config_io import to_toml_dict

    config_args = list(rest)  # as given: a launcher passes them on, and its trainer resolves the same config
    try:
        cfg = train_config(rest, args.resume)
    except ConfigError as exc:
        print(f"scirl train: {exc}", file=sys.stderr)
        return 2
    if args.resume and args.clean:
        print("scirl train: --resume and --clean contradict each other", file=sys.stderr)
        return 2
    from scirl.errors import PreflightError

    if not (args.dry_run or cfg.device == "cpu" or launches(cfg)):
        expandable_segments(cfg)  # before the memory plan asks CUDA for the GPU's size: CUDA initialises there
    try:
        preflight(cfg, resume=bool(args.resume), dry_run=args.dry_run)
    except PreflightError as exc:
        return refused("scirl train", exc)
    status, plan_text = memory_plan(cfg, dry_run=args.dry_run)
    if status:  # refused: its one line is all that is printed
        return status
    try:
        if not args.dry_run and (not args.resume or cfg.lora.enabled):
            check_hub(cfg)  # after the plan, which needs no hub: a layout that cannot fit is said offline too
    except PreflightError as exc:
        return refused("scirl train", exc)
    if args.dry_run:
        import tomli_w

        print(tomli_w.dumps(to_toml_dict(cfg)), end="")
    if plan_text:
        print(plan_text)
    if args.dry_run:
        return 0

    if launches(cfg):
        return deploy(cfg, config_args, resume=bool(args.resume), clean=args.clean)

    from scirl.errors import FAILED, ScirlError
    from scirl.run.checkpoint import CheckpointWriteError
    from scirl.run.train import train

    keep_freed_memory_on_cpu(cfg.device)
    try:
        status = train(cfg, resume=bool(args.resume), clean=args.clean)
    except (ScirlError, CheckpointWriteError) as exc:  # each error's own status: 2 refused, 1 failed during work
        print(f"scirl train: {in_train_terms(str(exc))}", file=sys.stderr)
        status = exc.status if isinstance(exc, ScirlError) else FAILED
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or cfg.inference.urls:
        from scirl.distributed import exit_process

        # under torchrun: no interpreter finalization (scirl/distributed.py says why); with servers, requests
        # still in flight to a failed server would otherwise hold the exit up to their own deadline
        exit_process(status)
    return status


def launches(cfg) -> bool:
    """Whether this command starts the inference servers and the trainer (``deploy``) instead of training."""
    return cfg.deployment.num_infer_gpus > 0 and not cfg.inference.urls


def expandable_segments(cfg) -> None:
    """This process trains, on CUDA where it has a GPU: the caching allocator's expandable segments
    (``scirl.run.allocator``), through the environment, which torch reads when CUDA initialises."""
    from scirl.run.allocator import holds_vllm_engine, trainer_env

    os.environ.update(trainer_env(os.environ, holds_engine=holds_vllm_engine(cfg)))


def preflight(cfg, *, resume: bool, dry_run: bool) -> None:
    """What would otherwise fail with a traceback, or after minutes of work, refused now in one line
    (``PreflightError``): a model that is not there (a resume reads its checkpoint instead, but LoRA's base is
    the model), and unless ``dry_run``, a device, an inference back-end or an extra the config asks for that this
    machine lacks and an output directory it cannot write in (the hub: ``check_hub``)."""
    from pathlib import Path

    from scirl.deploy.preflight import check_backend, check_extras, check_model
    from scirl.errors import PreflightError

    if not resume or cfg.lora.enabled:
        check_model(cfg.model)
    if dry_run:
        return
    problem = (
        device_problem(None if cfg.device == "auto" else cfg.device, "--device")
        or attention_problem(cfg)
        or unwritable_dir(Path(cfg.output_dir), cfg.output_dir, "--output-dir")
    )
    if problem:
        raise PreflightError(problem)
    check_backend(cfg)
    check_extras(cfg)


def check_hub(cfg) -> None:
    """A hub model id the hub cannot give now (or the cache lacks, offline): refused in one line, in seconds."""
    from scirl.deploy.preflight import check_hub_model

    check_hub_model(cfg.model)


def attention_problem(cfg) -> str | None:
    """Why the trainer cannot train with ``cfg.attention`` on the device it would get (flex off CUDA), or None."""
    if cfg.attention != "flex":
        return None
    import torch

    from scirl.trainer.attention import cannot_train

    device = cfg.device if cfg.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    return cannot_train(cfg.attention, torch.device(device))


def memory_plan(cfg, *, dry_run: bool) -> tuple[int, str | None]:
    """Each trainer GPU's memory plan (``scirl.run.memory``), before any weight loads: (2, None) after its
    one line when it cannot fit, else (0, what to print on stdout). ``--dry-run`` gets the whole plan (as TOML
    comments, so the output stays a config file) for the GPUs it would train on, whatever this machine has;
    a run is checked only when it trains on CUDA, and gets its verdict in one line. A CPU run has nothing to plan."""
    if cfg.device == "cpu":  # decided before torch is imported: a CPU run's launcher never needs it
        return 0, "# memory plan: none (device = cpu: no GPU to plan for)" if dry_run else None
    import torch

    from scirl.errors import PreflightError
    from scirl.run.memory import gpu_size, plan_run, trainer_ranks
    from scirl.run.memory_report import render, verdict
    from scirl.run.memory_staging import check_staging

    if not (dry_run or cfg.device.startswith("cuda") or torch.cuda.is_available()):
        return 0, None  # device = auto on a machine without CUDA: a CPU run (its staging is checked as it starts)
    gpu = gpu_size(cfg.deployment)
    ranks = trainer_ranks(cfg, os.environ.get("WORLD_SIZE"))
    try:
        planned = plan_run(cfg, ranks=ranks, gpu=gpu)
        staging = check_staging(cfg, ranks)  # the host memory a checkpoint stages
    except PreflightError as exc:
        return refused("scirl train", exc), None
    if os.environ.get("RANK", "0") != "0":
        return 0, None
    if isinstance(planned, str):
        if not dry_run:
            print(f"scirl train: note: {planned}", file=sys.stderr)
        return 0, f"# {planned}" if dry_run else None
    if dry_run:
        text = render(planned[0], gpu, planned[1]) + (f"\n{staging}" if staging else "")
        return 0, "\n".join(f"# {line}".rstrip() for line in text.splitlines())
    return 0, f"memory plan: {verdict(planned[0], gpu, planned[1])}"


def deploy(cfg, config_args: list[str], *, resume: bool, clean: bool, **launch_options) -> int:
    """Servers plus trainer, started and supervised here (``scirl.deploy.launch``; ``launch_options``
    replace its programs, as tests do)."""
    from scirl.errors import DeployError, PreflightError, RunDirError

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        print(
            "scirl train: with deployment.num_infer_gpus > 0, run `scirl train` without torchrun: "
            "it starts the servers and torchrun itself",
            file=sys.stderr,
        )
        return 2
    from scirl.deploy.launch import launch

    try:
        return launch(cfg, config_args, resume=resume, clean=clean, **launch_options)
    except (PreflightError, RunDirError, DeployError) as exc:
        return refused("scirl train", exc)


def keep_freed_memory_on_cpu(device: str) -> None:
    """A CPU run keeps freed host memory in the process instead of page-faulting big tensors in again
    each step (``scirl.cpu.host_memory``). A process-wide setting: the command sets it, not the library."""
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        from scirl.cpu.host_memory import keep_freed_memory

        keep_freed_memory()
