#!/usr/bin/env bash
# The wheels a GPU machine with no network and its own Python 3.12 image needs (benchmarks/gpu_wheels.txt lists
# what the image holds and what travels), for CPython 3.12 on manylinux x86-64.
#
#   bash benchmarks/gpu_wheels.sh [DIR]          stage A's wheels (scirl's requirements the image lacks, and TRL for
#                                                the peer benchmark's transformers pair) into DIR (default .whl,
#                                                ignored by git): one call carries them whole (13 wheels, ~5.3 MiB)
#   bash benchmarks/gpu_wheels.sh --vllm [DIR]   stage B's set as well (vLLM 0.25.0 and what it needs beyond the
#                                                image; ~330 MB) into DIR (default .vllm-set,
#                                                ignored by git): downloaded into DIR/wheels, checked, packed into one
#                                                tar, split into parts of at most 54,000,000 bytes, each in a folder
#                                                of its own (DIR/part01, ...), so that one part and the working tree
#                                                fit in what one call carries. benchmarks/gpu_install_set.sh puts the
#                                                parts together and installs them there; benchmarks/README.md gives
#                                                the whole sequence.
#
# Each checks that the downloads are exactly the list, one version each, with every wheel's own requirements met
# by the image or the other wheels. Needs pip and the network here (no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VLLM=0
if [[ "${1:-}" == --vllm ]]; then VLLM=1; shift; fi
DEST="${1:-$([[ $VLLM == 1 ]] && echo .vllm-set || echo .whl)}"

download() {  # DIR PIN...: pure-Python wheels match any of these platforms; llguidance's is manylinux 2.31
  local dir="$1"; shift
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "$@"
}

mapfile -t PINS < <("$PYTHON" benchmarks/gpu_wheels.py list)
if [[ $VLLM == 0 ]]; then
  mkdir -p "$DEST"
  rm -f "$DEST"/*.whl  # one version of each: a wheel left from an older list would be installed beside the new one
  echo "downloading ${#PINS[@]} wheels into $DEST: ${PINS[*]}"
  download "$DEST" "${PINS[@]}"
  exec "$PYTHON" benchmarks/gpu_wheels.py check "$DEST"
fi

mapfile -t VLLM_PINS < <("$PYTHON" benchmarks/gpu_wheels.py list-vllm)
mkdir -p "$DEST/wheels"
rm -f "$DEST"/wheels/*.whl
echo "downloading $(( ${#PINS[@]} + ${#VLLM_PINS[@]} )) wheels into $DEST/wheels"
download "$DEST/wheels" "${PINS[@]}" "${VLLM_PINS[@]}"
"$PYTHON" benchmarks/gpu_wheels.py check-vllm "$DEST/wheels"
"$PYTHON" benchmarks/gpu_wheels.py pack "$DEST"
echo "on the GPU machine, one call per part (carry the part's folder), back to back:"
for dir in "$DEST"/part[0-9]*; do
  echo "  carry [\"$dir\"]  command: bash benchmarks/gpu_install_set.sh --receive $dir"
done
echo "then, in the call that runs the check:  bash benchmarks/gpu_install_set.sh --install && export PYTHONPATH=/tmp/scirl-set/site"
