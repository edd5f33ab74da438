"""
llmc/cudnn_attention.py: cuDNN's fused (flash) attention for gpt2_cuda.py, a library call through
NVIDIA's cuDNN frontend Python package (module `cudnn`), as llm.c's llmc/cudnn_att.cpp does it
through the C++ frontend.

One call computes causal self-attention out = softmax(q k^T / sqrt(HS) + mask) v for all heads,
FlashAttention-2 style (Dao 2023): the (T,T) attention matrix is never stored. Training keeps, per
query row, one float32 softmax statistic instead (stats = max + log(sum exp), natural log), from
which the backward recomputes the attention tile by tile. Compared with gpt2_cuda's own attention
(cuBLAS + softmax kernels), it saves the B*NH*T*T `att` activation and the permute copies.

No permutes: cuDNN takes any strides, so q, k, v are described as strided (B,NH,T,HS) views of the
(B,T,3C) qkv projection itself, the way llm.c does it:
    q, k, v: dims (B,NH,T,HS), strides (T*3C, HS, 3C, 1), starting at elements 0, C, 2C of qkv
    out:     dims (B,NH,T,HS), strides (T*C, HS, C, 1), the (B,T,C) layout the projection reads
    stats:   dims (B,NH,T,1),  strides (NH*T, T, 1, 1), float32
and in the backward dq, dk, dv are written into a (B,T,3C) dqkv laid out like qkv.

Graphs are built once per shape (building is the slow part: heuristics, kernel compilation) and
cached in GRAPHS; one cuDNN handle and one CuPy workspace serve them all, on the caller's current
CuPy stream. The trainer calls prepare() before its first step: every graph of the run built and
the workspace allocated once, at the largest size they need, so that no workspace is replaced
under a CUDA graph that captured its address. A graph built later that needs more gets a larger
workspace, and the old one is kept (never freed: a captured graph may still point at it). Our bf16 tensors are CuPy uint16 arrays holding bf16 bits
(llmc/cuda.py), so the graph declares their type and the variant pack passes raw device pointers.

Which plan: cuDNN's heuristics rank the execution plans (engines and their knobs) for a graph, and
by default the first that builds runs. With autotune = N > 1 (gpt2_cuda.py --autotune N) a graph's
first execution outside a CUDA graph capture builds and times up to N of the ranked plans on the
real operands (one untimed run, then AUTOTUNE_REPEATS between CUDA events, through the frontend's
build_plan_at_index / execute_plan_at_index) and selects the fastest for the rest of the run. The
trials only write what the call writes anyway (o and stats, or dq, dk, dv), so nothing is restored.
A graph first executed inside a capture keeps the first plan. A plan that needs more workspace
gets a larger one, the old one kept (a captured graph may hold it). tuning_report() lists each
tuned graph's timings; a tuned run may differ from an untuned one in the last bits.

What it deliberately is not: a ctypes binding of cuDNN (the frontend package is the binding), an
fp32 path (cuDNN's fused attention needs bf16/fp16; unavailable_reason says so and the trainer
falls back to its own kernels), or a general SDPA wrapper (no dropout, bias, padding or GQA).
Importing this module imports neither `cudnn` nor CuPy; nothing here runs without a GPU except
unavailable_reason and the layout helpers.

Install: pip install nvidia-cudnn-frontend nvidia-cudnn-cu12   (nvidia-cudnn-cu13 for CUDA 13)
The frontend looks for libcudnn in LD_LIBRARY_PATH and this interpreter's site-packages only; a
libcudnn that torch finds elsewhere on sys.path (find_cudnn_library) is loaded for it, and the first
use on a GPU prints one line saying which library was found.
Tests:   pytest tests/test_cudnn_attention.py   (the emulated device's cudnn without a GPU; GPU tests on one)
Legend: B batch, T time, C channels, NH heads, HS = C // NH head size.
"""

import ctypes
import glob
import math
import os
import re
import sys
import sysconfig
from dataclasses import dataclass

import numpy as np

from llmc import cuda
from llmc.utils import InputError

