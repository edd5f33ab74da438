#!/bin/bash
# GPT-2 (350M) on one node of 8 GPUs: llm.c's scripts/run_gpt2_350M.sh recipe.
# 350M parameters, 60,000 steps of 524,288 tokens (31.5B tokens). llm.c reads FineWeb 100B; our
# dev/data/fineweb.py prepares the 10B sample, which this run then reads about three times.
# Needs: `python dev/data/fineweb.py` (data/fineweb10B/) and `python dev/data/hellaswag.py`.
# Run from anywhere: bash scripts/run_gpt2_350M.sh
set -u
cd "$(dirname "$0")/.." || exit 1
# shellcheck source=gpt2_recipe.sh
source scripts/gpt2_recipe.sh         # GPT2_RECIPE (llm.c's flags), run_until_done

gpus=8
steps=60000
run_until_done "$(printf "log_gpt2_350M/DONE_%08d" "$steps")" \
    mpiexec -n "$gpus" python gpt2_cuda.py "${GPT2_RECIPE[@]}" -e d24 -d 524288 -l 0.0003 -x "$steps" \
    -i "data/fineweb10B/fineweb_train_*.bin" -j "data/fineweb10B/fineweb_val_*.bin" -o log_gpt2_350M -s 100000 -n 2000
