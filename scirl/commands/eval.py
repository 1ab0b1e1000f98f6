"""``scirl eval``: evaluate a served (vLLM, ``scirl serve``) or local model on the held-out MCQ questions.

    scirl eval --base-url http://localhost:18000/v1 --model grpo-step30 --n-samples 1 --concurrency 32 --out eval.json
    scirl eval --model path/to/hf_model_dir --out eval.json          # in-process, no server
    scirl eval --model path/to/hf_model_dir --permutations 4 --out perm.json   # 4 option orders per question
    scirl eval compare base.json trained.json [--json]              # paired difference + McNemar test

Every summary shows the letter bias (predicted vs gold letters, KL, accuracy by gold letter:
``scirl.eval.letters``); --permutations adds order robustness (``scirl.eval.permutations``).

A checkpoint of a run (``RUN/weights/step_N``, ``RUN/weights/latest``) or ``--run RUN`` makes the run's data
settings the defaults (source, format or columns, split method and seed, held-out size: its config.toml, or the
copy a checkpoint carries out of its run), so the evaluated questions are the ones it held out; a question the run
trained on is refused unless ``--allow-trained-questions``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from scirl.commands.parser import (
    Parser,
    add_data_format_args,
    add_split_args,
    data_format_problem,
    device_problem,
    finite_float,
    out_problem,
    url_problem,
)


def build_parser() -> argparse.ArgumentParser:
    from scirl.task.data import HUB_ID

    p = Parser(
        prog="scirl eval",
        description="Evaluate a model on science MCQ questions (SciKnowEval by default) through an OpenAI-compatible "
        "server (--base-url), or in-process from a local HF model directory (no --base-url). "
        "Rerunning with the same --out resumes. See also: scirl eval compare A.json B.json.",
    )
    p.add_argument("--base-url", default=None, help="server URL ending in /v1, e.g. http://localhost:8000/v1")
    p.add_argument(
        "--model",
        default=None,
        help="served model name (with --base-url), else a local HF model directory, "
        "such as a run's checkpoint RUN/weights/step_N or RUN/weights/latest (default with --run: the run's latest)",
    )
    p.add_argument(
        "--run",
        default=None,
        metavar="RUN_DIR",
        help="a scirl train run directory: its data settings are the defaults below, and a question it trained "
        "on is refused (default: the run of --model when that is one of its checkpoints)",
    )
    p.add_argument(
        "--allow-trained-questions",
        action="store_true",
        help="evaluate even questions the run trained on (its training split), with a warning",
    )
    p.add_argument(
        "--out", required=True, help="results JSON; answers are appended to OUT's .records.jsonl as they arrive"
    )
    p.add_argument(
        "--data",
        default=None,
        help="hub id (a known set's: REPO[:CONFIG][@SPLIT]), raw_data directory or one "
        f".jsonl/.json/.parquet file (default: the run's, else {HUB_ID})",
    )
    add_data_format_args(p, default=None)
    p.add_argument(
        "--split",
        default=None,
        choices=("eval", "train"),
        help="default: eval (a run's held-out split: the one it did not train on)",
    )
    add_split_args(p, run_defaults=True)
    p.add_argument("--limit", type=int, default=None, help="only the first N questions of the split")
    p.add_argument("--n-samples", type=int, default=1, help="samples per question; reports mean@k and pass@k")
    p.add_argument("--temperature", type=finite_float, default=0.0, help="default: %(default)s (greedy)")
    p.add_argument("--top-p", type=finite_float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=1024, help="completion tokens per sample (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed sent with each request")
    p.add_argument(
        "--permutations",
        type=int,
        default=1,
        metavar="K",
        help="ask each question under K option orders: order 0 is the question's own, the others seeded; "
        "reports consistent accuracy, mean accuracy over orders and how often the chosen text changes "
        "(default: %(default)s, no permutations)",
    )
    p.add_argument("--permutation-seed", type=int, default=0, help="seed of the option orders (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (default: %(default)s)")
    p.add_argument("--timeout", type=finite_float, default=120.0, help="per request, seconds (default: %(default)s)")
    p.add_argument(
        "--retries", type=int, default=6, help="retries per request after the first try (default: %(default)s)"
    )
    p.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY); never printed or saved")
    p.add_argument(
        "--device", default=None, help="torch device for a local model (default: cuda if available, else cpu)"
    )
    p.add_argument("--batch-size", type=int, default=32, help="questions per generate call for a local model")
    p.add_argument(
        "--max-reply-chars",
        type=int,
        default=None,
        help="replies longer than this are stored cut to it and counted (a server that ignores "
        "max_tokens); default: 16 x --max-tokens, at least 4096",
    )
    p.add_argument("--overwrite", action="store_true", help="discard answers recorded with other settings")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _check(args, settings) -> str | None:
    if args.n_samples < 1:
        return "--n-samples must be >= 1"
    if args.permutations < 1:
        return f"--permutations must be >= 1 (1: only the question's own order), got {args.permutations}"
    if args.permutation_seed < 0:
        return "--permutation-seed must be >= 0"
    if args.concurrency < 1:
        return "--concurrency must be >= 1"
    if args.max_tokens < 1:
        return "--max-tokens must be >= 1"
    if args.temperature < 0:
        return "--temperature must be >= 0"
    if not 0 < args.top_p <= 1:
        return "--top-p must be in (0, 1]"
    if args.max_reply_chars is not None and args.max_reply_chars < 1:
        return "--max-reply-chars must be >= 1"
    if args.seed is not None and not 0 <= args.seed < 2**63:
        return "--seed must be in 0..2**63-1"
    if not settings.model.strip():
        return "--model must not be empty"
    if args.timeout <= 0:
        return "--timeout must be > 0"
    if args.retries < 0:
        return "--retries must be >= 0"
    if args.limit is not None and args.limit < 1:
        return "--limit must be >= 1"
    if args.batch_size < 1:
        return "--batch-size must be >= 1"
    problem = data_format_problem(args)
    if problem:
        return problem
    if args.base_url is not None:
        problem = url_problem(args.base_url)
        if problem:
            return problem
    elif not (Path(settings.model) / "config.json").is_file():
        return f"without --base-url, --model must be a local HF model directory; {settings.model} has no config.json"
    problem = out_problem(args.out)
    if problem:
        return problem
    return device_problem(args.device, "--device")


def run_eval(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from scirl.errors import ConfigError
    from scirl.run.eval_settings import DATA_FLAGS, resolve

    try:
        settings = resolve(
            model=args.model,
            run=args.run,
            served=args.base_url is not None,
            given={key: getattr(args, key) for key in DATA_FLAGS},
            split=args.split,
        )
    except ConfigError as e:
        print(f"scirl eval: {e}", file=sys.stderr)
        return 2
    problem = _check(args, settings)
    if problem:
        print(f"scirl eval: {problem}", file=sys.stderr)
        return 2
    from scirl.eval.results import OutInUse, lock_out

    try:
        lock = lock_out(args.out)  # held until this process ends: one evaluation per --out
    except (OutInUse, OSError) as e:
        print(f"scirl eval: {e}", file=sys.stderr)
        return 2
    try:
        return _run_eval_locked(args, settings)
    finally:
        lock.close()


def _run_eval_locked(args, settings) -> int:
    if args.n_samples > 1 and args.temperature == 0:
        print(
            f"scirl eval: warning: with --temperature 0 the {args.n_samples} samples per question are identical "
            "(greedy), so pass@k equals mean@k; give a --temperature > 0 to sample",
            file=sys.stderr,
        )

    from scirl.errors import ConfigError
    from scirl.eval.display import print_summary
    from scirl.eval.results import BadRecordsFile, SettingsMismatch, check_resumable
    from scirl.run.eval_settings import load_questions

    try:
        questions, trained_on, lines = load_questions(settings, limit=args.limit, allowed=args.allow_trained_questions)
    except ConfigError as e:  # data it cannot read, an empty split, questions the run trained on
        print(f"scirl eval: {e}", file=sys.stderr)
        return 2
    model, data_settings = settings.model, settings.recorded(args.limit)
    orders = {"permutations": args.permutations, "permutation_seed": args.permutation_seed}
    if args.base_url:
        from scirl.eval.client import ClientConfig, FatalServerError, evaluate_server, server_settings

        cfg = ClientConfig(
            base_url=args.base_url,
            model=model,
            api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
            n_samples=args.n_samples,
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=args.max_tokens,
            seed=args.seed,
            timeout=args.timeout,
            retries=args.retries,
            concurrency=args.concurrency,
            max_reply_chars=args.max_reply_chars,
        )
        recorded = server_settings(cfg, **data_settings)
    else:
        recorded = {
            "model": str(Path(model).resolve()),
            "n_samples": args.n_samples,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "max_tokens": args.max_tokens,
            "seed": args.seed,
            **data_settings,
        }
    try:
        if not args.overwrite:  # before any model loads or request goes, which may take minutes
            check_resumable(args.out, {**recorded, **orders})
        for line in lines:  # accepted: which questions, and how they stand to a run's training split
            print(f"scirl eval: {line}", file=sys.stderr)
        if args.base_url:
            try:
                results = evaluate_server(
                    questions,
                    cfg,
                    out=args.out,
                    settings=recorded,
                    overwrite=args.overwrite,
                    progress=not args.no_progress,
                    trained_on=trained_on,
                    **orders,
                )
            except FatalServerError as e:  # no server there, or one that refuses every request: its settings
                print(f"scirl eval: {e}", file=sys.stderr)
                return 2
        else:
            from scirl.eval.local import evaluate_generator
            from scirl.run.backends import hf_generator

            generator = hf_generator(model, device=args.device)
            try:
                results = evaluate_generator(
                    generator,
                    questions,
                    n_samples=args.n_samples,
                    temperature=args.temperature,
                    top_p=args.top_p,
                    max_tokens=args.max_tokens,
                    seed=args.seed,
                    out=args.out,
                    overwrite=args.overwrite,
                    batch_size=args.batch_size,
                    progress=not args.no_progress,
                    settings={"model": recorded["model"], **data_settings},
                    trained_on=trained_on,
                    **orders,
                )
            finally:
                generator.close()
    except (SettingsMismatch, BadRecordsFile) as e:  # the records file at --out cannot be resumed
        print(f"scirl eval: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "\nscirl eval: interrupted; the answers so far are saved. Rerun the same command to resume.",
            file=sys.stderr,
        )
        return 130
    except OSError as e:  # e.g. a full disk while appending answers or writing the results
        print(
            f"scirl eval: {e}; the answers recorded so far are kept: fix this and rerun the same command to resume",
            file=sys.stderr,
        )
        return 1

    print_summary(results)
    print(f"wrote {args.out}")
    return 1 if results["counts"]["failed"] else 0


def run_compare(argv: list[str]) -> int:
    p = Parser(
        prog="scirl eval compare",
        description="Paired comparison of two results files on their common questions (first sample), with McNemar's "
        "test, and how much of the difference a shift of the letter prior alone explains (A's accuracy per picked "
        "letter, reweighted by how often B picks each letter).",
    )
    p.add_argument("a", help="results JSON of the baseline (A)")
    p.add_argument("b", help="results JSON of the candidate (B)")
    p.add_argument("--json", action="store_true", help="print the comparison as one JSON object")
    args = p.parse_args(argv)

    from scirl.eval.display import print_compare
    from scirl.eval.stats import compare, pairing_problem

    loaded = []
    for path in (args.a, args.b):
        try:
            data = json.loads(Path(path).read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            print(f"scirl eval compare: {path} is not UTF-8 text, so not a scirl eval results file", file=sys.stderr)
            return 2
        except (OSError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
            print(f"scirl eval compare: cannot read {path}: {e}", file=sys.stderr)
            return 2
        if not isinstance(data, dict) or not isinstance(data.get("records"), list):
            print(f"scirl eval compare: {path} is not a scirl eval results file (no records)", file=sys.stderr)
            return 2
        if not all(
            isinstance(r, dict) and isinstance(r.get("id"), str) and isinstance(r.get("correct"), bool)
            for r in data["records"]
        ):
            print(
                f"scirl eval compare: {path}: every record needs an 'id' (text) and 'correct' (true/false)",
                file=sys.stderr,
            )
            return 2
        loaded.append(data)
    problem = pairing_problem(args.a, args.b, *loaded)
    if problem:
        print(f"scirl eval compare: {problem}", file=sys.stderr)
        return 2
    result = compare(*loaded)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_compare(result, args.a, args.b)
    return 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "compare":
        return run_compare(argv[1:])
    return run_eval(argv)
