"""The host infrastructure in llmc/: model, debug-state, tokenizer and shard files byte by byte,
atomic writes, the data loader (windows, ranks, shuffling, restore), and the training-state file."""

import os
import struct

import numpy as np
import pytest

import gpt2_cpu as g
from llmc import checkpoint, dataloader, formats, tokenizer, utils

TINY = g.GPT2Config(max_seq_len=16, vocab_size=50, padded_vocab_size=64, num_layers=2, num_heads=2, channels=8)


def header_ints(path, n=8):
    with open(path, "rb") as f:
        return struct.unpack("<256i", f.read(1024))[:n]


# ---------------------------------------------------------------------------- model files

def test_model_file_layout_fp32(tmp_path):
    model = g.gpt2_init(TINY, seed=0)
    path = tmp_path / "m.bin"
    g.write_model(str(path), model)
    assert header_ints(path) == (20240326, 3, 16, 50, 2, 2, 8, 64)
    raw = path.read_bytes()
    assert len(raw) == 1024 + 4 * model.num_parameters
    assert struct.unpack("<248i", raw[32:1024]) == (0,) * 248          # unused header slots are 0
    data = np.frombuffer(raw[1024:], "<f4")
    # tensor order: wte first (Vp*C), then wpe (maxT*C), ... lnfb last (C)
    np.testing.assert_array_equal(data[:64 * 8], model.P["wte"].ravel())
    np.testing.assert_array_equal(data[64 * 8:64 * 8 + 16 * 8], model.P["wpe"].ravel())
    np.testing.assert_array_equal(data[-8:], model.P["lnfb"])
    back = g.read_model(str(path))
    assert back.config == TINY
    np.testing.assert_array_equal(back.params, model.params)


def test_model_file_bf16(tmp_path):
    model = g.gpt2_init(TINY, seed=0)
    path = tmp_path / "m16.bin"
    g.write_model(str(path), model, dtype="bfloat16")
    assert header_ints(path)[1] == 5
    assert os.path.getsize(path) == 1024 + 2 * model.num_parameters
    back = g.read_model(str(path))
    rel = np.abs(back.params - model.params) / np.maximum(np.abs(model.params), 1e-30)
    assert rel.max() <= 2 ** -8, "bf16 keeps 8 significant bits: round-to-nearest error <= 2^-8 relative"


def test_bfloat16_rounding_is_nearest_even():
    x = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5, 3.0e38, np.inf, 1.0 + 2 ** -8 + 2 ** -20], np.float32)
    bits = formats.float32_to_bfloat16_bits(x)
    back = formats.bfloat16_bits_to_float32(bits)
    # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: ties go to the even mantissa (1.0);
    # 1 + 3*2^-8 ties between 1+2^-7 and 1+2^-6 and goes to 1 + 2^-6 (even)
    np.testing.assert_array_equal(back[:4], [1.0, 1.0, 1.0 + 2 ** -6, -2.5])
    assert back[5] == np.inf
    assert back[6] == np.float32(1.0 + 2 ** -7), "just above a tie rounds up"
    assert np.isnan(formats.bfloat16_bits_to_float32(formats.float32_to_bfloat16_bits(np.array([np.nan], np.float32))))[0]


@pytest.mark.parametrize("mutate,message", [
    (lambda b: struct.pack("<i", 1234) + b[4:], "bad magic"),
    (lambda b: b[:4] + struct.pack("<i", 4) + b[8:], "unsupported model checkpoint version 4"),
    (lambda b: b[:-10], "truncated"),
    (lambda b: b[:500], "truncated"),
    (lambda b: b + b"\0\0\0\0", "trailing bytes"),
    (lambda b: b"", "truncated"),
])
def test_model_file_rejects_bad_files(tmp_path, mutate, message):
    path = tmp_path / "m.bin"
    g.write_model(str(path), g.gpt2_init(TINY, seed=0))
    path.write_bytes(mutate(path.read_bytes()))
    with pytest.raises(utils.InputError, match=message) as e:
        g.read_model(str(path))
    assert str(path) in str(e.value)


