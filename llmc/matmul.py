"""
llmc/matmul.py: gpt2_cuda.py's linear layers (llm.c's llmc/matmul.cuh and gelu.cuh): the products
through cuBLAS (column-major, llmc/cuda.py explains the trick), the bias and its gradient
(kernels/bias.cu), the GELU between the MLP's two layers (kernels/gelu.cu), and the two matmul
backends the model chooses between once (model.matmul): Cublas, and CublasLt with the bias, the
GELU and the bias gradient fused into the products (llmc/cublaslt.py). Launchers follow
gpt2_cuda.py's contract: check the arguments, compute the grid, launch into preallocated arrays,
outputs first.
"""

import numpy as np

from llmc import cuda
from llmc.cuda import (BLOCK_SIZE, CUBLAS_OP_N, CUBLAS_OP_T, WARP_SIZE, ceil_div, check_launch, elementwise_grid,
                       require, vector_size)

BIAS_BACKWARD_CHUNKS = 256             # row chunks (partial-sum slots) of bias_backward: fixed, so results reproduce


def matmul_forward(out, inp, weight, bias, B, T, C, OC, tf32=False):
    """out (B,T,OC) = inp (B,T,C) @ weight^T + bias, weight (OC,C) (nn.Linear layout), bias (OC,)
    or None. Column-major (llmc/cuda.py explains the trick), out^T (OC,N) = weight (OC,C) @ inp^T
    (C,N): weight's memory is the column-major (C,OC) matrix weight^T, so op(A) = T; inp's memory
    is already inp^T, op(B) = N. The GEMM writes the product (beta = 0), then add_bias adds the
    bias in place (kernels/bias.cu). tf32: fp32 inputs rounded to TF32 (the model's Cublas backend)."""
    N = B * T
    floatX = [("out", out, N * OC), ("inp", inp, N * C), ("weight", weight, OC * C)]
    check_launch("matmul_forward", floatX + ([("bias", bias, OC)] if bias is not None else []))
    cuda.gemm(CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, weight, C, inp, C, out, OC, tf32=tf32)
    if bias is not None:
        add_bias(out, bias, N, OC)


def add_bias(out, bias, N, OC):
    """out (N,OC) += bias (OC,) over every row, in place (kernels/bias.cu)."""
    vectorized = OC % vector_size(cuda.precision_of(out)) == 0
    precision = check_launch("add_bias", [("out", out, N * OC), ("bias", bias, OC)], aligned=vectorized)
    groups = N * OC // (vector_size(precision) if vectorized else 1)
    cuda.launch("bias", precision, "add_bias", elementwise_grid(groups), BLOCK_SIZE, (out, bias, np.int32(N), np.int32(OC)))


def matmul_backward(dinp, dweight, dbias, dout, inp, weight, partial, B, T, C, OC, tf32=False):
    """Backward of out = inp @ weight^T + bias (shapes as matmul_forward). Writes dinp (B,T,C);
    accumulates dweight (OC,C) and dbias (OC,) (either may be None: a frozen parameter, LoRA's base,
    whose gradient GEMM is skipped). partial: fp32 for bias_backward's partial sums.
        dinp     = dout @ weight     column-major: dinp^T (C,N) = weight^T (C,OC) @ dout^T (OC,N), both as stored
        dweight += dout^T @ inp      column-major: dweight^T (C,OC) = inp^T (C,N) @ dout (N,OC), op(B) = T
        dbias   += sum over rows of dout   (kernels/bias.cu)"""
    N = B * T
    trained = [("dweight", dweight, OC * C)] if dweight is not None else []
    check_launch("matmul_backward", [("dinp", dinp, N * C), ("dout", dout, N * OC), ("inp", inp, N * C),
                                     ("weight", weight, OC * C)] + trained)
    cuda.gemm(CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, weight, C, dout, OC, dinp, C, tf32=tf32)
    if dweight is not None:
        cuda.gemm(CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, inp, C, dout, OC, dweight, C, accumulate=True, tf32=tf32)
    if dbias is not None:
        bias_backward(dbias, dout, partial, N, OC)


