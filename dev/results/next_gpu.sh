#!/bin/bash
# dev/results/next_gpu.sh: every open GPU item in one command (dev/results/README.md, "Next GPU session"),
# the open issue's first; each step under the smaller of its limit and the time left before DEADLINE
# seconds (a step with under 20 s left is NOT RUN). Run from the repository root with data/ and .whl/
# carried: bash dev/results/next_gpu.sh
# Everything the steps write lands in $OUT/r/; at the end (and on any exit) it is packed into
# $OUT/results.tgz beside $OUT/next_gpu.log: the device tool returns at most 8 files from $OUT, and the
# tenth session's call, which left 24 there, lost its log that way.
# (written in the eighth session, 2026-11-27 as next_gpu_session8.sh; the tenth, after its H200 calls,
# kept only what those calls did not measure or lost, and made -r 0 the default; the eleventh, without a GPU,
# added the layernorm candidates; the twelfth, without a GPU, --ln-bias-grad)
#   1. the GPU tests the tenth session's calls lost or failed: the autotuned cuDNN plans (its assertion
#      fixed: the non-deterministic backward's graph is untimed) and the tensor-core instructions against
#      the emulated device's (issue 36); and the eleventh session's first micro-batch on the GPU's cuBLASLt:
#      BGRADB and DGELU_BGRAD writing the zeroed bias gradient give the accumulating path's bits; the
#      twelfth's --ln-bias-grad 1: the LayerNorm kernels with dprojb, and its whole-step graph equal to eager
#   2. the 124M --check on the GPU with the defaults of 2026-11-27 (-r 0, cuDNN, cuBLASLt), with
#      --bias-grad-epilogue 0 and with --ln-bias-grad 1, bf16, B=4, T=64
#   3. issue 40, the 124M step at B=16, ours and the twin: the defaults (now -r 0), --ln-bias-grad 1 (the
#      attention and MLP projections' bias gradients summed by the LayerNorm backward after each: their
#      dweight GEMMs without BGRADB, 0.7 ms faster on the H200's breakdown, less the third sum's cost; it
#      becomes the default if faster), then the candidates (the
#      ones that could reach 560K first), then the options timed before (in the order below: -r 1 ...); -r 1 (the old default:
#      2.5% slower on the H200); --autotune 8 (0.6% faster with -r 1; its run with -r 0 was lost);
#      --cudnn-deterministic 0 (1.0% faster with -r 1, but not bitwise repeatable); --bias-grad-epilogue 0
#      (the same speed with -r 1: plain dweight GEMMs 1.36 ms faster than BGRADB, bias_backward and its
#      bias_reduce 1.54 ms, of which the reduce 0.51 ms; the reduce now keeps 16 sums in flight: does level 0
#      now win?), --candidate classifier:4 (dev/cuda's classifier candidate 4, 4 loads in flight a thread, the
#      tenth session's candidate 5, launched in place of ours: the step with it), --candidate classifier:5 (the
#      eleventh session's: the row in registers, read from DRAM once), --candidate layernorm:5 and layernorm:6 (the eleventh session's: layernorm_param_reduce with
#      8 loads in flight, 14 us a call in the step; then also the backward's partial sums with x128 loads),
#      --bias-grad-epilogue 0 with --candidate bias:5 (bias_backward with 4 row loads in flight a lane), and all
#      the candidates at once (bias:5 at level 0, classifier:5, layernorm:6: how near 560K they come), and with
#      --ln-bias-grad 1 (classifier:5 and layernorm:6 at level 1; and all three at level 0); then
#      dev/bench_compare.py on them. The defaults' run also times the eleventh session's first micro-batch,
#      whose BGRADB writes the bias gradients into the zeroed dbias (48 residual_forward launches, 0.20 ms, gone;
#      the same bits: on this H200 its 13 losses should equal the tenth session's -r 0 run's)
#   4. dev/cuda's bias table (version 4, bias_reduce with 16 running sums, production since the tenth session
#      without a GPU, against version 3 with the one-sum reduce: version 3's reduce goes back if faster; the
#      candidate 5, 4 row loads in flight a lane), the
#      classifier's (its candidates 4, version 3 with 4 loads in flight per thread, and 5, the row in registers,
#      against version 3's 0.107 ms: the faster, if faster than 3 here and in the step, goes into kernels/), the layernorm table (candidates 5 and 6
#      against version 4's 0.0345 ms; and layernorm_backward_projection_bias: what the third sum costs, against
#      bias_backward over dinp), and the global-norm and AdamW tables
#   5. B=64, ours and the twin (the best B: 546K tok/s, 44.4% MFU on the H200 with -r 1)
#   6. left by issue 41 (resolved): the Llama 3 padded-vocabulary bench (dev/results/next_gpu_issue41.sh)
START=$SECONDS; DEADLINE=${DEADLINE:-480}; FINAL=$OUT; OUT=$OUT/r; LOG=$FINAL/next_gpu.log
mkdir -p $OUT
pack() { tar czf $FINAL/results.tgz -C $OUT . && rm -rf $OUT; }   # the steps' files: one file back
trap pack EXIT
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/llmc-site .whl/*.whl \
    && export PYTHONPATH=/tmp/llmc-site || echo "wheel install failed" | tee -a $LOG
left() { echo $((DEADLINE - (SECONDS - START))); }
# A second call picks up where the first stopped: FROM=K skips steps 1 to K-1 (each step's log line
# begins with its number, "[K]"; the NOT RUN lines name the first step left), e.g.
#   FROM=21 DEADLINE=300 bash dev/results/next_gpu.sh      (21: B=64, ours and the twin)
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
step 120 python3 -m pytest -m gpu -q -rs tests/test_cudnn_attention.py tests/test_tensor_cores.py tests/test_cublaslt.py tests/test_cuda.py tests/test_cuda_graph.py -k "autotuned or tensor or bias_grads_zero or layernorm_kernels or cublaslt_ln"
step 40 python3 gpt2_cuda.py --check -e d12 -b 4 -t 64 --precision bf16
step 40 python3 gpt2_cuda.py --check -e d12 -b 4 -t 64 --precision bf16 --bias-grad-epilogue 0
step 40 python3 gpt2_cuda.py --check -e d12 -b 4 -t 64 --precision bf16 --ln-bias-grad 1
step 80 python3 dev/bench.py -b 16 --steps 10 --warmup 3 --breakdown-top 12 --json $OUT/bench_b16_default.json
step 35 $BENCH16 --ln-bias-grad 1 --json $OUT/bench_b16_ln_bias_grad.json
step 35 $BENCH16 --candidate classifier:5 --json $OUT/bench_b16_classifier5.json
step 35 $BENCH16 --candidate layernorm:6 --json $OUT/bench_b16_layernorm6.json
step 35 $BENCH16 --bias-grad-epilogue 0 --candidate bias:5 --json $OUT/bench_b16_bias_grad0_bias5.json
step 35 $BENCH16 --bias-grad-epilogue 0 --candidate bias:5 --candidate classifier:5 --candidate layernorm:6 --json $OUT/bench_b16_all_candidates.json
step 35 $BENCH16 --ln-bias-grad 1 --candidate classifier:5 --candidate layernorm:6 --json $OUT/bench_b16_ln_candidates.json
step 35 $BENCH16 --ln-bias-grad 1 --bias-grad-epilogue 0 --candidate bias:5 --candidate classifier:5 --candidate layernorm:6 --json $OUT/bench_b16_ln_all_candidates.json
step 35 $BENCH16 --candidate classifier:4 --json $OUT/bench_b16_classifier4.json
step 35 $BENCH16 --candidate layernorm:5 --json $OUT/bench_b16_layernorm5.json
step 35 $BENCH16 --bias-grad-epilogue 0 --json $OUT/bench_b16_bias_grad0.json
step 35 $BENCH16 -r 1 --json $OUT/bench_b16_r1.json
step 45 $BENCH16 --autotune 8 --json $OUT/bench_b16_autotune8.json
step 35 $BENCH16 --cudnn-deterministic 0 --json $OUT/bench_b16_nondeterministic.json
step 20 python3 dev/bench_compare.py $OUT/bench_b16_default.json $OUT/bench_b16_r1.json $OUT/bench_b16_autotune8.json $OUT/bench_b16_nondeterministic.json $OUT/bench_b16_bias_grad0.json $OUT/bench_b16_classifier4.json $OUT/bench_b16_classifier5.json $OUT/bench_b16_layernorm5.json $OUT/bench_b16_layernorm6.json $OUT/bench_b16_bias_grad0_bias5.json $OUT/bench_b16_all_candidates.json $OUT/bench_b16_ln_bias_grad.json $OUT/bench_b16_ln_candidates.json $OUT/bench_b16_ln_all_candidates.json --top 6
step 100 python3 dev/cuda/run_all.py bias classifier layernorm global_norm adamw -r 20 -o $OUT
step 120 python3 dev/bench.py -b 64 --steps 10 --warmup 3 --json $OUT/bench_b64.json
step 200 env DEADLINE=$(( $(left) < 200 ? $(left) : 200 )) bash dev/results/next_gpu_issue41.sh
echo "next_gpu: $((SECONDS - START)) s" | tee -a $LOG
