"""
tests/nvrtc_marks.py: the `needs_nvrtc` mark shared by the tests that compile kernels with NVRTC
(dev/cuda/nvrtc_compile.py): they skip, saying why, where NVRTC or the CUDA headers cannot be
loaded. Not a test module.
"""

import os
import sys

import pytest

DEV_CUDA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dev", "cuda")
if DEV_CUDA not in sys.path:
    sys.path.insert(0, DEV_CUDA)

import nvrtc_compile as nc  # noqa: E402  (dev/cuda/nvrtc_compile.py)


def nvrtc_unavailable_reason():
    """None where NVRTC and the CUDA headers load, else why not."""
    try:
        nc.load_nvrtc()
        nc.cuda_include_dir()
    except nc.NvrtcUnavailable as error:
        return str(error)
    return None


needs_nvrtc = pytest.mark.skipif(nvrtc_unavailable_reason() is not None,
                                 reason=f"NVRTC cannot be loaded: {nvrtc_unavailable_reason()}")
