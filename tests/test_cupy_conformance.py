"""
tests/test_cupy_conformance.py: the emulated device against the CuPy installed here (`make test`
installs cupy-cuda12x, which imports without a GPU). Four checks:

  1. every CuPy name the project writes on the device (`cp.X`, `cupy.X`, `cuda.cupy().X` in
     *_cuda.py, llmc/, dev/, dev/cuda/, doc/; read from the code) exists in CuPy, and each call
     binds to CuPy's signature (positional count, keyword names);
  2. every call the project makes on the emulated device's CuPy namespace during a short training
     run (bf16, a CUDA graph, a checkpoint, the memory log; recorded) binds to CuPy's signature, and
     its arguments have the Python types CuPy's Cython signature declares (`tuple grid`, `size_t
     shared_mem`, ...);
  3. every public name the emulator offers (llmc/emulator/device.py, its `cuda` namespace, its
     classes and its ndarray) exists in CuPy at the same place, and every emulator function accepts
     no call that CuPy's refuses (no keyword CuPy lacks, no positional parameter that is
     keyword-only in CuPy);
  4. the emulated cuBLAS and NCCL (llmc/emulator/cublas.py, nccl.py: CuPy's modules
     cupy_backends.cuda.libs.cublas / .nccl on a GPU) accept no call CuPy's refuses, and every call
     the code writes on them (gemmEx, NcclCommunicator.allReduce, ...) binds to CuPy's signature.

CuPy's signatures: inspect.signature where it works (Python functions and classes); else the
first lines of the docstring, which CuPy builds with Cython's embedsignature ("memcpyAsync(intptr_t
dst, intptr_t src, size_t size, int kind, intptr_t stream)"; for cuBLAS and NCCL read from the
extension module's file, which does not load without libcublas / libnccl); else SOURCE_SIGNATURES
below, copied from CuPy's source with its file. What this cannot see is listed in llmc/emulator/__init__.py.

    python -m pytest -q tests/test_cupy_conformance.py      # a few seconds with a warm .emulator-cache/
"""

import ast
import glob
import inspect
import os
import re
import sys
import types

import numpy as np
import pytest

import gpt2_cpu
import gpt2_cuda
import llmc.cuda
from llmc import formats
from llmc.emulator import device

try:
    import cupy
