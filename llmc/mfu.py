"""
llmc/mfu.py: model FLOPs utilization (llm.c's llmc/mfu.h): the training FLOPs a model needs per
token, and the share of the GPU's peak that a measured tokens/s achieves.
"""

# Dense (no sparsity) tensor-core peaks in TFLOP/s from NVIDIA's datasheets: (substring of the
# device name, bf16, tf32, fp32 without tensor cores). First match wins, so more specific names
# come first ("H100 PCIe" before "H100", "A100" before "A10", "L40S" before "L40" before "L4").
# None: the GPU has no such mode.
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0, 378.0, 51.2),
    ("H100 NVL", 835.0, 417.5, 60.0),
    ("H100", 989.4, 494.7, 66.9),           # SXM5 ("NVIDIA H100 80GB HBM3"); GH200 has the same
    ("H200", 989.4, 494.7, 66.9),           # H100's compute with more memory
    ("A100", 312.0, 156.0, 19.5),
    ("A10", 125.0, 62.5, 31.2),
    ("L40S", 362.1, 183.0, 91.6),
    ("L40", 181.0, 90.5, 90.5),
    ("L4", 121.0, 60.0, 30.3),
    ("RTX 4090", 165.2, 82.6, 82.6),
    ("RTX 3090", 71.0, 35.6, 35.6),
    ("V100", None, None, 15.7),
    ("T4", None, None, 8.1),
)


def peak_flops(device_name, precision, tf32):
    """Peak FLOP/s of this GPU for the matmuls of `precision` (bf16; fp32 with or without TF32),
    or None when the GPU is not in PEAK_TFLOPS."""
    column = 1 if precision == "bf16" else 2 if tf32 else 3
    for row in PEAK_TFLOPS:
        if row[0].lower() in device_name.lower():
            return None if row[column] is None else row[column] * 1e12
    return None


def flops_per_token(num_parameters, L, C, T):
    """Training FLOPs per token, llm.c's estimate (Kaplan et al. 2020, sec. 2.1): 6 per parameter
    (2 forward, 4 backward; N includes the tied wte once, and the small LayerNorm/bias/wpe terms)
    plus 6*L*C*T for the attention scores and values, which have no parameters."""
    return 6 * num_parameters + 6 * L * C * T


def mfu(num_parameters, L, C, T, tokens_per_second, device_name, precision, tf32):
    """Model FLOPs utilization in [0, 1]: achieved FLOP/s over the GPU's peak, or None if unknown."""
    peak = peak_flops(device_name, precision, tf32)
    if peak is None:
        return None
    return flops_per_token(num_parameters, L, C, T) * tokens_per_second / peak

