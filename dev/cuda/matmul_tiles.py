"""
dev/cuda/matmul_tiles.py: version 8 of dev/cuda/matmul.py with other block tiles, timed on a GPU
beside the two that matmul.cu ships, so that the shipped ones are chosen by measurement.

Each variant is a copy of dev/cuda/matmul.cu with its two TileConfig lines replaced
(V8SmallConfig: the kernels of version 8's block 128; V8LargeConfig: those of block 256), the
launchers of matmul.py pointed at the copy. A variant is first validated against gpt2_cpu.py
(common.validate, forward and backward, at matmul.py's small test size and at
tests/test_matmul_tensor_cores.py's shape with every edge), then its forward and backward are
timed at GPT-2 124M's four layer shapes (B = 16, T = 1024), next to cuBLAS (matmul.py's version 4)
and cuBLASLt (version 5, where llmc.cublaslt can run) in the same run. What it is not: a
progression (matmul.py's table is the record) or an autotuner (nothing is chosen for you).

Run (needs a CUDA GPU; --device cpu validates every variant on the emulated device, no times):
    python dev/cuda/matmul_tiles.py -o dev/results     # ~1 minute on an H100
prints one validation line per variant and block, then a table per shape: variant, block, the
tile, forward and backward TFLOP/s and their share of cuBLASLt's (else cuBLAS's); written to
<dir>/dev_cuda_matmul_tiles.md.
"""

import dataclasses
import os
import re
import sys
import tempfile
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import matmul  # noqa: E402  (dev/cuda/matmul.py)

import llmc.matmul  # noqa: E402
from llmc import cuda  # noqa: E402
from llmc.cli import ArgumentParser  # noqa: E402

EDGES = dict(B=2, T=65, C=200, OC=264)     # tests/test_matmul_tensor_cores.py's shape with every edge
D12 = dict(B=16, T=1024)
REPEATS = 20
# (name, V8SmallConfig, V8LargeConfig): TileConfig<BM, BN, BK, WARPS_M, WARPS_N, STAGES>
VARIANTS = (
    ("shipped", None, None),
    ("bk64", (128, 128, 64, 2, 2, 3), (128, 256, 64, 2, 4, 3)),
    ("deeper", (128, 128, 32, 2, 2, 5), (128, 256, 32, 2, 4, 4)),
    ("tall", (128, 128, 32, 2, 2, 3), (256, 128, 32, 4, 2, 3)),
)
CONFIG_LINE = re.compile(r"using (V8SmallConfig|V8LargeConfig) = TileConfig<([\d, ]+)>;")


def shipped_configs(source):
    """{"V8SmallConfig": (BM, BN, BK, WARPS_M, WARPS_N, STAGES), "V8LargeConfig": ...} of matmul.cu."""
    return {name: tuple(int(x) for x in args.split(",")) for name, args in CONFIG_LINE.findall(source)}


def tile_of(config, name):
    """matmul.TensorCoreTile of a TileConfig tuple."""
    bm, bn, bk, warps_m, warps_n, stages = config
    return matmul.TensorCoreTile(bm, bn, bk, stages, warps_m * warps_n * 32, name)


@dataclasses.dataclass
class Variant:
    name: str
    configs: dict          # {"V8SmallConfig": tuple, "V8LargeConfig": tuple}
    path: str              # the matmul.cu copy


def write_variants(directory):
    """One matmul.cu copy per variant in `directory`; returns [Variant]."""
    with open(os.path.join(common.REPO_ROOT, "dev", "cuda", "matmul.cu"), encoding="utf-8") as f:
        source = f.read()
    shipped = shipped_configs(source)
    variants = []
    for name, small, large in VARIANTS:
        configs = {"V8SmallConfig": small or shipped["V8SmallConfig"], "V8LargeConfig": large or shipped["V8LargeConfig"]}
        text = CONFIG_LINE.sub(lambda m: f"using {m[1]} = TileConfig<{', '.join(map(str, configs[m[1]]))}>;", source)
        path = os.path.join(directory, f"matmul_{name}.cu")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        variants.append(Variant(name, configs, path))
    return variants


def use_variant(variant):
    """Point matmul.py's version 8 (tiles and kernels) at the variant's copy of matmul.cu."""
    tiles = {128: "V8SmallConfig", 256: "V8LargeConfig"}
    matmul.V8_TILES = {t: tile_of(variant.configs[c], matmul.V8_TILES[t].name) for t, c in tiles.items()}
    for table in ("MATMUL_FORWARD_V8", "MATMUL_FORWARD_GELU_V8", "DINP_V8", "DWEIGHT_V8"):
        setattr(matmul, table, {t: common.Kernel(variant.path, k.name) for t, k in getattr(matmul, table).items()})
    matmul.SPLIT_K_REDUCE_V8 = common.Kernel(variant.path, matmul.SPLIT_K_REDUCE_V8.name)


def version(progression_name, number):
    """Version `number` of matmul.py's progression `progression_name`."""
    progression = next(p for p in matmul.PROGRESSIONS if p.name == progression_name)
    return next(v for v in progression.versions if v.number == number)


def validate(variant):
    """Version 8 of the variant, forward, GELU and backward, at the test size and at EDGES. A
    variant that does not compile (a tile its static_asserts refuse) is said so and invalid."""
    use_variant(variant)
    ok = True
    for name in ("matmul_forward_qkv", "matmul_forward_gelu_fc", "matmul_backward_qkv"):
        progression = next(p for p in matmul.PROGRESSIONS if p.name == name)
        for sizes in (progression.test_sizes, EDGES):
            try:
                ok &= common.validate(progression, "bf16", sizes, {8})
            except cuda.KernelCompileError as e:
                print(f"variant {variant.name}: {str(e)[:2000]}")
                return False
    return ok


