#!/bin/bash
# The second device call of 2026-11-26 (H100): after the quick run, rerun the four GPU tests that
# failed there (with the fixes), then what the quick run leaves of issue 27 and the Llama 3 GPU run,
# each step with its own limit and skipped when it would end past the call's deadline.
# Logs to $OUT; run from the repository root with data/ and .whl/ carried.
START=$SECONDS; DEADLINE=${DEADLINE:-370}; LOG=$OUT/followup.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/llmc-site .whl/*.whl
export PYTHONPATH=/tmp/llmc-site PYTHONUNBUFFERED=1
step() {  # step LIMIT_S COMMAND...: run it under timeout if it fits before the deadline
    local limit=$1; shift
    if (( SECONDS - START + limit > DEADLINE )); then echo "NOT RUN (deadline): $*" | tee -a $LOG; return; fi
    echo -e "\n\$ $*" | tee -a $LOG; local t0=$SECONDS
    timeout -k 5 $limit "$@" 2>&1 | tee -a $LOG; local rc=${PIPESTATUS[0]}
    echo "exit status $rc ($((SECONDS - t0)) s)" | tee -a $LOG
    echo "rc=$rc $((SECONDS - t0))s $*" >> $OUT/summary.txt
}
step 100 python3 -m pytest -m gpu -v -rs tests/test_cublaslt.py tests/test_gpu_training_shapes.py -k "backward_lt or every_kernel or grid_stride"
step 30 python3 llama3_cuda.py --check --precision fp32 -f 0
step 30 python3 llama3_cuda.py --check --precision bf16
step 30 python3 llama3_cuda.py --check --precision bf16 --attention flash
step 40 python3 llama3_cuda.py -x 100 -v 50 -s 100
step 45 python3 dev/bench.py --only cupy --attention cudnn --cublaslt 1 --steps 10 --warmup 3 --breakdown-top 12 --json $OUT/bench_cudnn_cublaslt.json
step 45 python3 dev/bench.py --only cupy --attention flash --cuda-graph 1 --steps 10 --warmup 3 --breakdown-top 12 --json $OUT/bench_flash_graph.json
step 70 python3 gpt2_cuda.py -e d12 -b 16 -t 1024 -x 300 -v 50 -m 20 -s 0 -o $OUT/log124M
step 35 python3 dev/bench.py --only cupy --batch-sizes 32,64 --steps 10 --warmup 3 --breakdown-top 5 --json $OUT/bench_default_32_64.json
step 100 python3 dev/bench.py --only torch --batch-sizes 32,64 --steps 10 --warmup 3 --json $OUT/bench_twin_32_64.json
step 40 make train
cat $OUT/summary.txt
