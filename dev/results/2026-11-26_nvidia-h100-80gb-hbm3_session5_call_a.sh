set -o pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/llmc-site .whl/*.whl && export PYTHONPATH=/tmp/llmc-site || echo "wheel install failed"
( date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  timeout 120 python3 -m pytest -m gpu -q -rs tests/test_cuda_graph.py tests/test_llama3_cuda_graph.py; echo "pytest rc=$?"
  timeout 90 python3 dev/bench.py --only cupy -b 16 --cuda-graph 0 --json $OUT/bench_b16_graph0.json; echo "bench graph0 rc=$?"
  timeout 90 python3 dev/bench.py --only cupy -b 16 --cuda-graph 1 --json $OUT/bench_b16_graph1.json; echo "bench graph1 rc=$?"
  timeout 150 python3 dev/cuda/run_all.py layernorm rmsnorm rope repeat_kv swiglu -r 20; echo "run_all rc=$?"
) 2>&1 | tee $OUT/session5_call_a.log
