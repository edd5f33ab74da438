"""Tests of dev/cuda/matmul.py's tensor-core versions 6-8 (dev/cuda/matmul.cu) beyond the
progression's small test size, where tests/test_dev_cuda_matmul_attention.py validates every version.

On the emulated device (llmc/emulator/: mma.sync, ldmatrix and cp.async with the PTX ISA's lane
layouts, copies landing at their wait), each against gpt2_cpu.py through the harness's validate():
- a shape with every edge at once: N = 130 tokens (a second 128-row block with 2 rows), C = 200
  (7 k-tiles, so the 3- and 4-stage rings wrap around, the last k-tile 8 of 32 columns wide), OC =
  264 (a last column block 8 wide); in the backward the same shape makes dweight's K sum (the 130
  tokens) 5 k-tiles, split across blocks with a last split of 2 tokens;
- more than RASTER_GROUP_M = 16 row blocks (2181 tokens: 18 row blocks, so a full group of 16 and
  a partial one of 2), every tile computed exactly once in version 8's grouped block order (slow);
- the planted bug of issue 36: a scratch copy of matmul.cu whose pipeline forgets its
  cp.async.wait_group reads stages whose copies have not landed (NaN on the emulated device) and
  fails validation; the unchanged copy passes (the control);
- the launchers refuse fp32 arrays and C or OC not a multiple of 8, naming the rule;
- dweight_splits (the split of dweight's K sum) worked out by hand at the model's shapes;
- matmul.py's tile table matches matmul.cu's TileConfig constants;
- dev/cuda/matmul_tiles.py's variants differ from matmul.cu in their two TileConfig lines only, its
  table is worked out by hand, and every variant validates on the emulated device (slow).
Marked gpu: the same shapes validated on a GPU.

Run: pytest tests/test_matmul_tensor_cores.py   (~40 s on 2 cores once g++ has built matmul.cu;
the slow ones, the 2181-token case and the tile variants, ~1.5 minutes more)
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import llmc.cuda

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEV_CUDA = os.path.join(ROOT, "dev", "cuda")
sys.path.insert(0, DEV_CUDA)

import common  # noqa: E402  (dev/cuda/common.py)
import matmul  # noqa: E402  (dev/cuda/matmul.py)
import matmul_tiles  # noqa: E402  (dev/cuda/matmul_tiles.py)

TENSOR_CORE_VERSIONS = {6, 7, 8}
EDGES = dict(B=2, T=65, C=200, OC=264)           # N = 130: see the module docstring
MANY_ROW_BLOCKS = dict(B=1, T=2181, C=8, OC=136)  # 18 row blocks of 128; 2 (1) column blocks of 128 (256)
D12_SMS = 132                                    # an H100 SXM's SMs


def progression(name):
    return next(p for p in matmul.PROGRESSIONS if p.name == name)


@pytest.fixture
def emulated(monkeypatch):
    """llmc.cuda (and so the harness) on the emulated device."""
    monkeypatch.setattr(llmc.cuda, "_device", "cpu")


# ----------------------------------------------------------------------------
# validated against gpt2_cpu.py

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", ["matmul_forward_qkv", "matmul_backward_qkv", "matmul_forward_gelu_fc"])
def test_every_edge_at_once(monkeypatch, capsys, device, name):
    monkeypatch.setattr(llmc.cuda, "_device", device)
    p = progression(name)
    versions = TENSOR_CORE_VERSIONS & {v.number for v in p.versions}
    assert common.validate(p, "bf16", EDGES, versions)
    runs = sum(len(v.block_sizes) for v in p.versions if v.number in versions)
    assert capsys.readouterr().out.count(": OK") == runs


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", ["matmul_forward_qkv", "matmul_backward_qkv"])
def test_more_row_blocks_than_a_raster_group(monkeypatch, device, name):
    monkeypatch.setattr(llmc.cuda, "_device", device)
    assert common.validate(progression(name), "bf16", MANY_ROW_BLOCKS, {8})


# ----------------------------------------------------------------------------
# the planted bug: the pipeline forgets to wait for its copies

MAINLOOP_WAIT = "cp_async_wait_group<Cfg::STAGES - 2>();   // tile kt+1 has landed"


@pytest.fixture(scope="module")
def scratch_matmul(tmp_path_factory):
    """{planted: path}: dev/cuda/matmul.cu copied, unchanged (False) and with its main loop's
    cp.async.wait_group removed (True; the prologue's wait stays: tile 0 lands, tile 1 is read
    before it does)."""
    with open(os.path.join(DEV_CUDA, "matmul.cu"), encoding="utf-8") as f:
        text = f.read()
    assert text.count(MAINLOOP_WAIT) == 1
    directory = tmp_path_factory.mktemp("scratch_matmul")
    paths = {}
    for planted in (False, True):
        paths[planted] = directory / ("planted.cu" if planted else "control.cu")
        paths[planted].write_text(text.replace(MAINLOOP_WAIT, "// (the wait for tile kt+1 was here)") if planted
                                  else text)
    return {planted: str(path) for planted, path in paths.items()}


@pytest.mark.parametrize("planted", [False, True])
@pytest.mark.parametrize("number", [7, 8])
def test_a_missing_cp_async_wait_fails_validation(emulated, monkeypatch, capsys, scratch_matmul, number, planted):
    path = scratch_matmul[planted]
    if number == 7:
        monkeypatch.setattr(matmul, "MATMUL_V7", common.Kernel(path, matmul.MATMUL_V7.name))
    else:
        monkeypatch.setattr(matmul, "MATMUL_FORWARD_V8",
                            {t: common.Kernel(path, k.name) for t, k in matmul.MATMUL_FORWARD_V8.items()})
    p = progression("matmul_forward_qkv")
    ok = common.validate(p, "bf16", p.test_sizes, {number})
    out = capsys.readouterr().out
    if planted:                                 # shared memory starts as NaN: the unlanded tile is NaN
        assert not ok and "FAILED" in out and "nan" in out.lower(), out
    else:
        assert ok, out


# ----------------------------------------------------------------------------
# what the launchers refuse

@pytest.mark.parametrize("name", ["matmul_forward_qkv", "matmul_backward_qkv", "matmul_forward_gelu_fc"])
def test_the_launchers_refuse_fp32_and_rows_of_partial_chunks(emulated, name):
    p = progression(name)
    for version in (v for v in p.versions if v.number in TENSOR_CORE_VERSIONS):
        for precision, sizes, message in (("fp32", p.test_sizes, "take bf16"),
                                          ("bf16", dict(p.test_sizes, OC=76), "OC=76 must be multiples of 8"),
                                          ("bf16", dict(p.test_sizes, C=44), "C=44 and OC=72 must be multiples of 8")):
            case = p.make_case(np.random.default_rng(0), precision, **sizes)
            d = common.allocate(case)
            with pytest.raises(ValueError, match=message):
                version.launch(d, version.block_sizes[0])
            assert matmul.tensor_core_unavailable_reason(precision, sizes) is not None


# ----------------------------------------------------------------------------
# dweight's split of the K sum, by hand

@pytest.mark.parametrize("C,OC,tile,expected", [
    # qkv: 18 x 6 = 108 tiles of 128 x 128 on 264 slots (2 per SM), 512 k-tiles of 32 tokens; one
    # (768, 2304) fp32 partial is 7,077,888 bytes, so at most 4 fit the 32 MiB budget.
    # S=1: 1 wave x 512; S=2: 216 blocks, 1 wave x 256; S=3: 2 waves x 171; S=4: 2 x 128 = 256 (a tie: fewer)
    (768, 2304, 128, (2, 256)),
    # attproj: 36 tiles; 14 partials fit. S=7: 252 blocks, 1 wave x ceil(512/7) = 74, the least
    (768, 768, 128, (7, 74)),
    # fc and fcproj: 144 tiles, 3 partials fit. S=1: 512; S=2: 2 waves x 256; S=3: 2 waves x 171
    (768, 3072, 128, (3, 171)),
    (3072, 768, 128, (3, 171)),
    # the classifier: 2358 tiles, and one partial (155 MB) is over the budget: no split
    (768, 50304, 128, (1, 512)),
    # qkv with 128 x 256 tiles: 18 x 3 = 54 on 132 slots. S=2: 108 blocks, 1 wave x 256
    (768, 2304, 256, (2, 256)),
])
def test_dweight_splits_by_hand(C, OC, tile, expected):
    shape = matmul.V8_TILES[tile]
    tiles = matmul.tile_count(shape, OC, C)
    slots = D12_SMS * matmul.V8_BLOCKS_PER_SM[tile]
    N = 16 * 1024
    assert matmul.dweight_splits(tiles, N // shape.bk, slots, OC * C * matmul.FP32_BYTES) == expected


def test_the_edges_shape_splits_dweight_with_a_ragged_last_split():
    # 264 x 200 = 3 x 2 tiles of 128, 130 tokens = 5 k-tiles; on 2 cores (4 slots): S=5 gives 30
    # blocks, 8 waves x 1 k-tile = 8 < S=1's 2 waves x 5 = 10; the last split sums 2 tokens
    shape = matmul.V8_TILES[128]
    assert matmul.dweight_splits(matmul.tile_count(shape, 264, 200), 5, 4, 264 * 200 * 4) == (5, 1)


# ----------------------------------------------------------------------------
# the launchers' tile table is the kernels'

def test_tile_table_matches_matmul_cu():
    with open(os.path.join(DEV_CUDA, "matmul.cu"), encoding="utf-8") as f:
        source = f.read()
    configs = {name: tuple(int(x) for x in args.split(","))
               for name, args in re.findall(r"using (\w+) = TileConfig<([\d, ]+)>;", source)}
    for tile, name in ((matmul.V7_TILE, "V7Config"), (matmul.V8_TILES[128], "V8SmallConfig"),
                       (matmul.V8_TILES[256], "V8LargeConfig")):
        bm, bn, bk, warps_m, warps_n, stages = configs[name]
        assert (tile.bm, tile.bn, tile.bk, tile.stages, tile.threads) == (bm, bn, bk, stages, warps_m * warps_n * 32)
    defines = dict(re.findall(r"#define (V6_\w+) (\d+)\b", source))
    assert (matmul.V6_TILE.bm, matmul.V6_TILE.bn, matmul.V6_TILE.bk) == (
        int(defines["V6_BLOCK_ROWS"]), int(defines["V6_BLOCK_COLS"]), int(defines["V6_SLICE"]))
    assert matmul.V8_TILES[128].shared_bytes == 64 * 1024 and matmul.V8_TILES[256].shared_bytes == 72 * 1024


# ----------------------------------------------------------------------------
# dev/cuda/matmul_tiles.py: version 8 at other tiles

def test_tile_variants_change_only_the_two_config_lines(tmp_path):
    with open(os.path.join(DEV_CUDA, "matmul.cu"), encoding="utf-8") as f:
        source = f.read()
    variants = matmul_tiles.write_variants(str(tmp_path))
    assert [v.name for v in variants] == [name for name, _, _ in matmul_tiles.VARIANTS]
    for variant, (name, small, large) in zip(variants, matmul_tiles.VARIANTS):
        with open(variant.path, encoding="utf-8") as f:
            text = f.read()
        configs = matmul_tiles.shipped_configs(text)
        assert configs == variant.configs
        if small is None:
            assert text == source                                          # "shipped" is matmul.cu itself
        else:
            assert configs == {"V8SmallConfig": small, "V8LargeConfig": large}
            assert matmul_tiles.CONFIG_LINE.sub("", text) == matmul_tiles.CONFIG_LINE.sub("", source)


def test_tile_table_by_hand():
    variants = [matmul_tiles.Variant("shipped", {"V8SmallConfig": (128, 128, 32, 2, 2, 4),
                                                  "V8LargeConfig": (128, 256, 32, 2, 4, 3)}, "")]
    times = {"shipped": {}}
    for shape in matmul.SHAPES:
        times["shipped"] |= {(shape, "v4"): (2.0, 4.0), (shape, "v5"): (1.0, 2.0), (shape, 128): (2.0, 2.0),
                             (shape, 256): (1.0, 8.0)}
    text = matmul_tiles.table(times, variants, {4: None, 5: None})
    # qkv forward: 2 x 16384 x 768 x 2304 = 57,982,058,496 FLOPs, in 1 ms 58 TFLOP/s; the backward
    # twice that: in 2 ms 58, in 8 ms 14.5 (rounded to even: 14). Shares of cuBLASLt's (v5) time.
    assert "### qkv (768 -> 2304), B=16, T=1024" in text
    assert "| library v5 | 0 | - | 58 | 100 | 58 | 100 |" in text
    assert "| library v4 | 0 | - | 29 | 50 | 29 | 50 |" in text
    assert "| shipped | 128 | 128 x 128 x 32, 4 | 29 | 50 | 58 | 100 |" in text
    assert "| shipped | 256 | 128 x 256 x 32, 3 | 58 | 100 | 14 | 25 |" in text


@pytest.mark.slow
def test_every_tile_variant_validates_on_the_emulated_device():
    result = subprocess.run([sys.executable, os.path.join(DEV_CUDA, "matmul_tiles.py"), "--device", "cpu"],
                            cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "FAILED" not in result.stdout and result.stdout.count(": OK") == 4 * 3 * 2 * 2   # variants, progressions,
                                                                                          # sizes, blocks
