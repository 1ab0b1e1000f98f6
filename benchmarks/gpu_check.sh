#!/usr/bin/env bash
# GPU check of GRPO on one GPU, offline, in stages within a time budget (benchmarks/gpu_check.py says
# what each stage measures; benchmarks/README.md, how to run it on a GPU machine with no network).
#
#   stage A, no vLLM: the transformers backend, 5 steps of 128 completions x 256 tokens on a random
#     model with Qwen3-0.6B's shapes (a_train); the training step alone by micro-batch size, with and
#     without activation checkpointing, default and deterministic kernels, against the memory plan, and
#     one step profiled (a_sweep); then the run killed (kill -9) in a checkpoint's write and resumed: its
#     final weights must equal the uninterrupted run's (a_resume; not by default at 1.7b and larger).
#     Step split, tokens/s, MFU, peak memory, checkpoint MB/s.
#   stage B, vLLM (where it imports): vLLM colocated, the adapter vs raw generation comparison, and
#     a vLLM server with the trainer beside it (weights over NCCL only with a GPU each).
#
# Every stage writes its figures to OUT/gpu_check.json as it ends. A stage that does not fit what is
# left of --budget-s (default 480 s) is skipped, its reason recorded; each has its own timeout. The
# outer timeout below is a backstop: the budget + 60 s, under the 600 s a command may take there.
#
# Python: $PYTHON if set, else the repo's .venv when there is one, else python3.
# Usage: bash benchmarks/gpu_check.sh [--stage all|a|b] [--budget-s S] [--shape 0.6b|1.7b|4b|8b] [--steps N]
#                                      [--[no-]resume] [--no-sweep] [--out DIR] [--json FILE] [--cpu] [--eager]
#                                      [--disaggregated]
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# vLLM logs to stderr; a long run keeps them in the per-run log instead of the terminal
export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
# everything it loads is local: a hub lookup would only wait on a machine without network
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
budget=480
previous=""
for arg in "$@"; do
  if [[ "$previous" == --budget-s ]]; then budget="$arg"; fi
  if [[ "$arg" == --budget-s=* ]]; then budget="${arg#--budget-s=}"; fi
  previous="$arg"
done
# a budget that is not a number: the Python side says so in one line
if [[ "$budget" =~ ^[0-9]+([.][0-9]*)?$ ]]; then backstop=$(( ${budget%.*} + 60 )); else backstop=540; fi
exec timeout --kill-after=15 "${GPU_CHECK_TIMEOUT:-$backstop}" "$PYTHON" benchmarks/gpu_check.py "$@"