def bias_backward(dbias, dout, partial, N, OC):
    """dbias (OC,) += column sums of dout (N,OC): kernels/bias.cu, per-chunk partial sums into
    partial (chunks, OC) fp32, then a second kernel adds the chunks in order (deterministic).
    bias_backward's block covers 32 groups of `width` columns (16-byte loads where OC allows them)
    and keeps each warp's sums in width floats per thread of shared memory."""
    chunks = bias_backward_chunks(N)
    vec = vector_size(cuda.precision_of(dout))
    width = vec if OC % vec == 0 else 1
    precision = check_launch("bias_backward", [("dbias", dbias, OC), ("dout", dout, N * OC)], aligned=width > 1,
                             unaligned=("dbias",))
    require(partial.dtype == np.float32 and partial.size >= chunks * OC, f"bias partial sums need {chunks * OC} floats")
    cuda.launch("bias", precision, "bias_backward", (ceil_div(OC, WARP_SIZE * width), chunks), BLOCK_SIZE,
                (partial, dout, np.int32(N), np.int32(OC)), shared_mem=BLOCK_SIZE * width * 4)
    cuda.launch("bias", precision, "bias_reduce", ceil_div(OC, BLOCK_SIZE), BLOCK_SIZE,
                (dbias, partial, np.int32(chunks), np.int32(OC)))


def bias_backward_chunks(N):
    """Row chunks (partial-sum slots) of bias_backward: fixed per N."""
    return min(BIAS_BACKWARD_CHUNKS, N)


def gelu_forward(out, inp, n, inp_bias=None, OC=0):
    """out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), elementwise over n values x of inp.
    With inp_bias (OC,), inp is (n/OC, OC) matmul outputs without their bias: the kernel first adds
    it into inp in place (inp is the pre-GELU activation the backward reads), then takes GELU."""
    bias_arg = [("inp_bias", inp_bias, OC)] if inp_bias is not None else []
    precision = check_launch("gelu_forward", [("out", out, n), ("inp", inp, n)] + bias_arg, aligned=True)
    if inp_bias is not None:
        require(OC % vector_size(precision) == 0 and n % OC == 0,
                f"gelu_forward: OC={OC} must be a multiple of {vector_size(precision)} dividing n={n}")
    cuda.launch("gelu", precision, "gelu_forward", elementwise_grid(ceil_div(n, vector_size(precision))), BLOCK_SIZE,
                (out, inp, np.uint64(0) if inp_bias is None else inp_bias, np.uint64(n), np.int32(OC)))


def gelu_backward_inplace(d_in_out, inp, n):
    """d_in_out = d_in_out * gelu'(inp): the gradient of gelu's output in, of its input out."""
    precision = check_launch("gelu_backward_inplace", [("d_in_out", d_in_out, n), ("inp", inp, n)], aligned=True)
    cuda.launch("gelu", precision, "gelu_backward_inplace", elementwise_grid(ceil_div(n, vector_size(precision))),
                BLOCK_SIZE, (d_in_out, inp, np.uint64(n)))


# The matmul backends (--cublaslt, -f): one object chosen once (setup_model) and kept on the model
# (model.matmul); every linear layer of the model goes through it, and its tf32 reaches every cuBLAS
# call the model makes (the attention's products too).

class Cublas:
    """The linear layers as cuBLAS GEMMs (matmul_forward, matmul_backward) with the bias and the
    GELU in our kernels. tf32: fp32 inputs rounded to TF32 (-f 1; bf16 ignores it).
    residual_epilogue: whether forward adds a residual inside the product (residual=); here never:
    the model adds it in its fused residual + LayerNorm kernel. pre_gelu_bias_grad: whether the
    fcproj layer's backward also sums the fc layer's bias gradient (CublasLt's DGELU_BGRAD); here
    never: the fc layer's own backward does."""
    name = "cuBLAS"
    residual_epilogue = False
    pre_gelu_bias_grad = False

    def __init__(self, tf32=False):
        self.tf32 = bool(tf32)

    def forward(self, out, inp, weight, bias, B, T, C, OC, pre_gelu=None):
        """out (B,T,OC) = inp (B,T,C) @ weight^T + bias (bias (OC,) or None). With pre_gelu (B,T,OC),
        the MLP's first layer: pre_gelu = inp @ weight^T + bias (kept for the backward) and out =
        gelu(pre_gelu); here the bias-free GEMM, then gelu_forward adds the bias into pre_gelu and
        takes GELU in one pass."""
        if pre_gelu is None:
            matmul_forward(out, inp, weight, bias, B, T, C, OC, self.tf32)
            return
        matmul_forward(pre_gelu, inp, weight, None, B, T, C, OC, self.tf32)
        gelu_forward(out, pre_gelu, B * T * OC, bias, OC)

    def backward(self, dinp, dweight, dbias, dout, inp, weight, partial, B, T, C, OC, pre_gelu=None,
                 pre_gelu_dbias=None, bias_grads_zero=False):
        """Backward of forward: writes dinp (B,T,C), accumulates dweight (OC,C) and dbias (OC,) (or
        None); partial fp32 for bias_backward's partial sums. With pre_gelu (B,T,C), inp was gelu(pre_gelu) and dinp
        is the gradient of pre_gelu: (dout @ weight) * gelu'(pre_gelu); with pre_gelu_dbias (C,) too
        (the bias gradient of the layer that computed pre_gelu), pre_gelu_dbias += the column sums
        of that dinp (the model passes it where pre_gelu_bias_grad says the backend sums it best).
        bias_grads_zero: dbias and pre_gelu_dbias hold 0 (the step's first micro-batch), which lets
        CublasLt write its epilogue's sums straight into them; here unused (bias_backward adds in
        the same launch that sums)."""
        matmul_backward(dinp, dweight, dbias, dout, inp, weight, partial, B, T, C, OC, self.tf32)
        if pre_gelu is not None:
            gelu_backward_inplace(dinp, pre_gelu, B * T * C)
        if pre_gelu_dbias is not None:
            require(pre_gelu is not None, "backward: pre_gelu_dbias without pre_gelu")
            bias_backward(pre_gelu_dbias, dinp, partial, B * T, C)