except Exception as e:                 # not installed, or a CUDA library that cannot load
    pytest.skip(f"CuPy is not importable ({type(e).__name__}: {e}): nothing to compare the emulator with",
                allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMULATOR_DIR = os.path.join(ROOT, "llmc", "emulator")
SOURCES = ("*_cuda.py", "llmc/*.py", "dev/*.py", "dev/cuda/*.py", "doc/*.py")
CUPY_NAMES = ("cp", "cupy")            # the names the project gives CuPy's module (or llmc.cuda.cupy())

# Signatures CuPy exposes neither to inspect nor in its docstring, from CuPy's source at v14.2.0
SOURCE_SIGNATURES = {
    # cupy/_core/raw.pyx: RawKernel.__call__(self, grid, block, args, **kwargs) passes **kwargs on to
    # cupy/cuda/function.pyx Function.__call__:
    "RawKernel.__call__": "(self, tuple grid, tuple block, args, size_t shared_mem=0, stream=None, "
                          "enable_cooperative_groups=False)",
}

# ----------------------------------------------------------------------------
# CuPy's signatures

# Cython's C types and the Python values it converts to them (None is refused by C types, allowed
# for Python object types unless declared `not None`)
INTEGER_TYPES = ("intptr_t", "uintptr_t", "size_t", "Py_ssize_t", "ptrdiff_t", "int64_t", "uint64_t", "int32_t",
                 "uint32_t")
C_INTEGER_WORDS = {"int", "long", "short", "unsigned", "signed"}           # "int", "long long", "unsigned int"
FLOAT_TYPES = ("double", "float")
OBJECT_TYPES = {"str": str, "tuple": tuple, "list": list, "dict": dict, "bytes": bytes}


def _accepts(cython_type, value_type):
    """Whether Cython converts a value of Python type `value_type` to `cython_type`; None where the
    type is one this check does not model (an extension class, an untyped parameter)."""
    if cython_type in INTEGER_TYPES or (cython_type and set(cython_type.split()) <= C_INTEGER_WORDS):
        return hasattr(value_type, "__index__")
    if cython_type in FLOAT_TYPES:
        return hasattr(value_type, "__float__") or hasattr(value_type, "__index__")
    if cython_type == "bint":
        return True
    if cython_type in OBJECT_TYPES:
        return value_type is type(None) or issubclass(value_type, OBJECT_TYPES[cython_type])
    return None


def _parse_signature(text):
    """(inspect.Signature, {parameter: Cython type}) of a signature's text "(a, int b=0, /, *,
    c=None, **kw)"; None where it does not parse. Defaults are read as present, not by value."""
    P = inspect.Parameter
    text = text.replace("\\*", "*")
    params, ctypes_, kind = [], {}, P.POSITIONAL_OR_KEYWORD
    for part in _split_params(text[text.index("(") + 1:text.rindex(")")]):
        name_part, _, default = part.partition("=")
        words = name_part.replace(" not None", "").split()
        name = words[-1]
        if name == "/":
            params = [p.replace(kind=P.POSITIONAL_ONLY) for p in params]
            continue
        if name == "*":
            kind = P.KEYWORD_ONLY
            continue
        if name.startswith("**"):
            params.append(P(name[2:], P.VAR_KEYWORD))
            continue
        if name.startswith("*"):
            params.append(P(name[1:], P.VAR_POSITIONAL))
            kind = P.KEYWORD_ONLY
            continue
        if len(words) > 1:
            ctypes_[name] = " ".join(words[:-1])
        if not name.isidentifier():
            return None
        params.append(P(name, kind, default=None if default else P.empty))
    try:
        return inspect.Signature(params), ctypes_
    except ValueError:                 # e.g. a parameter without a default after one with
        return None


def _split_params(text):
    """The comma-separated parameters of a signature, commas inside brackets and quotes kept."""
    parts, depth, quote, current = [], 0, None, ""
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        current += ch
    return [p for p in parts + [current.strip()] if p]


def cupy_signature(path, obj):
    """(inspect.Signature, {parameter: Cython type}, source) of CuPy's callable `obj` at `path`
    ("cuda.runtime.memcpyAsync"); for a class, its constructor's (without self). None where CuPy
    gives none."""
    key = ".".join(path.split(".")[-2:])
    if key in SOURCE_SIGNATURES:
        sig, ctypes_ = _parse_signature(SOURCE_SIGNATURES[key])
        return sig, ctypes_, "SOURCE_SIGNATURES"
    try:
        return inspect.signature(obj), {}, "inspect"
    except (TypeError, ValueError):
        pass
    names = "|".join(re.escape(n) for n in {getattr(obj, "__name__", ""), path.split(".")[-1]} if n)
    for line in (getattr(obj, "__doc__", None) or "").strip().splitlines()[:3]:
        m = re.match(rf"^(?:\w+\.)*(?:{names})(\(.*\))(?:\s*->.*)?$", line.strip())
        if m:
            parsed = _parse_signature(m.group(1))
            if parsed:
                return (*parsed, "docstring")
    return None


def _without_self(sig):
    params = list(sig.parameters.values())
    return sig.replace(parameters=params[1:]) if params and params[0].name == "self" else sig


def resolve(path):
    """CuPy's object at `path` ("cuda.runtime.getDeviceCount"), or AttributeError."""
    obj = cupy
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check_call(path, n_positional, keywords, types_=None):
    """The reasons CuPy would refuse a call of `path` with `n_positional` positional arguments and
    `keywords` (and, where given, arguments of `types_`: a list of (parameter index or keyword, type)),
    as a list of strings (empty: CuPy takes it)."""
    try:
        obj = resolve(path)
    except AttributeError:
        return [f"cupy.{path} does not exist in CuPy {cupy.__version__}"]
    if not callable(obj):
        return [f"cupy.{path} is not callable in CuPy"]
    found = cupy_signature(path, obj)
    if found is None:
        return [f"cupy.{path}: CuPy exposes no signature; add it to SOURCE_SIGNATURES from CuPy's source"]
    sig, ctypes_, source = found
    sig = _without_self(sig)
    try:
        sig.bind(*range(n_positional), **{k: None for k in keywords})
    except TypeError as e:
        return [f"cupy.{path}{sig} ({source}) refuses {n_positional} positional argument(s) and "
                f"keywords {sorted(keywords)}: {e}"]
    errors = []
    positional = [p.name for p in sig.parameters.values()
                  if p.kind not in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD)]
    for where, value_type in types_ or ():
        name = positional[min(where, len(positional) - 1)] if isinstance(where, int) else where   # *args: the last
        ok = _accepts(ctypes_.get(name), value_type)
        if ok is False:
            errors.append(f"cupy.{path}: {name} is declared `{ctypes_[name]} {name}` ({source}), "
                          f"the project passes a {value_type.__name__}")
    return errors


