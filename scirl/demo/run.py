"""The demo pipeline: make the questions, evaluate the base model, run cold-start GRPO (or another
algorithm, ``--algorithm NAME``), evaluate again.

Everything is offline. The questions come from ``scirl.demo.world`` (open-book
science MCQs in SciKnowEval's schema, 4 domains), written as a JSONL file that
``scirl.task.data.load_splits`` reads and splits exactly as ``scirl train`` does, so
the held-out questions are ones the RL phase never sees. The base model is the
one shipped in ``scirl/assets/demo-base`` (built by ``scirl.demo.pretrain``).
Training is scirl's own trainer (``scirl.run.train.train``) with ``configs/demo.toml``, in this process; with
``--deployment.num-infer-gpus N`` it is ``scirl train``'s launcher (``scirl.deploy.launch``) instead: N vLLM
servers and ``deployment.num_train_gpus`` trainer ranks, the guide's layout, on a CPU.
"""

from __future__ import annotations

import json
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from scirl.demo.world import EVAL_PER_DOMAIN, TRAIN_PER_DOMAIN, generate_reading_rows
from scirl.deploy.launch import launch
from scirl.deploy.preflight import check_backend, check_extras, check_packages
from scirl.errors import ConfigError, Stopped, TrainError
from scirl.eval import provenance
from scirl.eval.local import evaluate_generator
from scirl.run.backends import hf_generator, inference_backend
from scirl.run.config_io import load_config
from scirl.run.train import train
from scirl.synth.questions import write_jsonl

PACKAGE_DIR = Path(__file__).resolve().parents[1]
BASE_MODEL_DIR = PACKAGE_DIR / "assets" / "demo-base"
DEMO_CONFIG = PACKAGE_DIR / "configs" / "demo.toml"  # scirl/configs links to the repo's configs/, so a wheel ships them


@dataclass
class DemoOptions:
    output_dir: Path
    seed: int = 0
    base_model: Path = BASE_MODEL_DIR
    config: Path = DEMO_CONFIG
    train_per_domain: int = TRAIN_PER_DOMAIN  # questions per domain generated for the RL phase
    eval_per_domain: int = EVAL_PER_DOMAIN  # held-out questions per domain
    eval_max_tokens: int = 8
    overrides: list[str] = field(default_factory=list)  # extra dotted config flags, e.g. ["--max-steps", "5"]
    report: bool = True
    progress: bool = True
    # with inference servers: stand-ins for the launcher's programs (``scirl.deploy.launch.launch``'s
    # ``server_command`` and ``trainer_program``), as tests pass them
    launch_options: dict = field(default_factory=dict)


