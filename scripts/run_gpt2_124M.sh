#!/bin/bash
# GPT-2 (124M) on FineWeb 10B on one node of 8 GPUs: llm.c's scripts/run_gpt2_124M.sh recipe.
# 124M parameters, 18,865 steps of 524,288 tokens (~10B tokens: one epoch of the sample).
# Needs: `python dev/data/fineweb.py` (data/fineweb10B/) and `python dev/data/hellaswag.py`.
# Run from anywhere: bash scripts/run_gpt2_124M.sh
# On one GPU: set gpus=1 below; gradient accumulation makes up the same 524,288 tokens per step.
set -u
cd "$(dirname "$0")/.." || exit 1

gpus=8
out_dir="log_gpt2_124M"
steps=18865
done_file=$(printf "%s/DONE_%08d" "$out_dir" "$steps")   # the checkpoint marker of the last step

# the run stops or crashes now and then on long jobs: loop, resuming from the newest checkpoint
while [ ! -f "$done_file" ]; do
    resume=0
    if compgen -G "$out_dir/DONE_*" > /dev/null; then resume=1; fi
    mpiexec -n "$gpus" python gpt2_cuda.py \
        -i "data/fineweb10B/fineweb_train_*.bin" \
        -j "data/fineweb10B/fineweb_val_*.bin" \
        -o "$out_dir" \
        -v 250 -s 20000 -g 144 \
        -h 1 \
        -b 64 -t 1024 \
        -d 524288 \
        -r 0 \
        -z 1 \
        -c 0.1 \
        -l 0.0006 \
        -q 0.0 \
        -u 700 \
        -n 5000 \
        -x "$steps" \
        -y "$resume" \
        -e d12
    sleep 1
done
echo "$done_file exists: training is complete"