# ----------------------------------------------------------------------------
# 1. the names the project writes: read from the code

def _source_files():
    return sorted(f for pattern in SOURCES for f in glob.glob(os.path.join(ROOT, pattern)))


def _cupy_chain(node):
    """The CuPy path of an attribute expression (`cp.cuda.runtime.memGetInfo` ->
    "cuda.runtime.memGetInfo", `cuda.cupy().zeros` -> "zeros"), or None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    root_is_cupy = (isinstance(node, ast.Name) and node.id in CUPY_NAMES) or (
        isinstance(node, ast.Call) and not node.args and isinstance(node.func, ast.Attribute)
        and node.func.attr == "cupy")
    return ".".join(reversed(parts)) if parts and root_is_cupy else None


def static_uses():
    """{(file:line, CuPy path, positional count or None, keywords)}: every attribute of CuPy the
    project's code writes; calls carry their argument counts (None: an attribute, or a call with
    *args / **kwargs that cannot be counted)."""
    uses = set()
    for path in _source_files():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        called = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                called[id(node.func)] = node
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            chain = _cupy_chain(node)
            if chain is None:
                continue
            where = f"{os.path.relpath(path, ROOT)}:{node.lineno}"
            call = called.get(id(node))
            countable = call is not None and not any(isinstance(a, ast.Starred) for a in call.args) and all(
                k.arg for k in call.keywords)
            uses.add((where, chain, len(call.args) if countable else None,
                      tuple(sorted(k.arg for k in call.keywords)) if countable else ()))
    return uses


def test_the_static_scan_finds_the_projects_cupy_calls():
    found = {chain for _, chain, _, _ in static_uses()}
    # a few the project certainly writes, so that a broken scan cannot pass the next test by finding nothing
    assert {"zeros", "RawModule", "cuda.get_current_stream", "cuda.runtime.getDeviceProperties",
            "cuda.compiler.CompileException"} <= found


def test_every_cupy_name_the_code_writes_exists_with_its_calls():
    errors = []
    for where, chain, n_positional, keywords in sorted(static_uses()):
        if chain == "__version__":
            continue                   # a module attribute, not a call
        prefixes = [".".join(chain.split(".")[:i]) for i in range(1, chain.count(".") + 2)]
        missing = [p for p in prefixes if not _exists(p)]
        if missing:
            errors.append(f"{where}: cupy.{missing[0]} does not exist in CuPy {cupy.__version__}")
        elif n_positional is not None:
            errors += [f"{where}: {e}" for e in check_call(chain, n_positional, keywords)]
    assert not errors, "\n".join(errors)


def _exists(path):
    try:
        resolve(path)
        return True
    except AttributeError:
        return False


# ----------------------------------------------------------------------------
# 2. the calls the project makes on the emulated device: recorded over a short training run

def _emulator_callables():
    """(CuPy path, owner, attribute name) of every callable the emulator's CuPy namespace offers:
    device.py's functions and classes (called: their constructor), the functions of its `cuda`
    namespace (and runtime, device, compiler), and the public methods of its classes."""
    found = []
    for prefix, owner in _emulator_namespaces():
        for name, value in _public(owner):
            if _exists(prefix + name) and resolve(prefix + name) is value:
                continue               # CuPy's own object (cp.float32 is numpy.float32 in both)
            if inspect.isclass(value) and issubclass(value, np.ndarray):
                found += [(f"{prefix}{name}.{m}", value, m) for m, v in vars(value).items()
                          if not m.startswith("_") and inspect.isfunction(v)]
            elif inspect.isclass(value):
                found.append((f"{prefix}{name}", value, "__init__"))
                found += [(f"{prefix}{name}.{m}", value, m) for m, v in vars(value).items()
                          if not m.startswith("_") and inspect.isfunction(v)]
                if "__call__" in vars(value):
                    found.append((f"{prefix}{name}.__call__", value, "__call__"))
            elif callable(value) and not isinstance(value, types.ModuleType):
                found.append((f"{prefix}{name}", owner, name))
    return found


def _emulator_namespaces():
    """(CuPy path prefix, namespace) of the emulator's module and its SimpleNamespaces."""
    return [("", device), ("cuda.", device.cuda), ("cuda.runtime.", device.cuda.runtime),
            ("cuda.device.", device.cuda.device), ("cuda.compiler.", device.cuda.compiler)]


