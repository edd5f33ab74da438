#!/bin/bash
# GPT-2 (350M) on one node of 8 GPUs: llm.c's scripts/run_gpt2_350M.sh recipe.
# 350M parameters, 60,000 steps of 524,288 tokens (31.5B tokens). llm.c reads FineWeb 100B; our
# dev/data/fineweb.py prepares the 10B sample, which this run then reads about three times.
# Needs: `python dev/data/fineweb.py` (data/fineweb10B/) and `python dev/data/hellaswag.py`.
# Run from anywhere: bash scripts/run_gpt2_350M.sh
set -u
cd "$(dirname "$0")/.." || exit 1

gpus=8
out_dir="log_gpt2_350M"
steps=60000
done_file=$(printf "%s/DONE_%08d" "$out_dir" "$steps")   # the checkpoint marker of the last step

while [ ! -f "$done_file" ]; do
    resume=0
    if compgen -G "$out_dir/DONE_*" > /dev/null; then resume=1; fi
    mpiexec -n "$gpus" python gpt2_cuda.py \
        -i "data/fineweb10B/fineweb_train_*.bin" \
        -j "data/fineweb10B/fineweb_val_*.bin" \
        -o "$out_dir" \
        -v 250 -s 100000 -g 144 \
        -h 1 \
        -b 64 -t 1024 \
        -d 524288 \
        -r 0 \
        -z 1 \
        -c 0.1 \
        -l 0.0003 \
        -q 0.0 \
        -u 700 \
        -n 2000 \
        -x "$steps" \
        -y "$resume" \
        -e d24
    sleep 1
done
echo "$done_file exists: training is complete"