# ----------------------------------------------------------------------------
# what cuDNN attention needs, and where it comes from

FRONTEND_PIP = "nvidia-cudnn-frontend"
LIBRARY_PIP = "nvidia-cudnn-cu12 (nvidia-cudnn-cu13 for CUDA 13)"
PRECISION = "bf16"                       # the only storage precision with a fused path here
# generate_stats= (the forward's "keep the softmax statistics") replaced is_inference= in 1.13
MIN_FRONTEND_VERSION = (1, 13, 0)
# cuDNN 9 serves any T without the frontend's s_kv % 64 padding workaround; the pip wheels are 9.x
MIN_CUDNN_VERSION = (9, 0, 0)
# the frontend refuses bf16/fp16 SDPA forward on these for known bugs (sdpa_support_surface.h)
BROKEN_CUDNN_VERSIONS = ((9, 10, 0), (9, 10, 1))
HEAD_SIZE_MULTIPLE = 8                   # 16-byte rows of bf16
MAX_HEAD_SIZE = 128                      # the SDPA backward's limit on Ampere (Hopper: 256)
# llm.c: the deterministic backward, so that two runs give the same gradients bit for bit (the
# default; gpt2_cuda.py --cudnn-deterministic 0 lets cuDNN sum dq in any order, as PyTorch's SDPA does)
DETERMINISTIC_BACKWARD = True
# Where libcudnn is looked for (the frontend's cudnn/__init__.py, _dlopen_cudnn, 1.32): these names
# in each LD_LIBRARY_PATH folder, then nvidia/<folder>/lib/<glob> of the interpreter's purelib only;
# torch (torch/__init__.py, _preload_cuda_deps) globs nvidia/cudnn/lib/ in every sys.path entry.
CUDNN_LIBRARY_NAMES = ("libcudnn.so.9", "libcudnn.so")
CUDNN_WHEEL_FOLDERS = ("cudnn", "cudnn_jit")    # nvidia-cudnn-cu12 / -cu13, and cuDNN's JIT wheel
CUDNN_LIBRARY_GLOB = "libcudnn.so.*[0-9]"
FOUND_BY_FRONTEND = "the frontend loads it itself"
FOUND_ON_SYS_PATH = "on sys.path, as torch finds it; loaded here for the frontend"

GRAPHS = {}        # (direction, B, T, NH, HS, training, deterministic) -> AttentionGraph, built once
_RESOURCES = {}    # "handle": the cuDNN handle, "workspace": a CuPy uint8 array, "retired": the replaced ones
_LIBRARY = {}      # "cudnn": the line load_cudnn_library said, once per process


AUTOTUNE_REPEATS = 5               # autotune: timed runs per plan (after one untimed run)


@dataclass
class AttentionGraph:
    """One built cuDNN graph: the graph, its tensors by name (the variant pack's keys) and the
    workspace bytes its execution plan needs; once autotuned, each timed plan's name and time per
    run (inf where it did not build or run; [] where the graph first ran inside a capture) and the
    index of the plan kept."""
    graph: object
    tensors: dict
    workspace_bytes: int
    plan_names: list = None
    timings_ms: list = None
    chosen: int = 0


def cudnn_module():
    """The cudnn module of the device (imported on first use): the frontend package on a GPU,
    llmc/emulator/cudnn.py (the same calls on host memory) on the emulated device. On a GPU the
    first call finds libcudnn first (load_cudnn_library) and prints one line saying which."""
    if cuda.device() == "cuda" and "cudnn" not in _LIBRARY:
        _LIBRARY["cudnn"] = load_cudnn_library()
        print(f"cuDNN attention: {_LIBRARY['cudnn']}")
    return cuda.library("cudnn")