def test_write_is_atomic(tmp_path, monkeypatch):
    """A crash mid-write leaves the old file untouched and no file that looks complete."""
    path = tmp_path / "m.bin"
    model = g.gpt2_init(TINY, seed=0)
    g.write_model(str(path), model)
    before = path.read_bytes()

    def boom(fd):
        raise OSError("disk full")
    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError):
        g.write_model(str(path), g.gpt2_init(TINY, seed=1))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["m.bin"], "the temporary file must be cleaned up"


def test_debug_state_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    B, T = 2, 3
    x, y = rng.integers(0, 50, (B, T)), rng.integers(0, 50, (B, T))
    logits = rng.standard_normal((B, T, TINY.vocab_size)).astype(np.float32)
    grads = [rng.standard_normal(s).astype(np.float32) for _, s in g.parameter_shapes(TINY)]
    path = tmp_path / "d.bin"
    formats.write_debug_state(str(path), x, y, logits, 1.5, grads)
    assert header_ints(path, 4) == (20240327, 2, B, T)
    n_params = sum(gr.size for gr in grads)
    assert os.path.getsize(path) == 1024 + 4 * (2 * B * T + B * T * TINY.vocab_size + 1 + n_params)
    d = formats.read_debug_state(str(path), TINY.vocab_size, g.parameter_shapes(TINY))
    np.testing.assert_array_equal(d["x"], x)
    np.testing.assert_array_equal(d["logits"], logits)
    assert d["loss"] == 1.5
    np.testing.assert_array_equal(d["grads"]["fcprojw"], grads[12])


def test_tokenizer_file(tmp_path):
    tokens = [b"a", b"bc", "é".encode(), b"<|endoftext|>"]
    path = tmp_path / "tok.bin"
    tokenizer.write_tokenizer(str(path), tokens, eot_token=3)
    raw = path.read_bytes()
    assert struct.unpack("<4i", raw[:16]) == (20240328, 2, 4, 3)
    assert raw[1024:] == b"\x01a\x02bc\x02" + "é".encode() + b"\x0d<|endoftext|>"
    assert tokenizer.read_tokenizer(str(path)) == (tokens, 3)
    path.write_bytes(raw[:-3])
    with pytest.raises(utils.InputError, match="truncated"):
        tokenizer.read_tokenizer(str(path))


def test_shard_layout_and_validation(tmp_path):
    path = tmp_path / "s.bin"
    formats.write_shard(str(path), [50256, 1, 2, 65535])
    raw = path.read_bytes()
    assert struct.unpack("<3i", raw[:12]) == (20240520, 1, 4)
    assert raw[1024:] == struct.pack("<4H", 50256, 1, 2, 65535)
    np.testing.assert_array_equal(formats.read_shard(str(path)), [50256, 1, 2, 65535])
    path.write_bytes(raw[:-1])
    with pytest.raises(utils.InputError, match="truncated or corrupt"):
        formats.read_shard(str(path))
    path.write_bytes(b"")
    with pytest.raises(utils.InputError, match="empty"):
        formats.read_shard(str(path))
    with pytest.raises(ValueError):
        formats.write_shard(str(path), [70000])


# ---------------------------------------------------------------------------- data loader

def make_shards(tmp_path, sizes, start=0):
    """Shards holding consecutive token values, so every window says where it came from."""
    paths, t = [], start
    for i, n in enumerate(sizes):
        p = tmp_path / f"d_{i:03d}.bin"
        formats.write_shard(str(p), np.arange(t, t + n) % 60000)
        paths.append(p)
        t += n
    return str(tmp_path / "d_*.bin")


def test_loader_windows_cross_shards_and_wrap(tmp_path):
    pattern = make_shards(tmp_path, [25, 17])     # B*T = 8: shard 0 has 3 batches, shard 1 has 2
    loader = dataloader.DataLoader(pattern, 2, 4)
    starts = []
    for _ in range(6):
        x, y = loader.next_batch()
        np.testing.assert_array_equal(y.ravel(), x.ravel() + 1)   # targets shifted by one
        assert x.dtype == np.int32 and x.shape == (2, 4)
        starts.append(int(x[0, 0]))
    assert starts == [0, 8, 16, 25, 33, 0]       # shard 0, shard 1, then wrap to shard 0


