"""``scirl data stats|export``: inspect the MCQ splits and write one out as SciKnowEval-schema JSON lines."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from scirl.commands.parser import Parser, add_data_format_args, add_split_args, data_format_problem, unwritable_parent


def add_source_args(parser: argparse.ArgumentParser) -> None:
    from scirl.task.data import HUB_ID
    from scirl.task.schema import MCQ_TYPES

    parser.add_argument(
        "--data",
        default=HUB_ID,
        help=f"hub id (default {HUB_ID}; or a known set's, REPO[:CONFIG][@SPLIT], e.g. allenai/ai2_arc:ARC-Easy), "
        "hf:<dataset dir or id>, a directory with raw_data/<Domain>/<Level>/<task>.jsonl, "
        "or one .jsonl/.json/.parquet file",
    )
    add_data_format_args(parser)
    parser.add_argument(
        "--types", default=",".join(MCQ_TYPES), help="comma-separated row types that count as MCQ (default %(default)s)"
    )
    add_split_args(parser)
    parser.add_argument(
        "--seed", dest="old_seed", default=None, help=argparse.SUPPRESS
    )  # --split-seed's old name: refused


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="scirl data", description="Inspect and export the MCQ splits of SciKnowEval or another science MCQ set."
    )
    sub = parser.add_subparsers(dest="action", required=True)
    stats = sub.add_parser("stats", help="counts per domain, type, level and split, and skipped rows by reason")
    add_source_args(stats)
    stats.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    export = sub.add_parser(
        "export",
        help="write one split's rows as JSON lines in SciKnowEval's schema (SciKnowEval rows "
        "keep their original fields)",
    )
    add_source_args(export)
    export.add_argument("--split", choices=("train", "eval"), required=True)
    export.add_argument("--out", required=True, help="output .jsonl path")
    return parser


def load(args: argparse.Namespace):
    from scirl.task.data import load_splits

    types = tuple(t.strip() for t in args.types.split(",") if t.strip())
    if not types:
        raise ValueError("--types must name at least one row type")
    return load_splits(
        args.data,
        types=types,
        eval_per_domain=args.eval_per_domain,
        split_method=args.split_method,
        seed=args.split_seed,
        data_format=args.data_format,
        columns=args.data_columns,
    )


def print_tables(summary: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    # every name below comes from the data (or the command line): printed literally, never read as markup
    console = Console()
    held = ", ".join(f"{kind} {n}" for kind, n in summary["mcq_types"].items()) or "none"  # what the source holds
    console.print(
        f"[bold]{escape(str(summary['source']))}[/] ({escape(str(summary['format']))}): "
        f"{summary['rows']} rows read, {summary['mcq']} MCQ "
        f"({escape(held)}); split {summary['split_method']!r}, "
        f"{summary['eval_per_domain']} eval per domain, split seed {summary['split_seed']}"
    )
    for title, key in (("domain", "per_domain"), ("type", "per_type"), ("level", "per_level")):
        table = Table(title=f"by {title}")
        for col in (title, "train", "eval", "total"):
            table.add_column(col, justify="left" if col == title else "right")
        for name, counts in summary[key].items():
            table.add_row(
                escape(str(name)), str(counts["train"]), str(counts["eval"]), str(counts["train"] + counts["eval"])
            )
        table.add_row(
            "[bold]all[/]", str(summary["train"]), str(summary["eval"]), str(summary["train"] + summary["eval"])
        )
        console.print(table)
    table = Table(title="MCQ rows skipped, by reason")
    table.add_column("reason")
    table.add_column("rows", justify="right")
    for reason, n in summary["skipped"].items():
        table.add_row(escape(str(reason)), str(n))
    table.add_row("[bold]all[/]", str(summary["skipped_total"]))
    console.print(table)
    if summary["non_mcq"]:
        console.print(
            "not MCQ (read, not used): " + escape(", ".join(f"{t} {n}" for t, n in summary["non_mcq"].items()))
        )
    for note in summary["notes"]:
        console.print(f"[yellow]note:[/] {escape(str(note))}")


def out_problem(out: str, data: str) -> str | None:
    """Why --out cannot be written (checked before the data is read), or None."""
    path = Path(out).expanduser()
    if not out.strip():
        return "--out must name a file"
    if path.is_dir():
        return f"--out {out} is a directory; give a file name such as {path / 'eval.jsonl'}"
    source = Path(data).expanduser()
    if source.exists() and path.exists() and path.resolve() == source.resolve():
        return f"--out {out} is the --data file itself: exporting would overwrite the source; write elsewhere"
    return unwritable_parent(path, out)


def export(splits, split: str, out: str) -> int:
    path = Path(out).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = splits.split(split)
    tmp = path.with_name(path.name + ".tmp")  # written aside, then renamed: a kill never leaves half a file at --out
    with tmp.open("w", encoding="utf-8") as f:
        for q in rows:
            f.write(json.dumps(q.raw, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    print(f"wrote {len(rows)} {split} rows to {path}", file=sys.stderr)
    return len(rows)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    import logging

    from scirl.task.data import DataSourceError

    if args.action == "stats":
        # stats reports the counts and notes itself; the loader's per-row warnings would repeat them
        logging.getLogger("scirl.task.data").setLevel(logging.ERROR)

    if args.old_seed is not None:
        print(
            "scirl data: error: --seed is now --split-seed (its name in scirl eval, and data.split_seed in scirl "
            "train)",
            file=sys.stderr,
        )
        return 2
    problem = data_format_problem(args)
    if problem:
        print(f"scirl data: error: {problem}", file=sys.stderr)
        return 2
    if args.action == "export":
        problem = out_problem(args.out, args.data)
        if problem:
            print(f"scirl data: error: {problem}", file=sys.stderr)
            return 2
    try:
        splits = load(args)
    except (DataSourceError, OSError, ValueError) as e:  # a hub out of reach too: a missing resource, before work
        print(f"scirl data: error: {e}", file=sys.stderr)
        return 2
    if args.action == "stats":
        summary = splits.summary()
        if args.json:
            print(json.dumps(summary, ensure_ascii=False))
        else:
            print_tables(summary)
        return 0
    try:
        export(splits, args.split, args.out)
    except OSError as e:  # e.g. a full disk: the source and any earlier --out file are untouched
        print(f"scirl data: error: cannot write {args.out}: {e}", file=sys.stderr)
        return 1
    return 0