def _public(owner):
    names = getattr(owner, "__dict__", {})
    return [(n, v) for n, v in list(names.items()) if not n.startswith("_")
            and not isinstance(v, types.ModuleType) and n not in device.EMULATOR_OWN]


@pytest.fixture
def recorded_calls(monkeypatch):
    """A list collecting (CuPy path, positional argument types, {keyword: type}) of every call the
    project's code (not the emulator's own) makes on the emulator's CuPy namespace."""
    calls = []
    for path, owner, name in _emulator_callables() + _inherited_array_methods():
        monkeypatch.setattr(owner, name, _recorder(calls, path, getattr(owner, name), method=inspect.isclass(owner)))
    return calls


def _inherited_array_methods():
    """("ndarray.<name>", device.ndarray, name) of the methods the emulator's arrays inherit from
    NumPy's and CuPy's arrays also have (reshape, view, astype, ...)."""
    return [(f"ndarray.{m}", device.ndarray, m) for m in dir(cupy.ndarray) if not m.startswith("_")
            and m not in vars(device.ndarray) and callable(getattr(np.ndarray, m, None))
            and not inspect.isclass(getattr(np.ndarray, m))]


def _recorder(calls, path, original, method):
    """`original` wrapped to append (path, positional types, keyword types) when called from the
    project's own files: not from llmc/emulator/ (the emulator calling itself is not the project
    calling CuPy), not from NumPy (its functions calling the arrays' methods)."""

    def recording(*args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        if caller.startswith(ROOT + os.sep) and not caller.startswith(EMULATOR_DIR):
            positional = args[1:] if method else args
            calls.append((path, tuple(type(a) for a in positional), {k: type(v) for k, v in kwargs.items()}))
        return original(*args, **kwargs)
    return recording


def test_every_call_on_the_emulated_device_binds_to_cupys_signature(recorded_calls, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(llmc.cuda, "_device", llmc.cuda.device())      # restored after the test
    # modules loaded by an earlier test would hide RawModule and get_function from the recording
    monkeypatch.setattr(llmc.cuda, "_MODULES", {})
    monkeypatch.setattr(llmc.cuda, "_FUNCTIONS", {})
    config = gpt2_cpu.GPT2Config(max_seq_len=16, vocab_size=100, padded_vocab_size=128, num_layers=1,
                                 num_heads=2, channels=32)
    model, data = str(tmp_path / "tiny.bin"), str(tmp_path / "train.bin")
    gpt2_cpu.write_model(model, gpt2_cpu.gpt2_init(config, 42))
    formats.write_shard(data, np.random.default_rng(0).integers(0, config.vocab_size, 2000))
    # bf16 (the GPU default), 2 micro-batches a step under a CUDA graph, the memory log, a checkpoint
    argv = ["-e", model, "-i", data, "-j", "", "-b", "2", "-t", "8", "-x", "2", "-s", "0", "-v", "2", "-l", "1e-3",
            "-d", "32", "--precision", "bf16", "--cuda-graph", "1", "-lg", "1", "-n", "2", "-o", str(tmp_path / "out"),
            "--device", "cpu"]
    assert gpt2_cuda.main(argv) == 0
    capsys.readouterr()
    paths = {path for path, _, _ in recorded_calls}
    # the run reached the parts of CuPy it must: allocation, kernels, streams, graphs, array methods
    assert {"zeros", "RawModule", "RawKernel.__call__", "cuda.get_current_stream", "cuda.Stream.begin_capture",
            "cuda.Graph.launch", "ndarray.get", "ndarray.set", "ndarray.reshape"} <= paths, " ".join(sorted(paths))
    errors = []
    for path, positional, keywords in set((p, a, tuple(sorted(k.items()))) for p, a, k in recorded_calls):
        keywords = dict(keywords)
        types_ = list(enumerate(positional)) + list(keywords.items())
        errors += check_call(path, len(positional), keywords, types_)
    assert not errors, "\n".join(sorted(set(errors)))


# ----------------------------------------------------------------------------
# 3. what the emulator offers: CuPy's names, and no call that CuPy refuses

def test_every_name_the_emulator_offers_exists_in_cupy():
    errors = []
    for prefix, owner in _emulator_namespaces():
        for name, value in _public(owner):
            if not _exists(prefix + name):
                errors.append(f"the emulator offers cp.{prefix}{name}; CuPy {cupy.__version__} has no cupy.{prefix}{name}")
            elif inspect.isclass(value) and not issubclass(value, np.ndarray):   # ndarray: below
                errors += [f"the emulator offers cp.{prefix}{name}.{m}; CuPy has no cupy.{prefix}{name}.{m}"
                           for m in vars(value) if not m.startswith("_") and not hasattr(resolve(prefix + name), m)]
    errors += [f"the emulator's arrays offer .{m}; cupy.ndarray has none" for m in dir(device.ndarray)
               if not m.startswith("_") and not hasattr(cupy.ndarray, m) and _offered(device.ndarray, m)]
    assert not errors, "\n".join(errors)


def _offered(cls, name):
    """Whether instances of `cls` answer `name` (an attribute that raises AttributeError does not)."""
    try:
        getattr(cls(()) if cls is device.ndarray else cls, name)
        return True
    except AttributeError:
        return False


def test_the_emulators_own_names_are_not_cupys():
    # the emulator's machinery (EMULATOR_OWN) may not hide a name CuPy has: that one must behave as CuPy's
    clashes = [n for n in device.EMULATOR_OWN if hasattr(cupy, n) or hasattr(cupy.cuda, n)]
    assert not clashes
    assert all(hasattr(device, n) for n in device.EMULATOR_OWN)             # no stale entry


def test_the_names_a_cupy_user_writes_are_offered():
    # a learner's cp.float32 and friends: the names CuPy re-exports from NumPy, and the array functions
    for name in ("float32", "float16", "float64", "int32", "int64", "uint8", "uint16", "uint64", "bool_", "dtype",
                 "ndarray", "empty_like", "zeros_like", "ones_like", "full_like", "asnumpy", "asarray", "array",
                 "arange", "zeros", "empty", "ones", "full", "float16", "int8", "int16", "uint32"):
        assert hasattr(device, name), f"cp.{name} is missing on the emulated device"
        assert hasattr(cupy, name)
    assert device.float32 is np.float32 and device.float32 is cupy.float32       # CuPy re-exports NumPy's


def test_every_emulator_function_accepts_only_calls_cupy_accepts():
    errors = []
    for path, owner, name in _emulator_callables():
        ours = inspect.signature(getattr(owner, name))
        if not _exists(path):
            continue                   # reported by test_every_name_the_emulator_offers_exists_in_cupy
        found = cupy_signature(path, resolve(path))
        if found is None:
            errors.append(f"cupy.{path}: CuPy exposes no signature; add it to SOURCE_SIGNATURES")
            continue
        theirs, _, source = found
        ours, theirs = _without_self(ours), _without_self(theirs)
        problems = _wider(ours, theirs) + (_other_defaults(ours, theirs) if source == "inspect" else [])
        errors += [f"cp.{path}{ours} on the emulator, cupy.{path}{theirs} ({source}): {e}" for e in problems]
    assert not errors, "\n".join(errors)


def _other_defaults(ours, theirs):
    """The parameters both signatures have whose defaults differ (CuPy's default read by inspect)."""
    return [f"{name}={p.default!r}, CuPy's default is {theirs.parameters[name].default!r}"
            for name, p in ours.parameters.items() if name in theirs.parameters
            and p.default is not inspect.Parameter.empty and not _same(p.default, theirs.parameters[name].default)]


def _same(a, b):
    try:
        return a == b or np.dtype(a) == np.dtype(b)
    except TypeError:
        return False


def _wider(ours, theirs):
    """How signature `ours` accepts calls that `theirs` refuses: a keyword `theirs` lacks, a
    positional slot `theirs` does not have, a variadic one `theirs` lacks."""
    kinds = inspect.Parameter
    their = theirs.parameters
    their_var_kw = any(p.kind == kinds.VAR_KEYWORD for p in their.values())
    their_var_pos = any(p.kind == kinds.VAR_POSITIONAL for p in their.values())
    their_positional = [p for p in their.values() if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    problems = []
    position = 0
    for p in ours.parameters.values():
        if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD):
            if position >= len(their_positional) and not their_var_pos:
                problems.append(f"takes {p.name} as positional argument {position + 1}, CuPy takes "
                                f"{len(their_positional)}")
            position += 1
        if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY) and not their_var_kw and (
                p.name not in their or their[p.name].kind == kinds.POSITIONAL_ONLY):
            problems.append(f"takes the keyword {p.name}=, CuPy does not")
        if p.kind == kinds.VAR_KEYWORD and not their_var_kw:
            problems.append(f"takes **{p.name}, CuPy takes no other keywords")
        if p.kind == kinds.VAR_POSITIONAL and not their_var_pos:
            problems.append(f"takes *{p.name}, CuPy takes at most {len(their_positional)} positional arguments")
    return problems


def test_the_emulated_kernel_call_refuses_what_cupys_cython_signature_refuses():
    # Function.__call__(self, tuple grid, tuple block, args, size_t shared_mem=0, ...): a list grid
    # or a float shared_mem is Cython's TypeError on a GPU, and the emulated device's too
    kernel = device.RawKernel.__new__(device.RawKernel)
    kernel.name = "any"
    with pytest.raises(TypeError, match="grid"):
        kernel([1], (32,), ())
    with pytest.raises(TypeError, match="block"):
        kernel((1,), 32, ())
    with pytest.raises(TypeError, match="shared_mem"):
        kernel((1,), (32,), (), shared_mem=0.0)
    assert check_call("RawKernel.__call__", 3, {}, [(0, list)]) and not check_call("RawKernel.__call__", 3, {},
                                                                                     [(0, tuple), (1, tuple)])


# ----------------------------------------------------------------------------
# 4. the emulated vendor libraries that are CuPy's modules: cuBLAS and NCCL
#
# cupy_backends.cuda.libs.cublas and .nccl do not load without libcublas / libnccl, but their
# Cython docstrings (embedsignature) are strings in the extension modules: read from the files.

EMULATED_CUPY_LIBRARIES = {"llmc.emulator.cublas": "cupy_backends.cuda.libs.cublas",
                           "llmc.emulator.nccl": "cupy_backends.cuda.libs.nccl"}
# a signature line at the start of a docstring, "name(params)" or "Class.method(params) -> type"
EMBEDDED_SIGNATURE = re.compile(rb"(?<=\x00)([A-Za-z_][\w.]*)(\((?:[^()\n\x00]|\([^()\n\x00]*\))*\))(?: -> [^\n\x00]+)?(?=[\n\x00])")


def embedded_signatures(module_name):
    """{"gemmEx": "(intptr_t handle, ...)", "NcclCommunicator.allReduce": "(self, ...)"}: the
    Cython signatures in the extension module's file, read without importing it."""
    import importlib.util
    with open(importlib.util.find_spec(module_name).origin, "rb") as f:
        data = f.read()
    signatures = {}
    for m in EMBEDDED_SIGNATURE.finditer(data):
        signatures.setdefault(m.group(1).decode("ascii"), m.group(2).decode("ascii"))
    return signatures


@pytest.mark.parametrize("emulated_name", sorted(EMULATED_CUPY_LIBRARIES))
def test_every_emulated_library_function_accepts_only_calls_cupy_accepts(emulated_name):
    import importlib
    emulated = importlib.import_module(emulated_name)
    signatures = embedded_signatures(EMULATED_CUPY_LIBRARIES[emulated_name])
    assert "get_version" in signatures or "getVersion" in signatures      # the reading works
    errors, checked = [], []
    for name, value in vars(emulated).items():
        if name.startswith("_") or getattr(value, "__module__", None) != emulated_name:
            continue
        targets = [(name, value)] if inspect.isfunction(value) else [] if not inspect.isclass(value) else [
            (name, value.__init__)] * (name in signatures) + [
            (f"{name}.{m}", f) for m, f in vars(value).items() if inspect.isfunction(f) and not m.startswith("_")]
        for key, function in targets:
            if key not in signatures:
                errors.append(f"{emulated_name}.{key}: {EMULATED_CUPY_LIBRARIES[emulated_name]} has no {key}")
                continue
            theirs = _parse_signature(signatures[key])[0]
            errors += [f"{emulated_name}.{key}{inspect.signature(function)}, CuPy {key}{signatures[key]}: {e}"
                       for e in _wider(_without_self(inspect.signature(function)), _without_self(theirs))]
            checked.append(key)
    assert checked and not errors, "\n".join(errors)


LIBRARY_MODULES = {"cublas": "cupy_backends.cuda.libs.cublas", "nccl": "cupy_backends.cuda.libs.nccl"}
# llmc.cuda.cublas_bindings() returns the binding every GEMM goes through (CupyCublas or
# NvmathCublas); its methods take cuBLAS's arguments after the handle, which CupyCublas passes first
# to CuPy's function of this name
BINDING_METHODS = {"gemm_ex": "gemmEx", "gemm_strided_batched_ex": "gemmStridedBatchedEx"}


def _library_bindings(scope):
    """{"cublas": (module, ""), "self.communicator": (module, "NcclCommunicator."), ...}: the names
    that a class or function `scope` binds to llmc.cuda.library("cublas" | "nccl") and to an NCCL
    communicator made from one."""
    bound = {}
    assignments = [n for n in ast.walk(scope) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)]
    for node in assignments:
        func = node.value.func
        if (ast.unparse(func).split(".")[-1] == "library" and node.value.args
                and isinstance(node.value.args[0], ast.Constant) and node.value.args[0].value in LIBRARY_MODULES):
            for target in node.targets:
                bound[ast.unparse(target)] = (LIBRARY_MODULES[node.value.args[0].value], "")
        if ast.unparse(func).split(".")[-1] == "cublas_bindings":
            for target in node.targets:
                bound[ast.unparse(target)] = (LIBRARY_MODULES["cublas"], "binding:")
    for node in assignments:
        func = node.value.func
        if isinstance(func, ast.Attribute) and func.attr == "NcclCommunicator" and ast.unparse(func.value) in bound:
            for target in node.targets:
                bound[ast.unparse(target)] = (bound[ast.unparse(func.value)][0], "NcclCommunicator.")
    return bound