GELU_FUSION_CHOICES = (0, 1, 2)        # llm.c's -ge: 0 none, 1 the forward, 2 the forward and the backward
BIAS_GRAD_EPILOGUE_CHOICES = (0, 1, 2)  # 0 bias_backward; 1 BGRADB; 2 the fc's in DGELU_BGRAD, the rest bias_backward


def matmul_backend(requested, tf32=False, residual_epilogue=False, autotune=1, gelu_fusion=2, bias_grad_epilogue=1):
    """The linear layers' backend for --cublaslt `requested` (0, 1 or "auto"), TF32 `tf32`,
    --residual-epilogue `residual_epilogue`, --autotune `autotune`, --gelu-fusion `gelu_fusion`
    and --bias-grad-epilogue `bias_grad_epilogue` (the last four cuBLASLt's: cuBLAS ignores
    them): (backend, None), or
    (Cublas, one line saying why) where cuBLASLt was asked for and cannot load here. auto is
    cuBLASLt on a GPU (with the bias, GELU and bias gradient fused it was the faster backend on an
    H100, 2026-11-26: dev/results/) and cuBLAS on the emulated device (our own bias and GELU
    kernels, the path to read and debug)."""
    if requested == "auto":
        requested = cuda.device() == "cuda"
    if not requested:
        return Cublas(tf32), None
    from llmc import cublaslt
    reason = cublaslt.unavailable_reason()
    if reason:
        return Cublas(tf32), f"cuBLASLt unavailable ({reason}): using cuBLAS"
    return CublasLt(tf32, residual_epilogue, autotune, gelu_fusion, bias_grad_epilogue), None