def find_cudnn_library(env=None, purelib=None, search_path=None):
    """(path of libcudnn, how it was found), or (None, None). The frontend's own search first,
    LD_LIBRARY_PATH's CUDNN_LIBRARY_NAMES, then purelib/nvidia/{cudnn,cudnn_jit}/lib (purelib: this
    interpreter's, sysconfig); then torch's, nvidia/{cudnn,cudnn_jit}/lib in each entry of search_path
    (default sys.path), where torch's nvidia-cudnn-cu13 sits when it is not in purelib (a venv with
    --system-site-packages, a pip --target folder on PYTHONPATH, the user site). env: default os.environ."""
    env = os.environ if env is None else env
    for folder in filter(None, env.get("LD_LIBRARY_PATH", "").split(os.pathsep)):
        for name in CUDNN_LIBRARY_NAMES:
            if os.path.exists(os.path.join(folder, name)):
                return os.path.join(folder, name), f"LD_LIBRARY_PATH; {FOUND_BY_FRONTEND}"
    roots = [(purelib or sysconfig.get_path("purelib"), f"site-packages; {FOUND_BY_FRONTEND}")]
    roots += [(entry, FOUND_ON_SYS_PATH) for entry in (sys.path if search_path is None else search_path) if entry]
    for root, how in roots:
        for folder in CUDNN_WHEEL_FOLDERS:
            found = sorted(glob.glob(os.path.join(root, "nvidia", folder, "lib", CUDNN_LIBRARY_GLOB)))
            if found:
                return found[0], how
    return None, None


def load_cudnn_library(env=None, purelib=None, search_path=None):
    """Make libcudnn loadable by the frontend, and say which was found (one line). Where only
    torch's search finds it, it is loaded here with RTLD_GLOBAL: the frontend's last resort,
    dlopen("libcudnn.so.9"), then gets this library, as the dynamic linker matches a loaded
    library's soname. Raises OSError where that library does not load."""
    path, how = find_cudnn_library(env, purelib, search_path)
    if path is None:
        return ("no libcudnn in LD_LIBRARY_PATH, site-packages or on sys.path: the frontend tries the "
                "system's libcudnn.so.9")
    if how == FOUND_ON_SYS_PATH:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return f"libcudnn {path} ({how})"