def timing_arrays(C, OC):
    """The device arrays of version 8's and the libraries' forward and backward at (C, OC), B = 16,
    T = 1024: random bf16 inputs (the times do not depend on the values), the rest zeros."""
    cp, rng = cuda.cupy(), np.random.default_rng(common.SEED)
    N = D12["B"] * D12["T"]

    def bf16(*shape):
        return cp.asarray(common.to_device_dtype(rng.standard_normal(shape, dtype=np.float32), "X", "bf16"))
    return types.SimpleNamespace(
        precision="bf16", N=N, C=C, OC=OC, **D12, inp=bf16(N, C), weight=bf16(OC, C), bias=bf16(OC), dout=bf16(N, OC),
        out=cp.zeros((N, OC), np.uint16), dinp=cp.zeros((N, C), np.uint16), dweight=cp.zeros((OC, C), np.uint16),
        dbias=cp.zeros(OC, np.uint16), scratch=cp.zeros(llmc.matmul.bias_backward_chunks(N) * OC, np.float32),
        partial=cp.zeros(matmul.split_k_partial_floats(C, OC), np.float32))


def time_all(variants, flush, libraries):
    """{variant name: {(shape, block or "v<number>"): (forward ms, backward ms)}} at the d12 shapes:
    version 8 of every variant at both blocks, and the libraries {number: (forward Version,
    backward Version)}, filed under the first variant."""
    times = {v.name: {} for v in variants}
    for shape, (C, OC) in matmul.SHAPES.items():
        d = timing_arrays(C, OC)
        for variant in variants:
            use_variant(variant)
            for block in matmul.V8_TILES:
                times[variant.name][shape, block] = (
                    common.time_ms(lambda: matmul.forward_v8(d, block), flush, REPEATS),
                    common.time_ms(lambda: matmul.backward_v8(d, block), flush, REPEATS))
        for number, (forward, backward) in libraries.items():
            times[variants[0].name][shape, f"v{number}"] = (common.time_ms(lambda: forward.launch(d, 0), flush, REPEATS),
                                                            common.time_ms(lambda: backward.launch(d, 0), flush, REPEATS))
    return times


def table(times, variants, libraries):
    """Markdown, one table per shape."""
    reference = max(libraries)                      # cuBLASLt where it runs, else cuBLAS
    text = []
    for shape, (C, OC) in matmul.SHAPES.items():
        flops = common.gemm_flops(D12["B"] * D12["T"], OC, C)
        ref_f, ref_b = times[variants[0].name][shape, f"v{reference}"]
        text += [f"### {shape} ({C} -> {OC}), B={D12['B']}, T={D12['T']}", "",
                 f"| variant | block | tile (BM x BN x BK, stages) | forward TFLOP/s | % of v{reference} | "
                 f"backward TFLOP/s | % of v{reference} |", "|---|---|---|---|---|---|---|"]
        for number in sorted(libraries):
            f, b = times[variants[0].name][shape, f"v{number}"]
            text.append(f"| library v{number} | 0 | - | {flops / f / 1e9:.0f} | {100 * ref_f / f:.0f} | "
                        f"{2 * flops / b / 1e9:.0f} | {100 * ref_b / b:.0f} |")
        for variant in variants:
            for block, config in zip((128, 256), (variant.configs["V8SmallConfig"], variant.configs["V8LargeConfig"])):
                f, b = times[variant.name][shape, block]
                bm, bn, bk, _, _, stages = config
                text.append(f"| {variant.name} | {block} | {bm} x {bn} x {bk}, {stages} | {flops / f / 1e9:.0f} | "
                            f"{100 * ref_f / f:.0f} | {2 * flops / b / 1e9:.0f} | {100 * ref_b / b:.0f} |")
        text.append("")
    return "\n".join(text)


def main(argv=None):
    parser = ArgumentParser(prog="dev/cuda/matmul_tiles.py", description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("-o", "--output-dir", default=common.RESULTS_DIR, help="where dev_cuda_matmul_tiles.md goes")
    parser.add_argument("-d", "--device", default="cuda", choices=cuda.DEVICES,
                        help="cuda: validate, then time (default); cpu: validate on the emulated device only")
    args = parser.parse_args(argv)
    cuda.use_device(args.device)
    reason = cuda.cuda_unavailable_reason()
    if reason:
        print(f"dev/cuda/matmul_tiles.py: no {'emulated device' if args.device == 'cpu' else 'CUDA GPU'} "
              f"({reason}); nothing to run", file=sys.stderr)
        return common.NO_GPU_EXIT
    with tempfile.TemporaryDirectory() as directory:
        variants = write_variants(directory)
        valid = [v for v in variants if validate(v)]
        for v in variants:
            if v not in valid:
                print(f"variant {v.name} did NOT validate: not timed")
        if args.device == "cpu":
            return 0 if len(valid) == len(variants) else 1
        libraries = {number: (version("matmul_forward_qkv", number), version("matmul_backward_qkv", number))
                     for number in (4, 5) if number == 4 or matmul.cublaslt_unavailable_reason("bf16", {}) is None}
        props, description = common.device_description()
        flush = common.l2_flush(props)
        times = time_all(valid, flush, libraries)
    text = f"# dev/cuda/matmul_tiles.py [bf16] on {description}\n\n" + table(times, valid, libraries)
    print(text)
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, "dev_cuda_matmul_tiles.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {common.shown_path(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
