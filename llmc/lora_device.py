"""
llmc/lora_device.py: LoRA on the device for gpt2_cuda.py and llama3_cuda.py, the twin of
gpt2_cpu.py's LoRA section: the adapters' launchers (lora_forward, lora_backward: four cuBLAS GEMMs
and a fifth for the input's gradient, scale as the GEMM's alpha), the adapters' buffers
(DeviceLoRA: a flat floatX parameter and gradient vector, fp32 AdamW moments and master weights,
ZeRO-1's shard: the fields gpt2_cuda's gpt2_zero_grad, gpt2_global_grad_norm,
gpt2_average_gradients and gpt2_update read, so the trainers' step trains it as a model), and the
matmul backend that applies them (LoraMatmul).

LoraMatmul wraps the model's backend (Cublas or CublasLt, llmc/matmul.py) and is the model's
`matmul` once LoRA is on: every linear layer of the model already goes through model.matmul, so
the blocks' forward and backward run unchanged. It recognizes an adapted layer by its weight (the
device address of layer l's view of the parameter) and adds the adapters' update to its output,
before the GELU where the layer has one (GPT-2's c_fc), and their part of the input's gradient,
before the GELU's backward. Every base weight is frozen (gpt2_cpu.freeze's contract): the
backward computes the input's gradient only, never a weight's or a bias's (their buffers do not
exist), through cuBLAS (cuBLASLt's fused epilogues are for the gradients of W and b, which LoRA
does not compute).

What it is not: a fused LoRA GEMM (the adapters' product in the base GEMM's epilogue): five thin
GEMMs per adapter per micro-batch, each (B*T) x r x C or (B*T) x r x OC, r << C.
"""

import numpy as np

from llmc import cuda
from llmc.cuda import CUBLAS_OP_N, CUBLAS_OP_T, FLOATX_DTYPES, check_launch
from llmc.lora import lora_tensor_names
from llmc.matmul import gelu_backward_inplace, gelu_forward, matmul_backward, matmul_forward
from llmc.sampler import SamplerRNG
from llmc.zero import optimizer_shard


# ----------------------------------------------------------------------------
# the adapter's launchers (gpt2_cpu.lora_forward, lora_backward)

def lora_forward(out, h, inp, lora_a, lora_b, scale, rows, B, T, C, OC, tf32=False):
    """out[..., rows] (B,T,OC) += scale * h @ lora_b^T with h (B,T,r) = inp (B,T,C) @ lora_a^T
    (written, kept for the backward); lora_a (r,C), lora_b (OCr,r) for the OCr = rows.stop -
    rows.start output channels `rows` of out's OC. Two cuBLAS GEMMs (llmc/cuda.py explains the
    column-major trick): h is matmul_forward's product; then, column-major, out^T's rows
    rows.start.. (OCr,N) with leading dimension OC += scale * lora_b (OCr,r) @ h^T (r,N)."""
    N, r = B * T, lora_a.shape[0]
    OCr = rows.stop - rows.start
    check_launch("lora_forward", [("out", out, N * OC), ("h", h, N * r), ("lora_b", lora_b, OCr * r)])
    matmul_forward(h, inp, lora_a, None, B, T, C, r, tf32)                                   # (N,C) @ (C,r)
    cuda.gemm(CUBLAS_OP_T, CUBLAS_OP_N, OCr, N, r, lora_b, r, h, r, out.reshape(-1)[rows.start:], OC,
              accumulate=True, alpha=scale, tf32=tf32)


