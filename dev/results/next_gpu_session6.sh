#!/bin/bash
# dev/results/next_gpu_session6.sh: what the fifth session's GPU calls left (dev/results/README.md,
# "Next GPU session"), one command, most needed first; each step under the smaller of its limit and
# the time left before DEADLINE seconds (a step with under 20 s left is NOT RUN). Run from the
# repository root with data/ and .whl/ carried: bash dev/results/next_gpu_session6.sh
#   1. the GPU's tensor-core instructions against the emulated device's (issue 36), Llama 3's flash
#      path reading the kv heads in place (issue 37), and the emulated memory counters against
#      Nsight Compute's (issue 38)
#   2. the classifier's backward, versions 5 and 8, and version 8's other tiles (issue 36)
#   3. the Llama 3 padded-vocabulary bench, ours and the twin (issue 41)
#   4. B=64, ours and the twin, with and without the classifier chunk (issue 40)
#   5. dev/cuda's AdamW, global-norm, classifier and layernorm tables (issue 40; the block
#      reductions of global_norm and fused_classifier, and layernorm_backward's two row sums in one
#      shuffle, changed on 2026-11-27 for the emulated device's speed, issue 42: timed on no GPU yet)
START=$SECONDS; DEADLINE=${DEADLINE:-480}; LOG=$OUT/session6.log
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/llmc-site .whl/*.whl \
    && export PYTHONPATH=/tmp/llmc-site || echo "wheel install failed" | tee -a $LOG
step() {  # step LIMIT_S COMMAND...
    local limit=$1; shift
    local left=$((DEADLINE - (SECONDS - START)))
    (( left < limit )) && limit=$left
    if (( limit < 20 )); then echo "NOT RUN (deadline): $*" | tee -a $LOG; return; fi
    echo -e "\n\$ $*   [limit ${limit} s]" | tee -a $LOG; local t0=$SECONDS
    timeout -k 5 $limit "$@" 2>&1 | tee -a $LOG; local rc=${PIPESTATUS[0]}
    echo "### rc=$rc in $((SECONDS - t0)) s: $*" | tee -a $LOG
}
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } 2>&1 | tee -a $LOG
step 60 python3 -m pytest -m gpu -q -rs tests/test_tensor_cores.py
step 60 python3 llama3_cuda.py -e llama3:d4 --check --attention flash --precision bf16
step 60 python3 dev/ncu_memory_counters.py
step 150 python3 dev/cuda/matmul.py --versions 5,8 --exclude '*_qkv,*_attproj,*_fc,*_fcproj,*gelu*,*llama3*,matmul_forward_*' -r 10 -o $OUT/mm_classifier
step 150 bash dev/results/next_gpu_issue41.sh
step 150 python3 dev/bench.py -b 64 --steps 10 --warmup 3 --json $OUT/bench_b64.json
step 40 python3 dev/bench.py --only cupy -b 64 --classifier-chunk 4 --steps 10 --warmup 3 --json $OUT/bench_b64_chunk4.json
step 100 python3 dev/cuda/run_all.py adamw global_norm classifier layernorm -r 20 -o $OUT
step 90 python3 dev/cuda/matmul_tiles.py -o $OUT
echo "session6: $((SECONDS - START)) s" | tee -a $LOG