class CublasLt(Cublas):
    """The linear layers through cuBLASLt (llmc/cublaslt.py): the bias, the GELU (GELU_AUX_BIAS,
    storing pre_gelu), its derivative (DGELU) and the bias gradient (BGRADB) fused into the GEMMs.
    bias_grad_epilogue: 1, each bias gradient in its dweight GEMM's BGRADB epilogue; 0, plain
    dweight GEMMs and bias_backward for every bias (also where cuBLASLt has no BGRADB algorithm for
    a shape); 2, as 0, but the fc layer's bias gradient summed in the fcproj input gradient's
    DGELU_BGRAD epilogue (with gelu_fusion 2: pre_gelu_bias_grad; the model passes it there). On an
    H100 the BGRADB products were slower than the plain ones by about what bias_backward took:
    which wins is measured (dev/bench.py --bias-grad-epilogue).
    residual_epilogue: the attention and MLP output projections add the residual stream in the
    product too (cuBLASLt's C input, beta = 1), and the model's LayerNorm after them only normalizes.
    autotune: how many of cuBLASLt's heuristic algorithms each product times at its first call,
    keeping the fastest (1: the heuristic's first, as llm.c; llmc/cublaslt.py). gelu_fusion, llm.c's
    -ge: 2 fuses the GELU into the fc GEMM (GELU_AUX_BIAS) and its derivative into the fcproj
    input-gradient GEMM (DGELU); 1 the forward only (the backward: a plain GEMM, then
    gelu_backward_inplace); 0 neither (the forward: a BIAS GEMM into pre_gelu, then gelu_forward).
    A fused epilogue saves a pass over the (B,T,4C) activation but may run a slower GEMM algorithm
    than the plain product: which wins is measured (dev/bench.py --gelu-fusion)."""
    name = "cuBLASLt"

    def __init__(self, tf32=False, residual_epilogue=False, autotune=1, gelu_fusion=2, bias_grad_epilogue=1):
        super().__init__(tf32)
        require(gelu_fusion in GELU_FUSION_CHOICES, f"gelu_fusion={gelu_fusion}: one of {GELU_FUSION_CHOICES}")
        require(bias_grad_epilogue in BIAS_GRAD_EPILOGUE_CHOICES,
                f"bias_grad_epilogue={bias_grad_epilogue}: one of {BIAS_GRAD_EPILOGUE_CHOICES}")
        self.residual_epilogue = bool(residual_epilogue)
        self.autotune, self.gelu_fusion = int(autotune), int(gelu_fusion)
        self.bias_grad_epilogue = int(bias_grad_epilogue)
        # backward(..., pre_gelu_dbias=) sums the fc's bias gradient from the fcproj input gradient
        self.pre_gelu_bias_grad = self.bias_grad_epilogue == 2 and self.gelu_fusion >= 2

    def forward(self, out, inp, weight, bias, B, T, C, OC, pre_gelu=None, residual=None):
        """Cublas.forward, and with residual (B,T,OC): out = inp @ weight^T + bias + residual."""
        from llmc import cublaslt
        if pre_gelu is not None and self.gelu_fusion < 1:          # pre_gelu = inp @ weight^T + bias, then GELU
            cublaslt.matmul_forward_lt(pre_gelu, inp, weight, bias, B, T, C, OC, tf32=self.tf32,
                                       autotune=self.autotune)
            gelu_forward(out, pre_gelu, B * T * OC)
            return
        cublaslt.matmul_forward_lt(out, inp, weight, bias, B, T, C, OC, pre_gelu=pre_gelu, tf32=self.tf32,
                                   residual=residual, autotune=self.autotune)

    def backward(self, dinp, dweight, dbias, dout, inp, weight, partial, B, T, C, OC, pre_gelu=None,
                 pre_gelu_dbias=None, bias_grads_zero=False):
        """Cublas.backward; with pre_gelu_dbias (C,) too (the fc layer's bias gradient, where
        pre_gelu_bias_grad), pre_gelu_dbias += the column sums of dinp, the pre-activation's
        gradient: in the DGELU_BGRAD epilogue, or by bias_backward where cuBLASLt has no algorithm
        for it or the GELU's derivative is not in the epilogue. bias_grads_zero: the epilogues write
        the bias gradients directly (llmc.cublaslt.matmul_backward_lt)."""
        from llmc import cublaslt
        require(pre_gelu_dbias is None or pre_gelu is not None, "backward: pre_gelu_dbias without pre_gelu")
        fused_gelu = pre_gelu if self.gelu_fusion >= 2 else None
        fused_dbias = pre_gelu_dbias if fused_gelu is not None else None
        kwargs = dict(tf32=self.tf32, autotune=self.autotune, bias_grad_epilogue=self.bias_grad_epilogue == 1,
                      bias_grads_zero=bias_grads_zero)
        try:
            done = cublaslt.matmul_backward_lt(dinp, dweight, dbias, dout, inp, weight, B, T, C, OC,
                                               pre_gelu=fused_gelu, pre_gelu_dbias=fused_dbias, **kwargs)
        except cublaslt.CublasLtUnsupported:
            if fused_dbias is None:
                raise
            fused_dbias = None                                    # no DGELU_BGRAD here: DGELU, then our kernel
            done = cublaslt.matmul_backward_lt(dinp, dweight, dbias, dout, inp, weight, B, T, C, OC,
                                               pre_gelu=fused_gelu, **kwargs)
        if not done and dbias is not None:
            bias_backward(dbias, dout, partial, B * T, OC)
        if pre_gelu is not None and fused_gelu is None:           # dinp = (dout @ weight) * gelu'(pre_gelu)
            gelu_backward_inplace(dinp, pre_gelu, B * T * C)
        if pre_gelu_dbias is not None and fused_dbias is None:
            bias_backward(pre_gelu_dbias, dinp, partial, B * T, C)
