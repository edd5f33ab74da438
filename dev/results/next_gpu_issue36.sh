# dev/results/next_gpu_issue36.sh: issue 36's GPU call, about 3 to 4 minutes on an H100 (each step has
# its own timeout, the most needed first; logs and tables land in $OUT). From the repository root:
#   bash dev/results/next_gpu_issue36.sh
# 1. dev/cuda/tensor_core.py: the fragment layouts as the GPU computes them (doc/tensor_cores.md, section 2)
# 2. dev/cuda/matmul.py at GPT-2 124M's layer shapes, B = 16, T = 1024: versions 3-8 forward (qkv,
#    attproj, fc, fcproj), 4, 5, 8 backward and the GELU layer (fc); version 8 at both of its tiles
#    (block 128, 256); versions 1-2 left out (seconds a call). Table: $OUT/layers/dev_cuda_matmul.md.
#    Each version is validated against gpt2_cpu.py at full size first (most of the step's time).
# 3. the GPU tests of the instructions and of versions 6-8 (ragged edges, the raster groups)
# 4. the classifier, 768 -> 50304: cuBLASLt (5) against version 8 (validating its (16384, 50304)
#    output takes ~10 s a version on the CPU). Table: $OUT/classifier/dev_cuda_matmul.md
# 5. dev/cuda/matmul_tiles.py: version 8 at other tiles (BK 64, more stages, 256 x 128) beside the
#    shipped ones, against cuBLASLt: $OUT/dev_cuda_matmul_tiles.md (the step to drop if time is short)
# The ratio the issue asks for: each shape's best version 8 TFLOP/s over version 5's (cuBLASLt) in
# the same table; doc/tensor_cores.py's TENSOR_CORE_TABLE then names the recorded layers table.
set -o pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/llmc-site .whl/*.whl && export PYTHONPATH=/tmp/llmc-site || echo "wheel install failed"
( date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  timeout 60 python3 dev/cuda/tensor_core.py; echo "tensor_core.py rc=$?"
  timeout 150 python3 dev/cuda/matmul.py --versions 3-8 --exclude '*classifier*' -r 20 -o $OUT/layers; echo "matmul.py layers rc=$?"
  timeout 60 python3 -m pytest -m gpu -q -rs tests/test_tensor_cores.py tests/test_matmul_tensor_cores.py; echo "pytest rc=$?"
  timeout 100 python3 dev/cuda/matmul.py --versions 5,8 --exclude '*_qkv,*_attproj,*_fc,*_fcproj,*llama3*' -r 20 -o $OUT/classifier; echo "matmul.py classifier rc=$?"
  timeout 90 python3 dev/cuda/matmul_tiles.py -o $OUT; echo "matmul_tiles.py rc=$?"
) 2>&1 | tee $OUT/issue36.log
