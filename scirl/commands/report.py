"""``scirl report RUN_DIR [--out DIR]`` and ``scirl report --compare A.json B.json [--out DIR]``."""

from __future__ import annotations

import argparse
import sys

from scirl.commands.parser import Parser


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="scirl report",
        description="Plots and a one-page, self-contained HTML summary of a run (or a comparison of two evaluations).",
        epilog="Before/after accuracy: eval_base.json and eval_final.json by name, "
        "else the oldest and newest eval_*.json by modification time.",
    )
    parser.add_argument("run_dir", nargs="?", help="run directory (metrics.jsonl, config.toml, rollouts/, eval_*.json)")
    parser.add_argument("--out", help="output directory (default: RUN_DIR/report, or B's directory with --compare)")
    parser.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="compare two scirl eval results files")
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.compare) == bool(args.run_dir):
        parser.error("give either RUN_DIR or --compare A.json B.json")

    from pathlib import Path

    from scirl.eval.display import trained_lines
    from scirl.report import write_compare, write_report  # matplotlib is imported only when needed
    from scirl.report.inputs import run_dir_problem

    def warn(line: str) -> None:
        print(f"scirl report: warning: {line}", file=sys.stderr)

    try:
        if args.compare:
            page, comparison = write_compare(*args.compare, out_dir=args.out)
            if comparison is None:  # records that do not say which answers were right: the page says why
                print("no paired comparison: see the page's notes")
            else:
                m = comparison["mcnemar"]
                print(
                    f"paired on {comparison['common_questions']} questions: "
                    f"A {100 * comparison['accuracy_a']:.1f}% -> B {100 * comparison['accuracy_b']:.1f}% "
                    f"({100 * comparison['difference']:+.1f} pts), McNemar {m['method']} p = {m['p_value']:.3g}"
                )
                for line in trained_lines(comparison, *args.compare):
                    warn(line)
        else:
            problem = run_dir_problem(Path(args.run_dir))
            if problem:
                raise ValueError(problem)
            page = write_report(args.run_dir, out_dir=args.out, warn=warn)
    except (OSError, ValueError) as e:  # a missing run or file, files with nothing to pair, an --out not a directory
        print(f"scirl report: {e}", file=sys.stderr)
        return 2
    print(page)
    return 0
