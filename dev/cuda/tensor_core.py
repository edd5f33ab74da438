"""
dev/cuda/tensor_core.py: which lane holds which element, for the tensor-core instructions the
matmul and attention kernels use, observed on the device (a GPU, or the emulated device with
--device cpu) by running dev/cuda/tensor_core.cu's one-warp kernels on values that name their
own position.

What it prints, each table read from what the lanes' registers hold after the instruction:
1. ldmatrix.x4 of a 16x16 row-major bf16 tile split into its four 8x8 quadrants (top-left,
   bottom-left, top-right, bottom-right), element (r, c) holding the number 16r + c: lane l's four
   registers, two elements each = the A fragment of mma.m16n8k16.
2. ldmatrix.x2.trans of a 16x8 row-major (k, n) tile (its two 8x8 halves, element (k, n) holding
   8k + n): the B fragment of mma.m16n8k16 (".col": B column-major).
3. mma.m16n8k16 with A = the 16x16 identity (packed by table 1's observed layout), B holding
   8k + n in bf16 (exact: integers up to 256), C = 0: D = B, so each of lane l's four accumulators
   names its (row, col) of D.
4. cp.async: 16 bytes per lane in three commit groups, and what each lane reads of them before
   waiting, after cp.async.wait_group 1, after cp.async.wait_all (counted: copies seen landed).

What it is not: a test (tests/test_tensor_cores.py checks the same against the PTX ISA's tables)
or a benchmark (dev/cuda/matmul.py times the kernels built on these instructions).

Run:
    python dev/cuda/tensor_core.py --device cpu     # the emulated device (g++, no GPU), ~30 s the first time
    python dev/cuda/tensor_core.py                  # a GPU
prints the four tables; exits 2 with one line where the device is missing.
"""

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, HERE)

from llmc import cuda  # noqa: E402
from llmc.cli import ArgumentParser  # noqa: E402
from llmc.formats import float32_to_bfloat16_bits  # noqa: E402

import common  # noqa: E402  (dev/cuda/common.py)

LANES = 32
MMA_FRAGMENTS = common.dev_kernel("tensor_core", "mma_fragments")
LDMATRIX_FRAGMENTS = common.dev_kernel("tensor_core", "ldmatrix_fragments")
CP_ASYNC_GROUPS = common.dev_kernel("tensor_core", "cp_async_groups")
PRECISION = "bf16"                        # the kernels take raw 16-bit elements; bf16 is the build


# ----------------------------------------------------------------------------
# running the instructions (also used by tests/test_tensor_cores.py)

def run_ldmatrix(tiles, num, trans, ld=8):
    """tiles: (4, 8, 8) uint16, four 8x8 matrices. Returns (32, num) uint32: each lane's registers
    after ldmatrix.x`num` (.trans if trans), rows stored `ld` elements apart in shared memory."""
    cp = cuda.cupy()
    out = cp.zeros(LANES * num, np.uint32)
    LDMATRIX_FRAGMENTS.launch(PRECISION, 1, LANES, (out, cp.asarray(np.ascontiguousarray(tiles, np.uint16).ravel()),
                                                    np.int32(num), np.int32(int(trans)), np.int32(ld)))
    return out.get().reshape(LANES, num)


def run_mma(a, b, c):
    """a (32, 4) and b (32, 2) uint32, c (32, 4) float32: each lane's fragment registers. Returns
    (32, 4) float32: each lane's D registers after mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32."""
    cp = cuda.cupy()
    d = cp.zeros(LANES * 4, np.float32)
    MMA_FRAGMENTS.launch(PRECISION, 1, LANES, (d, cp.asarray(np.ascontiguousarray(a, np.uint32).ravel()),
                                               cp.asarray(np.ascontiguousarray(b, np.uint32).ravel()),
                                               cp.asarray(np.ascontiguousarray(c, np.float32).ravel())))
    return d.get().reshape(LANES, 4)


def run_cp_async(src):
    """src: (groups, 32, 4) float32, what lane l copies in group g. Returns (3, 32, groups, 4): what
    each lane read of its copies before any wait, after wait_group 1, after wait_all."""
    cp = cuda.cupy()
    groups = src.shape[0]
    seen = cp.zeros(3 * LANES * groups * 4, np.float32)
    CP_ASYNC_GROUPS.launch(PRECISION, 1, LANES, (seen, cp.asarray(np.ascontiguousarray(src, np.float32).ravel()),
                                                 np.int32(groups)))
    return seen.get().reshape(3, LANES, groups, 4)


def halves(register):
    """The two 16-bit elements of a .b32 register, low first."""
    return int(register) & 0xFFFF, int(register) >> 16


# ----------------------------------------------------------------------------
# the tables