def _first_line(error):
    """`Type: message`, first line only: what a one-line error carries of a library's message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _version_tuple(text):
    """The leading (major, minor, patch) integers of a version string: '1.29.0.dev6' -> (1, 29, 0)."""
    numbers = [int(n) for n in re.findall(r"\d+", str(text))[:3]]
    return tuple(numbers + [0] * (3 - len(numbers)))


def cudnn_version_tuple(number):
    """cudnnGetVersion()'s integer as (major, minor, patch). cuDNN 9 encodes major*10000 +
    minor*100 + patch (90100 is 9.1.0), cuDNN 8 major*1000 + minor*100 + patch (8907 is 8.9.7)."""
    if number >= 10000:
        return number // 10000, number // 100 % 100, number % 100
    return number // 1000, number // 100 % 10, number % 100


def _dotted(version):
    return ".".join(str(n) for n in version)


def unavailable_reason(precision, HS):
    """None if cuDNN attention can run here for this storage precision and head size, else one
    short line saying why not (the trainer prints it and falls back to its own attention). Checks,
    in order: bf16 storage, the head size, the frontend package and its version, the cuDNN library
    and its version. Imports `cudnn` (which loads the library) but needs no GPU."""
    if precision != PRECISION:
        return f"cuDNN attention needs --precision {PRECISION} (its fused attention runs in bf16/fp16), not {precision}"
    if HS % HEAD_SIZE_MULTIPLE or not 0 < HS <= MAX_HEAD_SIZE:
        return (f"cuDNN attention needs a head size C/NH that is a multiple of {HEAD_SIZE_MULTIPLE} "
                f"and at most {MAX_HEAD_SIZE}, not {HS}")
    try:
        cudnn = cudnn_module()
    except Exception as e:                 # ImportError, or the package's own load failing
        return f"the cuDNN frontend is not importable ({_first_line(e)}): pip install {FRONTEND_PIP} {LIBRARY_PIP}"
    frontend = _version_tuple(getattr(cudnn, "__version__", "0"))
    if frontend < MIN_FRONTEND_VERSION:
        return (f"{FRONTEND_PIP} {_dotted(frontend)} is too old for cuDNN attention (needs >= "
                f"{_dotted(MIN_FRONTEND_VERSION)}): pip install -U {FRONTEND_PIP}")
    try:
        found = cudnn_version_tuple(int(cudnn.backend_version()))
    except Exception as e:                 # libcudnn.so not found: the frontend cannot resolve its symbols
        return f"the cuDNN library is not loadable ({_first_line(e)}): pip install {LIBRARY_PIP}"
    if found < MIN_CUDNN_VERSION:
        return (f"cuDNN {_dotted(found)} found; cuDNN attention (SDPA forward and backward) needs >= "
                f"{_dotted(MIN_CUDNN_VERSION)}: pip install -U {LIBRARY_PIP}")
    if found in BROKEN_CUDNN_VERSIONS:
        return f"cuDNN {_dotted(found)} has known bf16 SDPA bugs (the frontend refuses it): install 9.10.2 or newer"
    return None


# ----------------------------------------------------------------------------
# the memory layouts: strided views of our buffers, in elements

QKV_SECTIONS = ("q", "k", "v")           # qkv's last axis is [q | k | v], C channels each


def qkv_layout(B, T, NH, HS):
    """dims, strides of q, k or v (and of dq, dk, dv in dqkv) as a (B,NH,T,HS) view of the
    (B,T,3C) projection: element (b,h,t,s) of section j sits at b*T*3C + t*3C + j*C + h*HS + s."""
    C = NH * HS
    return [B, NH, T, HS], [T * 3 * C, HS, 3 * C, 1]


def out_layout(B, T, NH, HS):
    """dims, strides of out (and dout) as a (B,NH,T,HS) view of the (B,T,C) buffer the attention
    projection reads: element (b,h,t,s) sits at b*T*C + t*C + h*HS + s."""
    C = NH * HS
    return [B, NH, T, HS], [T * C, HS, C, 1]


def stats_layout(B, T, NH):
    """dims, strides of the softmax statistics, a contiguous (B,NH,T) float32 array, as cuDNN's
    (B,NH,T,1)."""
    return [B, NH, T, 1], [NH * T, T, 1, 1]


def qkv_pointers(qkv, C):
    """Device addresses (q, k, v), or (dq, dk, dv), inside a (B,T,3C) buffer: its start plus 0, C
    and 2C elements."""
    base, itemsize = cuda.address(qkv), qkv.dtype.itemsize
    return tuple(base + j * C * itemsize for j in range(len(QKV_SECTIONS)))


# ----------------------------------------------------------------------------
# the graphs (library calls), built once per shape

def _handle():
    """The process's cuDNN handle, created on first use on the current device (one GPU per
    process: llmc.cuda.select_device)."""
    if "handle" not in _RESOURCES:
        _RESOURCES["handle"] = cudnn_module().create_handle()
    return _RESOURCES["handle"]


def _workspace(nbytes):
    """The shared CuPy workspace, at least nbytes. A larger one replaces a smaller one, which is
    kept in _RESOURCES["retired"], not freed: a CUDA graph captured earlier may hold its address."""
    current = _RESOURCES.get("workspace")
    if current is None or current.size < nbytes:
        if current is not None:
            _RESOURCES.setdefault("retired", []).append(current)
        _RESOURCES["workspace"] = cuda.cupy().zeros((max(1, nbytes),), dtype=np.uint8)
    return _RESOURCES["workspace"]


def prepare(sizes, NH, HS, deterministic=DETERMINISTIC_BACKWARD):
    """Build every graph a run needs, the forward and backward for each (B,T) in `sizes` (the
    training, evaluation and sampling batches; deterministic: the backward's), then allocate the
    workspace once at the largest of their sizes: called before any CUDA graph capture. Raises
    InputError as attention_graph."""
    entries = [attention_graph(direction, B, T, NH, HS, deterministic=deterministic)
               for B, T in sizes for direction in DESCRIBE]
    return _workspace(max(entry.workspace_bytes for entry in entries))


def _new_graph(cudnn):
    """An empty graph: bf16 in and out, fp32 for the intermediates (the scores) and the math."""
    return cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16,
                         intermediate_data_type=cudnn.data_type.FLOAT,
                         compute_data_type=cudnn.data_type.FLOAT, handle=_handle())


def _causal(cudnn):
    """The causal mask in the frontend's current form: the band ends on the diagonal (a query
    sees keys 0..t), aligned at the top left because T_q == T_kv."""
    return dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=0)


def _describe_forward(cudnn, graph, B, T, NH, HS, training):
    """Declare q, k, v -> sdpa -> out (and stats when training) on `graph`; returns the tensors."""
    bf16, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    dim, stride = qkv_layout(B, T, NH, HS)
    t = {name.upper(): graph.tensor(name=name.upper(), dim=dim, stride=stride, data_type=bf16) for name in QKV_SECTIONS}
    out, stats = graph.sdpa(name="flash_attention", q=t["Q"], k=t["K"], v=t["V"], generate_stats=training,
                            attn_scale=1.0 / math.sqrt(HS), **_causal(cudnn))
    dim, stride = out_layout(B, T, NH, HS)
    t["O"] = out.set_output(True).set_dim(dim).set_stride(stride).set_data_type(bf16)
    if training:
        dim, stride = stats_layout(B, T, NH)
        t["Stats"] = stats.set_output(True).set_dim(dim).set_stride(stride).set_data_type(f32)
    return t


def _describe_backward(cudnn, graph, B, T, NH, HS, training, deterministic=DETERMINISTIC_BACKWARD):
    """Declare q, k, v, o, dO, stats -> sdpa_backward -> dq, dk, dv on `graph` (deterministic: cuDNN's
    deterministic algorithm, dq summed in a fixed order); returns the tensors."""
    bf16, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    qkv_dim, qkv_stride = qkv_layout(B, T, NH, HS)
    out_dim, out_stride = out_layout(B, T, NH, HS)
    stats_dim, stats_stride = stats_layout(B, T, NH)
    t = {name.upper(): graph.tensor(name=name.upper(), dim=qkv_dim, stride=qkv_stride, data_type=bf16)
         for name in QKV_SECTIONS}
    t["O"] = graph.tensor(name="O", dim=out_dim, stride=out_stride, data_type=bf16)
    t["dO"] = graph.tensor(name="dO", dim=out_dim, stride=out_stride, data_type=bf16)
    t["Stats"] = graph.tensor(name="Stats", dim=stats_dim, stride=stats_stride, data_type=f32)
    grads = graph.sdpa_backward(name="flash_attention_backward", q=t["Q"], k=t["K"], v=t["V"], o=t["O"],
                                dO=t["dO"], stats=t["Stats"], attn_scale=1.0 / math.sqrt(HS),
                                use_deterministic_algorithm=bool(deterministic), **_causal(cudnn))
    for name, grad in zip(("dQ", "dK", "dV"), grads):   # written into dqkv, laid out like qkv
        t[name] = grad.set_output(True).set_dim(qkv_dim).set_stride(qkv_stride).set_data_type(bf16)
    return t


DESCRIBE = {"forward": _describe_forward, "backward": _describe_backward}


def attention_graph(direction, B, T, NH, HS, training=True, deterministic=DETERMINISTIC_BACKWARD):
    """The cached AttentionGraph for `direction` ("forward" or "backward") at this shape, built
    on first use: validate, build the operation graph, heuristics (mode A, then the fallback
    list), support check, plans (the workspace is allocated by prepare, or at execution).
    deterministic: the backward's algorithm (the forward's key keeps it, unused). Raises InputError
    (one line naming the shape and cuDNN's reason) if cuDNN cannot build it."""
    key = (direction, B, T, NH, HS, bool(training), bool(deterministic))
    if key in GRAPHS:
        return GRAPHS[key]
    cudnn = cudnn_module()
    try:
        graph = _new_graph(cudnn)
        extra = dict(deterministic=deterministic) if direction == "backward" else {}
        tensors = DESCRIBE[direction](cudnn, graph, B, T, NH, HS, training, **extra)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        workspace_bytes = int(graph.get_workspace_size())
    except Exception as e:                 # cudnnGraphNotSupportedError, ValueError, RuntimeError, ...
        mode = "training" if training else "inference"
        raise InputError(f"cuDNN attention: cannot build the {direction} graph for B={B}, T={T}, NH={NH}, "
                         f"HS={HS} ({mode}): {_first_line(e)}") from None
    GRAPHS[key] = AttentionGraph(graph, tensors, workspace_bytes)
    return GRAPHS[key]


def _execute(entry, pointers, label, autotune=1):
    """Run a built graph on the current CuPy stream: the variant pack maps each of its tensors to
    a device address (an int). autotune > 1: the graph's first run outside a capture times its
    plans first (_autotune). Raises RuntimeError (one line, `label` names the call and shape)."""
    cudnn = cudnn_module()
    handle = _handle()
    stream = cuda.cupy().cuda.get_current_stream()
    cudnn.set_stream(handle, stream.ptr)
    variant_pack = {entry.tensors[name]: int(ptr) for name, ptr in pointers.items()}
    if autotune > 1 and entry.timings_ms is None:
        if stream.is_capturing():
            entry.timings_ms = []          # recorded, not run: nothing to time; keep the first plan
        else:
            _autotune(entry, variant_pack, handle, autotune)
    workspace = _workspace(entry.workspace_bytes)
    try:
        entry.graph.execute(variant_pack, cuda.address(workspace), handle=handle)
    except Exception as e:
        raise RuntimeError(f"cuDNN attention: {label} failed: {_first_line(e)}") from e


def _autotune(entry, variant_pack, handle, count):
    """Time up to `count` of the graph's ranked plans on the variant pack's operands and select the
    fastest (build_plan_at_index selects the plan that execute() runs). A plan that does not build
    or run is skipped (inf); where none ran, nothing is selected again (a plan that declines to
    build leaves the selection as it was), and the run's execute says what failed."""
    cp = cuda.cupy()
    graph = entry.graph
    timings, names = [], []
    for index in range(min(count, graph.get_execution_plan_count())):
        names.append(_plan_name(graph, index))
        try:
            graph.build_plan_at_index(index)
            workspace = cuda.address(_workspace(int(graph.get_workspace_size_plan_at_index(index))))
            graph.execute_plan_at_index(variant_pack, workspace, index, handle)     # untimed: first-run costs
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            for _ in range(AUTOTUNE_REPEATS):
                graph.execute_plan_at_index(variant_pack, workspace, index, handle)
            end.record()
            end.synchronize()
            timings.append(cp.cuda.get_elapsed_time(start, end) / AUTOTUNE_REPEATS)
        except Exception:                  # noqa: BLE001 (a plan cuDNN declines: cudnnGraphNotSupportedError, ...)
            timings.append(float("inf"))
    if timings and min(timings) < float("inf"):
        entry.chosen = int(np.argmin(timings))
        graph.build_plan_at_index(entry.chosen)
        entry.workspace_bytes = int(graph.get_workspace_size())
    entry.plan_names, entry.timings_ms = names, timings


def _plan_name(graph, index):
    """The frontend's name of ranked plan `index` (its engine and knobs), or "plan <index>"."""
    try:
        return str(graph.get_plan_name_at_index(index))
    except Exception:                      # noqa: BLE001 (a name is only for the report)
        return f"plan {index}"


def tuning_report():
    """One line per autotuned graph: its direction and shape, the time per run of the first plan
    and of the one kept (with its name), and all the timings in the ranked order."""
    lines = []
    for (direction, B, T, NH, HS, training, deterministic), entry in GRAPHS.items():
        if entry.timings_ms:
            first, best = entry.timings_ms[0], entry.timings_ms[entry.chosen]
            kind = f"{direction}{'' if deterministic or direction != 'backward' else ' (non-deterministic)'}"
            if min(entry.timings_ms) == float("inf"):
                lines.append(f"cuDNN attention {kind} B={B} T={T} NH={NH} HS={HS}: none of the "
                             f"{len(entry.timings_ms)} plans tried ran; the one build_plans chose is kept")
                continue
            lines.append(f"cuDNN attention {kind} B={B} T={T} NH={NH} HS={HS}: first plan {first:.4f} ms, kept "
                         f"#{entry.chosen + 1} of {len(entry.timings_ms)} ({entry.plan_names[entry.chosen]}) "
                         f"{best:.4f} ms ({first / best:.3f}x); all: " + " ".join(f"{t:.4f}" for t in entry.timings_ms))
    return lines


# ----------------------------------------------------------------------------
# the launchers gpt2_cuda.py calls

def attention_forward_cudnn(out, stats, qkv, B, T, NH, HS, training=True, autotune=1,
                            deterministic=DETERMINISTIC_BACKWARD):
    """Library call: causal self-attention of qkv (B,T,3C) into out (B,T,C), both bf16 bits
    (uint16), and, when training, the softmax statistics stats (B,NH,T) float32 (natural-log
    max + log sum exp per query row) that attention_backward_cudnn needs; stats may be None
    otherwise. Same math as gpt2_cpu.attention_forward with att never stored. autotune: how many of
    cuDNN's plans the graph's first run times (the module docstring; 1: the first plan);
    deterministic: which backward the run uses (the forward's graph is keyed by it too, so that
    prepare's graphs are the ones found). Raises TypeError / ValueError for bad arguments,
    InputError when cuDNN cannot build the graph."""
    C = NH * HS
    bf16 = cuda.FLOATX_DTYPES[PRECISION]
    cuda.check_array(qkv, bf16, B * T * 3 * C, "attention_forward_cudnn: qkv")
    cuda.check_array(out, bf16, B * T * C, "attention_forward_cudnn: out")
    q, k, v = qkv_pointers(qkv, C)
    pointers = {"Q": q, "K": k, "V": v, "O": cuda.address(out)}
    if training:
        cuda.check_array(stats, np.float32, B * NH * T, "attention_forward_cudnn: stats", aligned=False)
        pointers["Stats"] = cuda.address(stats)
    entry = attention_graph("forward", B, T, NH, HS, training, deterministic)
    _execute(entry, pointers, f"forward B={B}, T={T}, NH={NH}, HS={HS}", autotune)


def attention_backward_cudnn(dqkv, dout, qkv, out, stats, B, T, NH, HS, autotune=1,
                             deterministic=DETERMINISTIC_BACKWARD):
    """Library call, the backward of attention_forward_cudnn: writes (=) dqkv (B,T,3C), the
    gradient of the qkv projection laid out like qkv, from dout (B,T,C) and the forward's qkv,
    out and stats. bf16 bits except stats (float32). Same math as gpt2_cpu.attention_backward,
    the attention tiles recomputed from stats; deterministic: cuDNN's deterministic algorithm (dq
    summed in a fixed order; False lets it sum in any order, faster where atomics help). autotune
    and raises as attention_forward_cudnn."""
    C = NH * HS
    bf16 = cuda.FLOATX_DTYPES[PRECISION]
    for name, arr, size in (("dqkv", dqkv, 3 * C), ("dout", dout, C), ("qkv", qkv, 3 * C), ("out", out, C)):
        cuda.check_array(arr, bf16, B * T * size, f"attention_backward_cudnn: {name}")
    cuda.check_array(stats, np.float32, B * NH * T, "attention_backward_cudnn: stats", aligned=False)
    entry = attention_graph("backward", B, T, NH, HS, training=True, deterministic=deterministic)
    q, k, v = qkv_pointers(qkv, C)
    dq, dk, dv = qkv_pointers(dqkv, C)
    pointers = {"Q": q, "K": k, "V": v, "O": cuda.address(out), "dO": cuda.address(dout),
                "Stats": cuda.address(stats), "dQ": dq, "dK": dk, "dV": dv}
    _execute(entry, pointers, f"backward B={B}, T={T}, NH={NH}, HS={HS}", autotune)
