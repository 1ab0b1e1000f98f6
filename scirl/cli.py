"""The ``scirl`` console command: dispatches ``scirl <command> ...`` to ``scirl.commands.<command>``."""

from __future__ import annotations

import importlib
import signal
import sys

from scirl import __version__
from scirl.extras import side_package_problem

COMMANDS = {
    "data": ("data", "inspect and export the MCQ splits (SciKnowEval or another science MCQ set)"),
    "eval": ("eval", "evaluate a served or local model on the held-out questions"),
    "serve": ("serve", "serve a local HF model over an OpenAI-compatible API (CPU)"),
    "train": ("train", "cold-start RL training (GRPO and its variants)"),
    "inference": ("inference", "one vLLM server for a run's model, for a trainer elsewhere (multi-node)"),
    "slurm": ("slurm", "a multi-node run as one Slurm job: write (and submit) its sbatch script"),
    "job": ("job", "run a multi-node job's parts on the nodes of an allocation (what `scirl slurm`'s script runs)"),
    "demo": ("demo", "offline end-to-end demo: evaluate, train, evaluate again"),
    "report": ("report", "plots and a one-page HTML summary of a run"),
    "export": ("export", "export the task for other frameworks (prime-rl)"),
    "dcp-to-hf": ("dcp_to_hf", "an HF model from a prime-rl DCP checkpoint"),
}


# the commands that load a model through transformers (``scirl eval compare`` does not)
LOAD_MODELS = {"eval", "serve", "train", "inference", "job", "demo", "dcp-to-hf"}


def usage() -> str:
    lines = ["usage: scirl <command> [options]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `scirl <command> --help` for the options of one command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"scirl {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"scirl: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if name in LOAD_MODELS and rest[:1] != ["compare"] and not {"-h", "--help"} & set(rest):
        problem = side_package_problem()  # before any work: a model load would end in a 75-line traceback
        if problem:
            print(f"scirl {name}: {problem}", file=sys.stderr)
            return 2
    try:
        module = importlib.import_module(f"scirl.commands.{COMMANDS[name][0]}")
        return int(module.main(rest) or 0)
    except KeyboardInterrupt:  # Ctrl-C wherever a command has no stop of its own: one line, and 128 + SIGINT
        print(f"\nscirl {name}: interrupted", file=sys.stderr)
        return INTERRUPTED


INTERRUPTED = 128 + signal.SIGINT  # 130, what a shell reports for a command Ctrl-C ended


if __name__ == "__main__":
    sys.exit(main())
