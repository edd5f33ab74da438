# dev/results/next_gpu_issue40.sh: issue 40's GPU measurements, for one device call (about 5 minutes
# expected, every command under its own time limit; run from the repository root with data/ and
# .whl/ carried, $OUT the call's output folder):
#     run(command="bash dev/results/next_gpu_issue40.sh", carry=["data", ".whl"], timeout_s=420)
# Most important last-but-one: the bench of ours and the twin at B=16 and 64 (the issue's targets).
# What it measures (dev/results/README.md, "Next GPU session: issue 40"):
#   1. the new kernels and the whole step as one CUDA graph on the GPU: bitwise graph == eager with the
#      GPU defaults, with --residual-epilogue 1 and --classifier-chunk 2, with accumulation; AdamW v4
#      and the norm's clipping factor against gpt2_cpu.py; --check of the 124M model with both options;
#   2. ours at B=16 with the defaults (the graph on, the two new options off), then with the residual
#      epilogue only: the options' gains are measured against this, in this call;
#   3. ours and the twin at B=16 and 64 with both options (chunk 4), and ours at B=64 without the chunk:
#      tok/s, MFU, memory (the chunk's saving at B=64), each with its breakdown, in the JSON files;
#   4. dev/cuda's AdamW (v3 against v4) and global norm tables: GB/s against the copy bandwidth.
set -o pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/llmc-site .whl/*.whl \
    && export PYTHONPATH=/tmp/llmc-site || echo "wheel install failed"
step() {   # step LIMIT NAME COMMAND...: run it under `timeout LIMIT`, then one line with its status and seconds
    local limit=$1 name=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@"; local rc=$?
    echo "### $name: rc=$rc in $((SECONDS - start)) s (limit $limit s)"
}
( date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log -1 --format=%h 2>/dev/null
  step 75 gpu-tests python3 -m pytest -m gpu -q -rs tests/test_cuda_graph.py tests/test_cuda.py tests/test_zero.py \
      -k "whole_step or adamw_norm or stochastic or pieces or graph_steps"
  step 45 check-options python3 gpt2_cuda.py --check -e d12 -b 4 -t 64 --residual-epilogue 1 --classifier-chunk 3
  step 45 bench-b16-defaults python3 dev/bench.py --only cupy -b 16 --json $OUT/bench_b16_defaults.json
  step 45 bench-b16-residual python3 dev/bench.py --only cupy -b 16 --residual-epilogue 1 \
      --json $OUT/bench_b16_residual.json
  step 210 bench-16-64-both python3 dev/bench.py --batch-sizes 16,64 --residual-epilogue 1 --classifier-chunk 4 \
      --json $OUT/bench_16_64_residual_chunk4.json
  step 45 bench-b64-nochunk python3 dev/bench.py --only cupy -b 64 --residual-epilogue 1 \
      --json $OUT/bench_b64_residual.json
  step 45 dev-cuda python3 dev/cuda/run_all.py adamw global_norm -r 20 -o $OUT
) 2>&1 | tee $OUT/issue40.log
