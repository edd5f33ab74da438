"""llmc/emulator/: the emulated CUDA device, so that gpt2_cuda.py runs on a CPU with its real kernels.

    python gpt2_cuda.py --device cpu -e d2 -x 4      # the same losses as python gpt2_cpu.py -e d2 -x 4

What it is: kernels/*.cu compiled unmodified by g++ as host C++ against a shim of CUDA's device
names (shim/), each CUDA thread a fiber, blocks spread over the cores (build.py loads and
launches them); device.py is the cupy-like module that llmc.cuda.cupy() returns on the CPU, with
device memory as host memory; cublas.py (CuPy's cuBLAS bindings), nvmath_cublas.py
(nvmath-python's), cublaslt.py, cudnn.py and nccl.py emulate the vendor libraries with their exact
calling contracts. llmc.cuda picks this package with
use_device("cpu"); the trainers never import it.

What it is not: a GPU. It says nothing about timing, the GPU's weaker memory model (a race that
fibers happen to order never shows; the ThreadSanitizer build is for that, and it sees races
between the threads of a block only: blocks run one after another), tensor-core or cuBLAS/cuDNN
numerics (the vendor libraries are emulated in fp32 NumPy), bank conflicts, register pressure,
occupancy or the GPU's memory limits, or NCCL over a real interconnect. Its arrays keep most of
CuPy's border between host and device (device.ndarray), not all: np.asarray(dev) and
np.add.reduce(dev) run here, and CuPy refuses both.

Checked against the CuPy installed (tests/test_cupy_conformance.py): every CuPy name the project
writes exists in CuPy and its calls bind to CuPy's signature; the calls of a short emulated bf16
training run (CUDA graph, checkpoint) bind too, with the argument types CuPy's Cython signatures
declare; every public name of device.py (but its own machinery, device.EMULATOR_OWN, which CuPy
lacks) is CuPy's, at the same place, with CuPy's defaults, and accepts no call CuPy refuses; the
emulated cuBLAS and NCCL accept no call CuPy's refuse. What that check still cannot see:
  - the behaviour of a call whose signature matches: values, dtype promotion and casting rules,
    broadcasting, which dtypes a function takes, the errors CuPy raises inside a call;
  - argument types where CuPy declares none (untyped Cython parameters, Python annotations,
    extension classes such as Event), and in every call that the recorded run does not make (other
    precisions, multi-GPU, cuDNN and cuBLASLt paths, dev/cuda timing): those are checked from the
    code for their names and argument counts only;
  - operators and NumPy functions on device arrays (dev + x, np.exp(dev)), and dunder protocols
    (x in dev, operator.index(dev)); attributes set on instances (Stream.ptr, Device.id);
  - calls CuPy accepts and the emulator refuses or lacks (order="F", RawModule(backend=...),
    cp.cuda.runtime.memsetAsync): the emulator may be narrower than CuPy, never wider;
  - for the emulated cuBLAS and NCCL, the argument types (a tuple of ints handed to CuPy 14's
    NcclCommunicator(int ndev, bytes commId, ...) passes), their constants and error classes;
  - cuBLASLt (nvmath-python) and the cuDNN frontend, which are not CuPy.
"""