def lora_backward(dinp, dlora_a, dlora_b, dh, dout, inp, h, lora_a, lora_b, scale, rows, B, T, C, OC, tf32=False):
    """The adapter's backward (gpt2_cpu.lora_backward), on the rows `rows` of dout (B,T,OC):
        dh       = scale dout_rows @ lora_b     dh^T (r,N) = lora_b^T (r,OCr) @ dout_rows^T (OCr,N), ldb OC
        dinp    += dh @ lora_a                  dinp^T (C,N) += lora_a^T (C,r) @ dh^T (r,N)
        dlora_a += dh^T @ inp                   dlora_a^T (C,r) += inp^T (C,N) @ dh (N,r)
        dlora_b += scale dout_rows^T @ h        dlora_b^T (r,OCr) += h^T (r,N) @ dout_rows (N,OCr)
    dinp (B,T,C) *accumulates* (it holds the frozen layer's dout @ W); dh (B,T,r) is scratch."""
    N, r = B * T, lora_a.shape[0]
    OCr = rows.stop - rows.start
    check_launch("lora_backward", [("dinp", dinp, N * C), ("dlora_a", dlora_a, r * C), ("dlora_b", dlora_b, OCr * r),
                                   ("dh", dh, N * r), ("dout", dout, N * OC), ("inp", inp, N * C), ("h", h, N * r),
                                   ("lora_a", lora_a, r * C), ("lora_b", lora_b, OCr * r)])
    dout_rows = dout.reshape(-1)[rows.start:]                  # column-major (OCr, N) with leading dimension OC
    cuda.gemm(CUBLAS_OP_N, CUBLAS_OP_N, r, N, OCr, lora_b, r, dout_rows, OC, dh, r, alpha=scale, tf32=tf32)
    cuda.gemm(CUBLAS_OP_N, CUBLAS_OP_N, C, N, r, lora_a, C, dh, r, dinp, C, accumulate=True, tf32=tf32)
    cuda.gemm(CUBLAS_OP_N, CUBLAS_OP_T, C, r, N, inp, C, dh, r, dlora_a, C, accumulate=True, tf32=tf32)
    cuda.gemm(CUBLAS_OP_N, CUBLAS_OP_T, r, OCr, N, h, r, dout_rows, OC, dlora_b, r, accumulate=True, alpha=scale,
              tf32=tf32)


# ----------------------------------------------------------------------------
# the adapters on the device

class DeviceAdapter:
    """One layer's adapter on one linear layer (gpt2_cpu.LoraAdapter on the device): views of
    lora_a (r,C), lora_b (OCr,r) and their gradients in the DeviceLoRA's buffers, the rows of the
    layer's output it adds to, and its h (N,r) per micro-batch size N (allocated at first use)."""

    def __init__(self, rows, a, b, da, db):
        self.rows, self.a, self.b, self.da, self.db = rows, a, b, da, db
        self.hidden = {}


class DeviceLoRA:
    """The adapters of a host gpt2_cpu.LoRA on the device, in `precision`: flat floatX params and
    grads with named views (its param_shapes), fp32 m, v and (bf16) master weights holding this
    rank's ZeRO-1 shard (zero_stage 1; all of them with 0), the gradient norm's buffers
    (norm_grid partial sums), the stochastic-rounding RNG (update_seed): every field gpt2_cuda's
    step reads of a model. layers[l]: weight name -> that layer's DeviceAdapters."""

    def __init__(self, host, precision, zero_stage=0, process_rank=0, num_processes=1, update_seed=1,
                 norm_grid=1):
        cp = cuda.cupy()
        self.targets, self.rank, self.alpha, self.scale = host.targets, host.rank, host.alpha, host.scale
        self.precision, self.floatX = precision, FLOATX_DTYPES[precision]
        self.param_shapes, self.num_parameters, self.decayed = host.param_shapes, host.num_parameters, host.decayed
        n = self.num_parameters
        self.zero_stage = zero_stage
        self.shard = optimizer_shard(n, zero_stage, process_rank, num_processes)
        self.params_memory = cp.zeros(self.shard.padded, dtype=self.floatX)
        self.grads_memory = cp.zeros(self.shard.padded, dtype=self.floatX)
        self.params, self.grads = self.params_memory[:n], self.grads_memory[:n]
        self.P, self.G = views(self.params, self.param_shapes), views(self.grads, self.param_shapes)
        S = self.shard.size
        self.master = cp.zeros(S, dtype=np.float32) if precision == "bf16" else None
        self.m = cp.zeros(S, dtype=np.float32)
        self.v = cp.zeros(S, dtype=np.float32)
        self.norm_partial = cp.zeros(norm_grid, dtype=np.float32)
        self.norm = cp.zeros(2, dtype=np.float32)          # the norm, then its clipping factor (gpt2_cuda.NORM_VALUES)
        self.update_rng = SamplerRNG(update_seed)
        self.rng_state_last_update = self.update_rng.state
        self.layers = [{} for _ in host.layers]
        for t in self.targets:
            a, b = lora_tensor_names(t)
            for l, adapters in enumerate(self.layers):
                adapters.setdefault(t.weight, []).append(
                    DeviceAdapter(t.rows, self.P[a][l], self.P[b][l], self.G[a][l], self.G[b][l]))


