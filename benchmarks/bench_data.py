"""How long load_splits takes on a data set the size of SciKnowEval's MCQ part (18,670 rows).

Usage: python benchmarks/bench_data.py [--rows-per-domain 4668]
Prints wall and CPU seconds for the file read alone and for the whole load (validate, dedupe, split).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from scirl.synth import questions as synthetic
from scirl.task import data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows-per-domain", type=int, default=4668)
    args = parser.parse_args()
    rows = synthetic.generate_rows(n_per_domain=args.rows_per_domain, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        path = synthetic.write_jsonl(rows, Path(tmp) / "rows.jsonl")
        for method in data.SPLIT_METHODS:
            wall, cpu = time.perf_counter(), time.process_time()
            data.read_source(str(path))
            read_wall, read_cpu = time.perf_counter() - wall, time.process_time() - cpu
            wall, cpu = time.perf_counter(), time.process_time()
            splits = data.load_splits(str(path), split_method=method)
            load_wall, load_cpu = time.perf_counter() - wall, time.process_time() - cpu
            print(
                f"{method:8s} {splits.mcq_read} MCQ rows: read {read_wall:.2f} s wall / {read_cpu:.2f} s CPU; "
                f"load_splits {load_wall:.2f} s wall / {load_cpu:.2f} s CPU "
                f"(train {len(splits.train)}, eval {len(splits.eval)})"
            )


if __name__ == "__main__":
    main()