def fresh_output_dir(root: str | Path = "outputs") -> Path:
    """``outputs/demo-YYYYmmdd-HHMMSS`` (with a suffix if that already exists)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(root) / f"demo-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = Path(root) / f"demo-{stamp}-{n}"
    return path


def write_questions(path: str | Path, train_per_domain: int, eval_per_domain: int, seed: int) -> Path:
    return write_jsonl(generate_reading_rows(train_per_domain + eval_per_domain, seed=seed), path)


def evaluate(model_dir: Path, questions, out: Path, max_tokens: int, progress: bool) -> dict:
    """Greedy evaluation of ``model_dir`` on ``questions``, written to ``out`` in scirl eval's format: the run in
    ``out.parent`` held them out (checked in ``run_demo``), as the file records."""
    generator = hf_generator(model_dir, device="cpu", dtype="float32")
    try:
        return evaluate_generator(
            generator,
            questions,
            temperature=0.0,
            max_tokens=max_tokens,
            out=out,
            settings={"model": str(model_dir), "data": "scirl demo held-out"},
            overwrite=True,
            progress=progress,
            trained_on=provenance.checked(out.parent, "train", [], allowed=False),
        )
    finally:
        generator.close()


def answer_letters(results: dict) -> dict[str, int]:
    """How often each letter was answered (None: no answer parsed): a collapse to one letter shows here."""
    counts: dict[str, int] = {}
    for record in results["records"]:
        for answer in record["answers"]:
            key = answer if answer is not None else "none"
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def print_before_after(console, before: dict, after: dict, algorithm: str = "grpo") -> None:
    table = Table(title="Held-out accuracy (greedy, questions the RL phase never saw)")
    for column in ("", "questions", "base", f"after {algorithm.upper()}", "change"):
        table.add_column(column, justify="left" if not column else "right")

    def row(name, n, a, b):
        change = f"{100 * (b - a):+.1f} pts" if a is not None and b is not None else "-"
        table.add_row(
            name,
            str(n),
            f"{100 * a:.1f}%" if a is not None else "-",
            f"{100 * b:.1f}%" if b is not None else "-",
            change,
        )

    row("overall", after["counts"]["answered"], before["overall_accuracy"], after["overall_accuracy"])
    for domain in sorted(set(before["per_domain_accuracy"]) | set(after["per_domain_accuracy"])):
        row(
            domain,
            after["counts"]["per_domain"].get(domain, 0),
            before["per_domain_accuracy"].get(domain),
            after["per_domain_accuracy"].get(domain),
        )
    console.print(table)
    console.print(
        f"strict-format accuracy: {100 * before['strict_accuracy']:.1f}% -> {100 * after['strict_accuracy']:.1f}%; "
        f"answer letters before {answer_letters(before)}, after {answer_letters(after)}"
    )


BACKEND_NAMES = {"hf": "transformers", "vllm": "vLLM"}


def sampling_backend(cfg) -> str:
    """``hf`` or ``vllm``: what samples the rollouts (the demo trains on the CPU, where ``auto`` is ``hf``;
    inference servers are vLLM's)."""
    if uses_servers(cfg):
        return "vllm"
    return inference_backend(cfg, torch.device(cfg.device if cfg.device != "auto" else "cpu"))


def uses_servers(cfg) -> bool:
    return cfg.deployment.num_infer_gpus > 0


def layout(cfg) -> str:
    """Where the demo's training ran, in words (servers and ranks: started by scirl train's launcher)."""
    if uses_servers(cfg):
        return f"{cfg.deployment.num_infer_gpus} vLLM server(s) + {cfg.deployment.num_train_gpus} trainer rank(s)"
    return f"colocated: one process samples with {BACKEND_NAMES[sampling_backend(cfg)]} and trains"


def mean_of(metrics: list[dict], *keys: str) -> float | None:
    """The mean over the rows that have them of the sum of ``keys`` (None: no row has them all)."""
    sums = [sum(m[key] for key in keys) for m in metrics if all(key in m for key in keys)]
    return round(statistics.fmean(sums), 3) if sums else None


def run_demo(opts: DemoOptions) -> dict:
    """Run the whole demo; return a summary dict (also written to ``OUTPUT_DIR/demo_summary.json``)."""
    console = Console()
    started = time.perf_counter()
    out = Path(opts.output_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"output directory {out} is not empty; pass a new --output-dir")
    if not (opts.base_model / "config.json").is_file():
        raise FileNotFoundError(
            f"base model not found in {opts.base_model}; rebuild it with "
            f"`python -m scirl.demo.pretrain --out {opts.base_model}`"
        )
    if not Path(opts.config).is_file():
        raise FileNotFoundError(f"demo config not found: {opts.config}")
    # the config first, so a bad flag leaves no half-made output directory behind
    data_path = out / "data" / "demo_questions.jsonl"
    fixed = {"model": str(opts.base_model), "output_dir": str(out), "data.source": str(data_path)}
    # Overrides come last, so they win over the demo's defaults; only `fixed` is refused below. The
    # inference backend is one of them: `--inference.backend vllm` samples with an in-process vLLM
    # engine. Eager by default: compiling buys the tiny model no decode speed on a CPU and costs
    # 20-60 s of start-up (`--inference.no-enforce-eager` to compile anyway).
    config_args = [
        "@",
        str(opts.config),
        "--model",
        fixed["model"],
        "--output-dir",
        fixed["output_dir"],
        "--data.source",
        fixed["data.source"],
        "--data.eval-per-domain",
        str(opts.eval_per_domain),
        "--data.split",
        "train",
        "--seed",
        str(opts.seed),
        "--inference.enforce-eager",
        *opts.overrides,
    ]
    cfg = load_config(config_args)
    for key, value in fixed.items():  # an override of these would train one thing and evaluate another
        section, _, name = key.rpartition(".")
        if str(getattr(getattr(cfg, section) if section else cfg, name)) != value:
            raise ConfigError(
                f"the demo sets --{key.replace('_', '-')} itself; use --base-model, --output-dir "
                "(or scirl train for other data)"
            )
    if cfg.deployment.num_train_gpus > 1 and not uses_servers(cfg):
        raise ConfigError(
            "the demo trains colocated in one process: --deployment.num-train-gpus needs "
            "--deployment.num-infer-gpus N (N vLLM servers beside the trainer ranks)"
        )
    if uses_servers(cfg) and "server_command" not in opts.launch_options:
        check_packages(cuda=False)  # now, not after the base model's evaluation
    check_backend(cfg)  # likewise: --inference.backend vllm where vLLM is not installed
    check_extras(cfg)  # and the extras it asks for (W&B, LoRA)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(opts.seed)

    # 1. questions: one file; the trainer and the evaluation split it the same way
    console.rule("[bold]1/4 questions")
    write_questions(data_path, opts.train_per_domain, opts.eval_per_domain, opts.seed)
    splits = cfg.data.load_splits()
    held_out = splits.eval
    overlap = {q.id for q in held_out} & {q.id for q in splits.train}
    if overlap:  # load_splits guarantees this; the demo's claim rests on it, so check it
        raise RuntimeError(f"{len(overlap)} held-out questions are also in the training split")
    console.print(
        f"{len(splits.train)} training questions, {len(held_out)} held-out questions "
        f"({opts.eval_per_domain} per domain), written to {data_path}"
    )

    # 2. the base model on the held-out questions
    console.rule("[bold]2/4 evaluating the base model")
    console.print(f"base model: {opts.base_model}")
    before = evaluate(opts.base_model, held_out, out / "eval_base.json", opts.eval_max_tokens, opts.progress)
    console.print(f"base held-out accuracy: {100 * before['overall_accuracy']:.1f}%")

    # 3. cold-start RL with scirl's trainer: in this process, or scirl train's launcher with its servers and ranks
    backend = sampling_backend(cfg)
    algorithm = cfg.algorithm.upper()
    if uses_servers(cfg):
        console.rule(f"[bold]3/4 cold-start {algorithm}: {cfg.max_steps} steps, {layout(cfg)}")
        status = launch(cfg, config_args, **opts.launch_options)
    else:
        console.rule(f"[bold]3/4 cold-start {algorithm}: {cfg.max_steps} steps, sampling with {BACKEND_NAMES[backend]}")
        status = train(cfg, show_progress=opts.progress)
    if status > 128:  # stopped by a signal (Ctrl-C: 130) after its checkpoint: the run says how to resume it
        raise Stopped(
            f"training stopped by {signal.Signals(status - 128).name} before step {cfg.max_steps}; no final "
            f"evaluation. Its logs and checkpoints are in {out}",
            status,
        )
    if status != 0:
        raise TrainError(
            f"training stopped (status {status}) before step {cfg.max_steps}; no final evaluation. "
            f"Its logs and checkpoints are in {out}"
        )
    final_weights = out / "weights" / f"step_{cfg.max_steps}"

    # 4. the trained model on the same held-out questions
    console.rule("[bold]4/4 evaluating the trained model")
    after = evaluate(final_weights, held_out, out / "eval_final.json", opts.eval_max_tokens, opts.progress)

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [m.get("reward/mean") for m in metrics]
    summary = {
        "base_accuracy": before["overall_accuracy"],
        "final_accuracy": after["overall_accuracy"],
        "gain_points": 100 * (after["overall_accuracy"] - before["overall_accuracy"]),
        "base_per_domain": before["per_domain_accuracy"],
        "final_per_domain": after["per_domain_accuracy"],
        "base_strict_accuracy": before["strict_accuracy"],
        "final_strict_accuracy": after["strict_accuracy"],
        "answer_letters_base": answer_letters(before),
        "answer_letters_final": answer_letters(after),
        "reward_first_steps": rewards[: max(1, len(rewards) // 5)],
        "reward_last_steps": rewards[-max(1, len(rewards) // 5) :],
        # how fast: the first step whose training reward reached 0.9, over all the batch's rollouts (an algorithm that
        # drops flat groups leaves the all-correct ones out of reward/mean)
        "first_step_reward_0.9": next((m["step"] for m in metrics if (m.get("reward/mean_all") or 0) >= 0.9), None),
        "algorithm": cfg.algorithm,
        # a step's own work (generation, the train step, the weight push), without eval and checkpoints
        "seconds_per_step": mean_of(metrics, "time/generate", "time/train", "time/weight_sync"),
        "train_seconds_per_step": mean_of(metrics, "time/train"),
        "steps": cfg.max_steps,
        "inference_backend": backend,
        "layout": layout(cfg),
        "held_out_questions": len(held_out),
        "train_questions": len(splits.train),
        "seconds": round(time.perf_counter() - started, 1),
    }
    (out / "demo_summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    console.rule("[bold]result")
    print_before_after(console, before, after, cfg.algorithm)
    try:
        from scirl.report import write_report
    except ImportError:
        console.print("(scirl.report is not available: no HTML report written)")
    else:
        if opts.report:
            try:
                console.print(f"report: {write_report(out)}")
            except Exception as exc:  # the results are on disk already; a report failure must not hide them
                console.print(f"[yellow]report not written: {exc}[/] (retry with: scirl report {out})")
    console.print(f"run directory: [bold]{out}[/]  ({summary['seconds']:.0f}s in all)")
    return summary