def a_fragment_layout():
    """{(lane, i): (row, col)} of the mma's A fragment element a_i, observed through ldmatrix.x4
    of a 16x16 tile whose element (r, c) holds 16r + c."""
    tile = np.arange(256, dtype=np.uint16).reshape(16, 16)
    quadrants = np.stack([tile[:8, :8], tile[8:, :8], tile[:8, 8:], tile[8:, 8:]])
    regs = run_ldmatrix(quadrants, 4, False)
    return {(lane, 2 * r + h): divmod(halves(regs[lane, r])[h], 16)
            for lane in range(LANES) for r in range(4) for h in range(2)}


def b_fragment_layout():
    """{(lane, i): (k, n)} of the mma's B fragment element b_i, observed through ldmatrix.x2.trans
    of a row-major 16x8 (k, n) tile whose element (k, n) holds 8k + n."""
    tile = np.arange(128, dtype=np.uint16).reshape(16, 8)
    regs = run_ldmatrix(np.stack([tile[:8], tile[8:], tile[:8], tile[8:]]), 2, True)
    return {(lane, 2 * r + h): divmod(halves(regs[lane, r])[h], 8)
            for lane in range(LANES) for r in range(2) for h in range(2)}


def bf16_bits(x):
    """The bf16 bits (round to nearest even) of one float, as a Python int."""
    return int(float32_to_bfloat16_bits(np.array([x], np.float32))[0])


def d_fragment_layout(a_layout):
    """{(lane, i): (row, col)} of the mma's accumulator element c_i / d_i: D = I @ B + 0 with B[k][n]
    = 8k + n, I packed into A fragments by the observed a_layout; each D value names its place."""
    identity = np.eye(16, dtype=np.float32)
    a = np.zeros((LANES, 4), np.uint32)
    for (lane, i), (row, col) in a_layout.items():
        a[lane, i // 2] |= bf16_bits(identity[row, col]) << (16 * (i % 2))
    b_values = np.arange(128, dtype=np.float32).reshape(16, 8)
    b = np.zeros((LANES, 2), np.uint32)
    for (lane, i), (k, n) in b_fragment_layout().items():
        b[lane, i // 2] |= bf16_bits(b_values[k, n]) << (16 * (i % 2))
    d = run_mma(a, b, np.zeros((LANES, 4), np.float32))
    return {(lane, i): divmod(int(d[lane, i]), 8) for lane in range(LANES) for i in range(4)}


def format_layout(title, layout, count, letter):
    """One line per lane: lane l: x0 (r, c)  x1 (r, c) ..."""
    lines = [title]
    for lane in range(LANES):
        cells = "  ".join(f"{letter}{i} ({layout[lane, i][0]:2d},{layout[lane, i][1]:2d})" for i in range(count))
        lines.append(f"  lane {lane:2d}: {cells}")
    return "\n".join(lines)


def cp_async_summary():
    """How many of the 32 lanes' copies of each of three groups each lane saw landed, at each read."""
    groups = 3
    src = np.arange(groups * LANES * 4, dtype=np.float32).reshape(groups, LANES, 4) + 1.0
    seen = run_cp_async(src)
    lines = ["cp.async, 3 commit groups of one 16-byte copy per lane: copies seen landed (of 32 per group)"]
    for label, k in (("before any wait", 0), ("after cp.async.wait_group 1", 1), ("after cp.async.wait_all", 2)):
        landed = [(seen[k][:, g] == src[g]).all(axis=1).sum() for g in range(groups)]
        lines.append(f"  {label:28s}: " + "  ".join(f"group {g}: {n:2d}" for g, n in enumerate(landed)))
    return "\n".join(lines)


def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("-d", "--device", default="cuda", choices=cuda.DEVICES,
                        help="cuda: a GPU; cpu: the emulated device (default cuda)")
    args = parser.parse_args(argv)
    cuda.use_device(args.device)
    reason = cuda.cuda_unavailable_reason()
    if reason:
        where = "the emulated device" if args.device == "cpu" else "a CUDA GPU"
        print(f"dev/cuda/tensor_core.py: no {where} ({reason}); nothing to run", file=sys.stderr)
        return 2
    a_layout = a_fragment_layout()
    print(format_layout("mma.m16n8k16 A (16x16 bf16), loaded by ldmatrix.x4: a_i (row, col)", a_layout, 8, "a"))
    print(format_layout("mma.m16n8k16 B (16x8 bf16), loaded by ldmatrix.x2.trans: b_i (k, n)", b_fragment_layout(), 4, "b"))
    print(format_layout("mma.m16n8k16 C and D (16x8 fp32): c_i (row, col)", d_fragment_layout(a_layout), 4, "c"))
    print(cp_async_summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
