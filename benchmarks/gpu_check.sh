#!/usr/bin/env bash
# GPU check of GRPO on one GPU, offline, in stages within a time budget (benchmarks/gpu_check/, a package
# of its stages, says what each measures; benchmarks/README.md, how to run it on a GPU machine with no network).
#
#   stage A, no vLLM: the transformers backend, 4 steps of 8 questions x 16 completions (prompts of
#     100-350 tokens, completions of mixed lengths up to 256) on a random model with Qwen3-0.6B's shapes,
#     a checkpoint before the last step (a_train); the training step alone by micro-batch tokens, with and
#     without activation checkpointing, compiled / eager / Liger kernels, flex / SDPA attention, deterministic
#     settings, on batches it has seen and on new ones, against the memory plan, torch.compile's graphs and
#     graph breaks counted, one step profiled (a_sweep); then the run killed (kill -9) in a checkpoint's write
#     and resumed: its final weights must equal the uninterrupted run's (a_resume; not by default at 1.7b and
#     larger); the peer benchmark's transformers pair, scirl beside TRL (a_peer, where TRL imports). Step split,
#     the trainer's token counts, useful tokens/s, MFU, the training peak, checkpoint MB/s and blocked seconds.
#   --stage targets, the first GPU call's: issue 41's figures first (a_sweep's targets rows: the default row,
#     the 20 GB row with checkpointing, smaller micro-batches; a_peer; a_sweep2, the default row at 1.7b),
#     then a_train (3 steps).
#   stage B, vLLM (where it imports): vLLM colocated, the adapter vs raw generation comparison, and
#     a vLLM server with the trainer beside it (weights over NCCL only with a GPU each).
#
# Every stage writes its figures to OUT/gpu_check.json as it ends. A stage that does not fit what is
# left of --budget-s (default 480 s) is skipped, its reason recorded; each has its own timeout. The
# outer timeout below is a backstop: the budget + 60 s, under the 600 s a command may take there.
#
# Python: $PYTHON if set, else the repo's .venv when there is one, else python3.
# Usage: bash benchmarks/gpu_check.sh [--stage all|a|b|targets] [--budget-s S] [--shape 0.6b|1.7b|4b|8b] [--steps N]
#                                      [--[no-]resume] [--micro-batch-tokens N] [--no-sweep] [--out DIR] [--json FILE]
#                                      [--cpu] [--eager]
#                                      [--disaggregated]
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# the repository's scirl, and the check itself (benchmarks/gpu_check, run as `python -m gpu_check`)
export PYTHONPATH="$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
# vLLM logs to stderr; a long run keeps them in the per-run log instead of the terminal
export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
# everything it loads is local: a hub lookup would only wait on a machine without network
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
# each recompilation's reason and each graph break, in the stages' logs (the counts are in the JSON)
export TORCH_LOGS="${TORCH_LOGS:-recompiles,graph_breaks}"
budget=480
previous=""
for arg in "$@"; do
  if [[ "$previous" == --budget-s ]]; then budget="$arg"; fi
  if [[ "$arg" == --budget-s=* ]]; then budget="${arg#--budget-s=}"; fi
  previous="$arg"
done
# a budget that is not a number: the Python side says so in one line
if [[ "$budget" =~ ^[0-9]+([.][0-9]*)?$ ]]; then backstop=$(( ${budget%.*} + 60 )); else backstop=540; fi
exec timeout --kill-after=15 "${GPU_CHECK_TIMEOUT:-$backstop}" "$PYTHON" -m gpu_check "$@"
