#!/bin/bash
# dev/results/next_gpu_issue37.sh: the GPU call of issue 37, flash attention on mma.sync
# (kernels/flash_attention.cu, doc/flash_attention.md). In order of what matters most, each step
# under its own limit and skipped when it would end past the deadline (DEADLINE seconds, default
# 200: about 3 minutes on an H100):
#   1. the flash kernels' GPU tests: every head size, ragged T, grouped-query heads, bitwise reruns;
#   2. dev/cuda/attention.py at GPT-2 124M's shape (B=16, T=1024, NH=12, HS=64), forward and
#      backward: the previous kernel on mma.sync (3), cuDNN (4), the tensor-core steps (6, 7), the
#      production kernels (8) and the candidate tile shapes (9-11), each validated, then timed in
#      the same run (the naive version 1, the materialized 2 and PyTorch's 5 are left out: slow, or
#      timed before);
#   3. the 124M training step at B=16 with --attention flash, then with the default (cuDNN);
#   4. dev/cuda/attention.py at Llama 3 8B's grouped-query heads (B=2, T=1024, NH=32, NKV=8,
#      HS=128): the production kernels (8) against cuDNN on the repeated heads (4).
# Run from the repository root with .whl/ carried, OUT set:  bash dev/results/next_gpu_issue37.sh
# What to record in dev/results/ (doc/flash_attention.py reads the two tables by these names):
#   $OUT/issue37.log                      -> <date>_<device>_issue37.log
#   $OUT/dev_124M/dev_cuda_attention.md  -> <date>_<device>_issue37_124M_dev_cuda_attention.md
#   $OUT/dev_gqa/dev_cuda_attention.md   -> <date>_<device>_issue37_gqa_dev_cuda_attention.md
#   $OUT/bench_*_b16.json                 -> <date>_<device>_issue37_bench_*_b16.json
# Which candidate becomes production: the fastest of versions 8-11 in each table; its shape is in
# dev/cuda/attention.py's DEV_TILES, to copy into kernels/flash_attention.cu's typedefs and
# llmc/attention.py's FLASH_TILES (tests/test_flash_attention_host.py checks that the two agree).
START=$SECONDS; DEADLINE=${DEADLINE:-200}; LOG=$OUT/issue37.log
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
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git rev-parse HEAD; } 2>&1 | tee $LOG
step 50 python3 -m pytest -m gpu -q -rs tests/test_cuda.py -k "flash"
step 70 python3 dev/cuda/attention.py --versions 3,4,6,7,8,9,10,11 --progressions attention_forward,attention_backward -r 10 -o $OUT/dev_124M
step 30 python3 dev/bench.py --only cupy -b 16 --attention flash --steps 10 --warmup 3 --breakdown-top 12 --json $OUT/bench_flash_b16.json
step 30 python3 dev/bench.py --only cupy -b 16 --steps 10 --warmup 3 --breakdown-top 12 --json $OUT/bench_default_b16.json
step 40 python3 dev/cuda/attention.py --versions 4,8 --progressions attention_forward_gqa,attention_backward_gqa -r 10 -o $OUT/dev_gqa
cat $OUT/summary.txt | tee -a $LOG
