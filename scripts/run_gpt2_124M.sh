#!/bin/bash
# GPT-2 (124M) on FineWeb 10B on one node of 8 GPUs: llm.c's scripts/run_gpt2_124M.sh recipe.
# 124M parameters, 18,865 steps of 524,288 tokens (~10B tokens: one epoch of the sample).
# Needs: `python dev/data/fineweb.py` (data/fineweb10B/) and `python dev/data/hellaswag.py`.
# Run from anywhere: bash scripts/run_gpt2_124M.sh
# On one GPU: set gpus=1 below; gradient accumulation makes up the same 524,288 tokens per step.
set -u
cd "$(dirname "$0")/.." || exit 1
# shellcheck source=gpt2_recipe.sh
source scripts/gpt2_recipe.sh         # GPT2_RECIPE (llm.c's flags), run_until_done

gpus=8
out_dir="log_gpt2_124M"
steps=18865
run_until_done "$(printf "%s/DONE_%08d" "$out_dir" "$steps")" \
    mpiexec -n "$gpus" python gpt2_cuda.py "${GPT2_RECIPE[@]}" -e d12 -d 524288 -l 0.0006 -x "$steps" \
    -i "data/fineweb10B/fineweb_train_*.bin" -j "data/fineweb10B/fineweb_val_*.bin" -o "$out_dir" -s 20000 -n 5000
