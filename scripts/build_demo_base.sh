#!/usr/bin/env bash
# Rebuild the demo's base model (scirl/assets/demo-base) from the project's own generated data.
# Seeded and offline; about 10 minutes on one CPU thread. See scirl/demo/pretrain.py for what it does.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-scirl/assets/demo-base}"
python -m scirl.demo.pretrain --out "$out" --steps 1100 --clean-steps 250 --layers 3 \
    --eval-every 100 --val-per-domain 50 --threads 1 --seed 0 --solved-share 0.125
