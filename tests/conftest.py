"""pytest configuration: the repo root on sys.path, the `gpu` and `slow` markers, and the rule
that `gpu` tests skip (with the reason) where there is no CUDA GPU or no CuPy, and the check that
no test leaves llmc.cuda's device switched."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from llmc.openblas import spin_briefly_when_idle  # noqa: E402
spin_briefly_when_idle()        # as the CUDA trainers: before NumPy loads, for the emulated device's kernels


def gpu_unavailable_reason():
    """None if CuPy imports and sees at least one CUDA device, else why not: llmc.cuda's reason,
    the one the trainers print, after "no NVIDIA GPU" on a machine without an NVIDIA driver."""
    from llmc import cuda
    reason = cuda.cuda_unavailable_reason()
    return reason if reason is None or cuda.nvidia_driver_present() else f"no NVIDIA GPU ({reason})"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and CuPy; skipped without one")
    config.addinivalue_line("markers", "slow: takes minutes (the emulated device's command-line runs); "
                                       "in the default run, deselect with -m 'not slow'")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    reason = gpu_unavailable_reason()
    if reason:
        skip = pytest.mark.skip(reason=f"gpu test: {reason}")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def device_choice_is_left_as_found():
    """Every test leaves llmc.cuda's device ("cuda" or the emulated "cpu") as it found it: a test
    that switches it and forgets to switch back would make later tests compile or launch for the
    wrong device. Such a test fails here, by name, and the choice is put back."""
    import llmc.cuda
    before = llmc.cuda.device()
    yield
    after = llmc.cuda.device()
    llmc.cuda.use_device(before)
    assert after == before, f"the test left llmc.cuda's device as {after!r} (it was {before!r})"
