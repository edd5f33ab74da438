#!/bin/bash
# dev/results/next_gpu_session9.sh: every open GPU item in one command (dev/results/README.md, "Next
# GPU session"), the open issues' first; each step under the smaller of its limit and the time left
# before DEADLINE seconds (a step with under 20 s left is NOT RUN). Run from the repository root with
# data/ and .whl/ carried: bash dev/results/next_gpu_session9.sh
# (written in the eighth session, 2026-11-27; the ninth added --bias-grad-epilogue 0 and dev/cuda/bias.py
# and put issue 41's record after issue 40's B=64, issue 41 being resolved without a GPU)
#   0. the autotuning's and the bias gradient's GPU tests (cuDNN's plans and cuBLASLt's algorithms through
#      the real libraries; plain dweight GEMMs with kernels/bias.cu's bias_backward, and DGELU_BGRAD, against
#      gpt2_cpu)
#   1. issue 40, the 124M step at B=16, ours, in this one call: the defaults, then
#      --autotune 8 (each cuBLASLt GEMM's heuristic's 8 best algorithms and each cuDNN attention graph's
#      first 8 plans timed, the fastest kept; the bench prints what each found), --gelu-fusion 1 and --gelu-fusion 0 (the fc GEMM with GELU_AUX_BIAS
#      ran at 333-462 TFLOP/s where the plain GEMMs of its size ran at 713), -r 0 (GELU's output kept:
#      its recomputation, gelu_forward, took 0.88 ms of the 32.5 ms step; 1.0 GiB more, 8 GiB
#      against the twin's 13), --cudnn-deterministic 0 (cuDNN's backward, 4.27 ms of the step, free to
#      sum dq in any order, as the twin's SDPA), -r 0 with --autotune 8, and --bias-grad-epilogue 0 (plain
#      dweight GEMMs and our bias_backward, now with 16-byte loads, instead of the BGRADB epilogue: the three
#      large BGRADB products took 1.2-1.3 ms more than plain ones, the old bias_backward 1.38 ms) and
#      --bias-grad-epilogue 2 (the same, the fc's bias gradient in the fcproj input gradient's DGELU_BGRAD)
#      dev/bench_compare.py then prints each of these runs against the defaults' (ratios, memory, the
#      device calls that moved most), from their JSON files, on the host
#   2. issue 40: dev/cuda's bias table (bias_backward's version 3, production since 2026-11-27, against
#      version 2, the previous one), then the classifier (version 3 against the candidates 4, the row kept in shared
#      memory, and 5, the row copied in by cp.async), global-norm, layernorm and AdamW tables (the block reductions of global_norm
#      and fused_classifier, and layernorm_backward's two row sums in one shuffle, changed on
#      2026-11-27: the earlier tables under dev/results/ are the baseline)
#   3. issue 40: B=64, ours and the twin, with and without the classifier chunk
#   4. left by issue 41 (resolved): the Llama 3 padded-vocabulary bench at llama3:d4 and llama3:d6, ours
#      and the twin (dev/results/next_gpu_issue41.sh)
#   5. left by other resolved issues: the GPU's tensor-core instructions against the emulated device's (36),
#      Llama 3's flash path reading the kv heads in place (37), the emulated memory counters against
#      Nsight Compute's (38), the classifier's matmul backward and version 8's tiles (36)
START=$SECONDS; DEADLINE=${DEADLINE:-480}; LOG=$OUT/session9.log
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/llmc-site .whl/*.whl \
    && export PYTHONPATH=/tmp/llmc-site || echo "wheel install failed" | tee -a $LOG
left() { echo $((DEADLINE - (SECONDS - START))); }
# A second call picks up where the first stopped: FROM=K skips steps 1 to K-1 (each step's log line
# begins with its number, "[K]"; the NOT RUN lines name the first step left), e.g.
#   FROM=13 DEADLINE=300 bash dev/results/next_gpu_session9.sh      (13: B=64, ours and the twin)
FROM=${FROM:-1}; NUMBER=0
step() {  # step LIMIT_S COMMAND...
    local limit=$1; shift
    NUMBER=$((NUMBER + 1))
    if (( NUMBER < FROM )); then return; fi
    local rest=$(left)
    (( rest < limit )) && limit=$rest
    if (( limit < 20 )); then echo "[$NUMBER] NOT RUN (deadline): $*" | tee -a $LOG; return; fi
    echo -e "\n[$NUMBER] \$ $*   [limit ${limit} s]" | tee -a $LOG; local t0=$SECONDS
    timeout -k 5 $limit "$@" 2>&1 | tee -a $LOG; local rc=${PIPESTATUS[0]}
    echo "[$NUMBER] ### rc=$rc in $((SECONDS - t0)) s: $*" | tee -a $LOG
}
BENCH16="python3 dev/bench.py --only cupy -b 16 --steps 10 --warmup 3 --breakdown-top 12"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } 2>&1 | tee -a $LOG
step 60 python3 -m pytest -m gpu -q -rs -s tests/test_cudnn_attention.py tests/test_cublaslt.py -k "autotuned or bias_grad"
step 70 $BENCH16 --json $OUT/bench_b16_default.json
step 45 $BENCH16 --autotune 8 --json $OUT/bench_b16_autotune8.json
step 35 $BENCH16 --gelu-fusion 1 --json $OUT/bench_b16_gelu1.json
step 35 $BENCH16 --gelu-fusion 0 --json $OUT/bench_b16_gelu0.json
step 35 $BENCH16 -r 0 --json $OUT/bench_b16_r0.json
step 35 $BENCH16 --cudnn-deterministic 0 --json $OUT/bench_b16_nondeterministic.json
step 35 $BENCH16 -r 0 --autotune 8 --json $OUT/bench_b16_r0_autotune8.json
step 35 $BENCH16 --bias-grad-epilogue 0 --json $OUT/bench_b16_bias_grad0.json
step 35 $BENCH16 --bias-grad-epilogue 2 --json $OUT/bench_b16_bias_grad2.json
step 20 python3 dev/bench_compare.py $OUT/bench_b16_default.json $OUT/bench_b16_*.json --top 6
step 100 python3 dev/cuda/run_all.py bias classifier global_norm layernorm adamw -r 20 -o $OUT
step 120 python3 dev/bench.py -b 64 --steps 10 --warmup 3 --json $OUT/bench_b64.json
step 40 python3 dev/bench.py --only cupy -b 64 --classifier-chunk 4 --steps 10 --warmup 3 --json $OUT/bench_b64_chunk4.json
step 200 env DEADLINE=$(( $(left) < 200 ? $(left) : 200 )) bash dev/results/next_gpu_issue41.sh
step 60 python3 -m pytest -m gpu -q -rs tests/test_tensor_cores.py
step 60 python3 llama3_cuda.py -e llama3:d4 --check --attention flash --precision bf16
step 60 python3 dev/ncu_memory_counters.py
step 150 python3 dev/cuda/matmul.py --versions 5,8 --exclude '*_qkv,*_attproj,*_fc,*_fcproj,*gelu*,*llama3*,matmul_forward_*' -r 10 -o $OUT/mm_classifier
step 90 python3 dev/cuda/matmul_tiles.py -o $OUT
echo "session9: $((SECONDS - START)) s" | tee -a $LOG