def library_calls():
    """[(file:line, CuPy module, name, positional count, keywords)] of the calls the project's code
    makes on cuBLAS, NCCL and an NCCL communicator, found through the names each class or function
    binds to llmc.cuda.library(...) (calls with *args or **kwargs left out)."""
    calls = []
    for path in _source_files():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for scope in tree.body:
            if not isinstance(scope, (ast.ClassDef, ast.FunctionDef)):
                continue
            bound = _library_bindings(scope)
            for node in ast.walk(scope):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                receiver = ast.unparse(node.func.value)
                if receiver in bound and not any(isinstance(a, ast.Starred) for a in node.args) and all(
                        k.arg for k in node.keywords):
                    module, prefix = bound[receiver]
                    name, n_positional = prefix + node.func.attr, len(node.args)
                    if prefix == "binding:":                      # CupyCublas adds the handle first
                        name, n_positional = BINDING_METHODS.get(node.func.attr, name), n_positional + 1
                    calls.append((f"{os.path.relpath(path, ROOT)}:{node.lineno}", module, name,
                                  n_positional, [k.arg for k in node.keywords]))
    return calls


def test_every_cublas_and_nccl_call_the_code_writes_binds_to_cupys_signature():
    calls = library_calls()
    assert {"gemmEx", "gemmStridedBatchedEx", "NcclCommunicator", "NcclCommunicator.allReduce"} <= {
        name for _, _, name, _, _ in calls}
    errors = []
    for where, module, name, n_positional, keywords in calls:
        signatures = embedded_signatures(module)
        if name not in signatures:
            errors.append(f"{where}: {module} has no {name}")
            continue
        try:
            _without_self(_parse_signature(signatures[name])[0]).bind(*range(n_positional), **dict.fromkeys(keywords))
        except TypeError as e:
            errors.append(f"{where}: {module}.{name}{signatures[name]} refuses {n_positional} positional "
                          f"argument(s) and keywords {keywords}: {e}")
    assert not errors, "\n".join(errors)
