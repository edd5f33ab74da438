"""
tests/emulated_gpu.py: the test scaffolding shared by the test modules that run gpt2_cuda.py
without a GPU (test modules never import each other): the `emulated_gpu` fixture, which puts
llmc.cuda on the emulated CUDA device (llmc/emulator/: our kernels/*.cu compiled by g++ and run on
the CPU, llmc.emulator.device for CuPy, the vendor libraries emulated with their contracts), a
recorder of the kernel launches, the tiny model TINY and its parameters, and helpers for training runs (a token
shard, the losses of a main.log). Not a test module: there is one emulation, llmc/emulator/, and
nothing here stands in for a kernel.
"""

import collections
import re

import numpy as np
import pytest

import gpt2_cpu
import llmc.cuda
from gpt2_cpu import GPT2Config
from llmc import formats

TINY = GPT2Config(max_seq_len=32, vocab_size=100, padded_vocab_size=128, num_layers=2, num_heads=2, channels=32)
BIASES_AND_NORMS = ("qkvb", "attprojb", "fcb", "fcprojb", "ln1w", "ln1b", "ln2w", "ln2b", "lnfw", "lnfb")


def tiny_model_parameters(config=TINY, seed=42):
    """gpt2_cpu's model of gpt2_init(config, seed) with every bias and LayerNorm parameter moved by
    ~N(0, 0.1^2): the init makes them all 0 (or 1), which would hide a bias or LayerNorm weight
    handed to the wrong layer."""
    model = gpt2_cpu.gpt2_init(config, seed)
    rng = np.random.default_rng(seed)
    for name in BIASES_AND_NORMS:
        model.P[name] += 0.1 * rng.standard_normal(model.P[name].shape).astype(model.P[name].dtype)
    return model


# ----------------------------------------------------------------------------
# the emulated device

@pytest.fixture
def emulated_gpu(monkeypatch):
    """gpt2_cuda on the emulated CUDA device for one test (the device is restored after it): its
    real kernels, the emulated CuPy module (returned) and vendor libraries. The first use compiles
    each kernel file per precision (cached in .emulator-cache/)."""
    monkeypatch.setattr(llmc.cuda, "_device", llmc.cuda.device())      # restored after the test
    llmc.cuda.use_device("cpu")
    return llmc.cuda.cupy()


Launch = collections.namedtuple("Launch", "name grid block args")


def record_launches(monkeypatch):
    """A list that collects every kernel launch on the emulated device until the test ends, in
    issue order, as Launch(name, grid (x,y,z), block (x,y,z), args as the launcher passed them).
    The kernels still run: this records at llmc.emulator.device.RawKernel, where CuPy's
    RawKernel would be called on a GPU."""
    from llmc.emulator import build, device
    launched = []
    call = device.RawKernel.__call__

    def recording(self, grid, block, args, **kwargs):
        launched.append(Launch(self.name, build.dims(grid), build.dims(block), tuple(args)))
        return call(self, grid, block, args, **kwargs)
    monkeypatch.setattr(device.RawKernel, "__call__", recording)
    return launched


# ----------------------------------------------------------------------------
# training runs

def _write_shards(tmp_path, n_tokens=4000, V=TINY.vocab_size):
    rng = np.random.default_rng(0)
    path = str(tmp_path / "train.bin")
    formats.write_shard(path, rng.integers(0, V, n_tokens))
    return path


def _train_losses(log_path):
    """{step: loss} from a main.log."""
    losses = {}
    with open(log_path) as f:
        for line in f:
            m = re.match(r"s:(\d+) trl:(\S+)", line)
            if m:
                losses[int(m.group(1))] = float(m.group(2))
    return losses