def test_loader_ranks_stride(tmp_path):
    pattern = make_shards(tmp_path, [100])
    r0, r1 = dataloader.DataLoader(pattern, 2, 3, 0, 2), dataloader.DataLoader(pattern, 2, 3, 1, 2)
    single = dataloader.DataLoader(pattern, 2, 3)
    for _ in range(3):
        a, b = r0.next_batch()[0], r1.next_batch()[0]
        s1, s2 = single.next_batch()[0], single.next_batch()[0]
        np.testing.assert_array_equal(a, s1)      # rank r reads the r-th B*T slice of each global batch
        np.testing.assert_array_equal(b, s2)


def test_loader_shuffle_is_seeded_and_restores(tmp_path):
    pattern = make_shards(tmp_path, [41, 41, 41])
    a, b = dataloader.DataLoader(pattern, 1, 4, shuffle=True, seed=3), dataloader.DataLoader(pattern, 1, 4, shuffle=True, seed=3)
    seq_a = [int(a.next_batch()[0][0, 0]) for _ in range(25)]
    seq_b = [int(b.next_batch()[0][0, 0]) for _ in range(25)]
    assert seq_a == seq_b
    assert seq_a[:10] != sorted(seq_a[:10]), "shuffled order"
    unshuffled = [int(x) for x in range(0, 40, 4)]
    assert sorted(seq_a[:10]) != unshuffled or seq_a[:10] != unshuffled
    # save mid-epoch, continue, restore into a fresh loader: the same batches follow
    state = a.state()
    cont = [int(a.next_batch()[0][0, 0]) for _ in range(20)]
    c = dataloader.DataLoader(pattern, 1, 4, shuffle=True, seed=99)
    c.restore(state)
    assert [int(c.next_batch()[0][0, 0]) for _ in range(20)] == cont


def test_loader_bad_inputs(tmp_path):
    with pytest.raises(utils.InputError, match="no data file matches"):
        dataloader.DataLoader(str(tmp_path / "nothing_*.bin"), 1, 4)
    pattern = make_shards(tmp_path, [8])
    with pytest.raises(utils.InputError, match="shorter than one batch"):
        dataloader.DataLoader(pattern, 2, 4)


# ---------------------------------------------------------------------------- training state

def test_state_file_round_trip_and_layout(tmp_path):
    model = g.gpt2_init(TINY, seed=0)
    rng = np.random.default_rng(0)
    model.m = rng.standard_normal(model.num_parameters).astype(np.float32)
    model.v = rng.random(model.num_parameters).astype(np.float32)
    pattern = make_shards(tmp_path, [200, 200])
    loader = dataloader.DataLoader(pattern, 2, 4, shuffle=True, seed=1)
    for _ in range(7):
        loader.next_batch()
    path = tmp_path / "state.bin"
    checkpoint.write_state(str(path), 123, 0, 1, model.m, model.v, loader, sample_rng_state=2 ** 40 + 5)
    h = np.frombuffer(path.read_bytes()[:1024], "<i4")
    assert (h[0], h[1], h[2], h[3], h[4], h[5], h[10]) == (20240527, 1, 1, 0, 0, 1, 123)
    assert h[20:22].view("<u8")[0] == 2 ** 40 + 5
    assert h[30:32].view("<u8")[0] == loader.current_shard_idx and h[32:34].view("<u8")[0] == loader.current_sample_idx
    raw = path.read_bytes()[1024:]
    np.testing.assert_array_equal(np.frombuffer(raw[:4 * model.num_parameters], "<f4"), model.m)
    st = checkpoint.read_state(str(path), model.num_parameters, 0, 1)
    assert st["step"] == 123 and st["sample_rng_state"] == 2 ** 40 + 5
    np.testing.assert_array_equal(st["v"], model.v)
    fresh = dataloader.DataLoader(pattern, 2, 4, shuffle=True, seed=1)
    fresh.restore(st["loader"])
    np.testing.assert_array_equal(fresh.next_batch()[0], loader.next_batch()[0])
    with pytest.raises(utils.InputError, match="rank 0 of 1 processes, but this is rank 1 of 2"):
        checkpoint.read_state(str(path), model.num_parameters, 1, 2)
    path.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(utils.InputError, match="truncated"):
        checkpoint.read_state(str(path), model.num_parameters, 0, 1)