def views(flat, shapes):
    """Named, reshaped views of a flat device buffer in table order (gpt2_cpu.tensor_views)."""
    out, offset = {}, 0
    for name, shape in shapes:
        size = int(np.prod(shape))
        out[name] = flat[offset:offset + size].reshape(shape)
        offset += size
    return out


# ----------------------------------------------------------------------------
# the matmul backend with adapters

class LoraMatmul:
    """The model's linear layers (model.matmul) with LoRA: `base` (Cublas or CublasLt) for every
    frozen layer's forward, its adapters added after the product (before the GELU), and every
    backward as the input's gradient only, the adapters' part added (before the GELU's backward),
    their dlora_a, dlora_b accumulated. P: the model's parameter views, through which each
    adapted layer's weight is recognized (layers[l][name] adapts P[name][l])."""

    def __init__(self, base, lora, P):
        self.base, self.lora, self.tf32 = base, lora, base.tf32
        self.name = f"{base.name} + LoRA"
        # the residual is added by the model's fused residual + LayerNorm kernel, after the adapters
        # (a residual in the base GEMM's epilogue, --residual-epilogue, is cuBLASLt's without LoRA)
        self.residual_epilogue = False
        self.pre_gelu_bias_grad = False                    # the fc's bias is frozen: no gradient to sum
        self.adapted = {}                                  # device address of a weight -> its adapters
        for l, adapters in enumerate(lora.layers):
            for name, on_weight in adapters.items():
                self.adapted[P[name][l].data.ptr] = on_weight
        self.scratch = {}                                  # N -> dh (N,r), one for every adapter

    def adapters(self, weight):
        return self.adapted.get(weight.data.ptr, ())

    def forward(self, out, inp, weight, bias, B, T, C, OC, pre_gelu=None):
        """out (B,T,OC) = inp @ weight^T + bias + the adapters on weight (with pre_gelu: out =
        gelu(pre_gelu), pre_gelu the sum), as Cublas.forward's contract."""
        adapters = self.adapters(weight)
        if not adapters:
            self.base.forward(out, inp, weight, bias, B, T, C, OC, pre_gelu=pre_gelu)
            return
        target = pre_gelu if pre_gelu is not None else out
        matmul_forward(target, inp, weight, None if pre_gelu is not None else bias, B, T, C, OC, self.tf32)
        N = B * T
        for ad in adapters:
            h = ad.hidden.get(N)
            if h is None:
                h = ad.hidden[N] = cuda.cupy().zeros((N, self.lora.rank), dtype=out.dtype)
            lora_forward(target, h, inp, ad.a, ad.b, self.lora.scale, ad.rows, B, T, C, OC, self.tf32)
        if pre_gelu is not None:
            gelu_forward(out, pre_gelu, N * OC, bias, OC)            # + the bias, then GELU

    def backward(self, dinp, dweight, dbias, dout, inp, weight, partial, B, T, C, OC, pre_gelu=None,
                 pre_gelu_dbias=None, bias_grads_zero=False):
        """dinp (B,T,C) = dout @ weight + the adapters' part (through gelu' with pre_gelu); the
        frozen weights' and biases' gradients (dweight, dbias, pre_gelu_dbias: None) are not computed,
        so bias_grads_zero has nothing to say here."""
        assert dweight is None and dbias is None and pre_gelu_dbias is None, \
            "LoRA's base model is frozen: it has no gradient buffers"
        matmul_backward(dinp, None, None, dout, inp, weight, partial, B, T, C, OC, self.tf32)
        N = B * T
        for ad in self.adapters(weight):
            dh = self.scratch.get(N)
            if dh is None:
                dh = self.scratch[N] = cuda.cupy().zeros((N, self.lora.rank), dtype=dout.dtype)
            lora_backward(dinp, ad.da, ad.db, dh, dout, inp, ad.hidden[N], ad.a, ad.b, self.lora.scale, ad.rows,
                          B, T, C, OC, self.tf32)
        if pre_gelu is not None:
            gelu_backward_inplace(dinp, pre_gelu, N * C)
