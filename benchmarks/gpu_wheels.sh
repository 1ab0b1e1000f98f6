#!/usr/bin/env bash
# The wheels gpu_check's stage A needs on a GPU machine with no network whose Python 3.12 image lacks
# them (benchmarks/gpu_wheels.txt lists what the image holds and what travels), downloaded into .whl/
# (ignored by git) for CPython 3.12 on manylinux x86-64. Then checks that the downloads are exactly the
# list, one version each, with every wheel's own requirements met by the image or the other wheels,
# prints their total size (it travels with the working tree: 64 MiB at most, all in) and the one line
# that installs them on that machine.
#
# Needs pip and the network here (no GPU). Usage: bash benchmarks/gpu_wheels.sh [DIR]   (default .whl)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
DEST="${1:-.whl}"
mapfile -t PINS < <("$PYTHON" benchmarks/gpu_wheels.py list)
mkdir -p "$DEST"
# one version of each: a wheel left from an older list would be installed beside the new one
rm -f "$DEST"/*.whl
echo "downloading ${#PINS[@]} wheels into $DEST: ${PINS[*]}"
# pure-Python wheels match any of these platforms; pydantic-core's is manylinux 2.17
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" "${PINS[@]}"
exec "$PYTHON" benchmarks/gpu_wheels.py check "$DEST"
