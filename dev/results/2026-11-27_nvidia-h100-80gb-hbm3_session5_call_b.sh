#!/bin/bash
# dev/results/2026-11-27_session5_call_b.sh: the fifth session's second GPU call, the issues' GPU work in
# one command (data/ and .whl/ carried), most needed first. Each step runs under the smaller of its
# own limit and the time left before DEADLINE seconds; a step with under 20 s left is NOT RUN.
#   1. dev/cuda/matmul.py, layer shapes (d12, B=16, T=1024): cuBLASLt (5) against the tensor-core versions 6-8 (issue 36)
#   2. dev/cuda/attention.py at 124M's heads (B=16, T=1024, NH=12, HS=64), forward and backward: cuDNN (4)
#      against the mma.sync versions 3, 6-8 and candidates 9-11 (issue 37)
#   3. dev/bench.py at B=16: ours with the defaults (the whole step as one CUDA graph, cuDNN, cuBLASLt)
#      and the PyTorch twin (issue 40)
#   4. ours at B=16 with --attention flash (issue 37: within 10% of the default)
#   5. dev/cuda/matmul.py, the classifier 768 -> 50304: cuBLASLt (5) against version 8 (issue 36)
#   6. dev/ncu_memory_counters.py: the emulated device's memory counters against Nsight Compute (issue 38)
#   7. the GPU tests of the new kernels and of the whole-step graph
#   8. ours at B=16 with --residual-epilogue 1 --classifier-chunk 4 (issue 40's options)
#   9. dev/cuda/attention.py at Llama 3 8B's grouped-query heads (issue 37)
START=$SECONDS; DEADLINE=${DEADLINE:-455}; LOG=$OUT/call_b.log
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
step 130 python3 dev/cuda/matmul.py --versions 5-8 --exclude '*classifier*' -r 10 -o $OUT/mm_layers
step 90 python3 dev/cuda/attention.py --versions 3,4,6,7,8,9,10,11 --progressions attention_forward,attention_backward -r 10 -o $OUT/attn_124M
step 150 python3 dev/bench.py -b 16 --steps 10 --warmup 3 --breakdown-top 15 --json $OUT/bench_b16.json
step 40 python3 dev/bench.py --only cupy -b 16 --attention flash --steps 10 --warmup 3 --breakdown-top 10 --json $OUT/bench_flash_b16.json
step 60 python3 dev/cuda/matmul.py --versions 5,8 --exclude '*_qkv,*_attproj,*_fc,*_fcproj,*gelu*,*llama3*' -r 10 -o $OUT/mm_classifier
step 45 python3 dev/ncu_memory_counters.py
step 70 python3 -m pytest -m gpu -q -rs tests/test_tensor_cores.py tests/test_matmul_tensor_cores.py tests/test_cuda_graph.py tests/test_cuda.py -k "tensor_cores or cuda_graph or flash"
step 40 python3 dev/bench.py --only cupy -b 16 --residual-epilogue 1 --classifier-chunk 4 --steps 10 --warmup 3 --breakdown-top 10 --json $OUT/bench_options_b16.json
step 40 python3 dev/cuda/attention.py --versions 4,8 --progressions attention_forward_gqa,attention_backward_gqa -r 10 -o $OUT/attn_gqa
echo "call_b: $((SECONDS - START)) s" | tee -a $LOG
