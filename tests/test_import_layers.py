"""
tests/test_import_layers.py: the project's modules import one another one way, and the trainers
stay within their llm.c counterparts' size.

The imports are read with `ast` from the source, every `import` and `from ... import` statement
wherever it stands (a function-level import counts as much as one at the top, so a circle cannot
hide behind "imported here, when run"): a module of llmc/ is found by its dotted name, a bare name
(`import export_hf`, as dev/ and the trainers import each other after putting their directory on
sys.path) as a file beside the importer or at the repository's root. Then:
  - no circle anywhere (Tarjan's strongly connected components; each circle is named);
  - llmc/'s process layers, bottom to top: cuda (CuPy or the emulated device), comm (MPI, NCCL),
    multinode (the rendezvous), cli (the trainers' command line); no layer reaches a higher one,
    even through other modules (doc/llmc_map.md, "Layers", draws them);
  - gpt2_cpu.py has at most train_gpt2.c's 1,182 lines, gpt2_cuda.py at most train_gpt2.cu's 1,904.
Run: pytest tests/test_import_layers.py (a second: nothing is imported).
"""

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_DIRS = ("", "llmc", "llmc/emulator", "dev", "dev/eval", "dev/data", "dev/cuda", "doc")
LAYERS = ("llmc/cuda.py", "llmc/comm.py", "llmc/multinode.py", "llmc/cli.py")     # bottom to top
# (file, llm.c's counterpart, its lines: llm.c at its mid-2024 layout)
SIZE_LIMITS = (("gpt2_cpu.py", "train_gpt2.c", 1182), ("gpt2_cuda.py", "train_gpt2.cu", 1904))


def project_files():
    """Every .py file of SOURCE_DIRS, as paths relative to the repository."""
    return sorted(os.path.relpath(p, ROOT) for d in SOURCE_DIRS for p in glob.glob(os.path.join(ROOT, d, "*.py")))


def resolve(name, importer, files):
    """The project file a module name imported by `importer` is, or None (the standard library,
    a third-party package). Dotted names are packages from the root; a bare name is a file
    beside the importer, else at the root."""
    parts = name.split(".")
    candidates = [os.path.join(*parts) + ".py", os.path.join(*parts, "__init__.py")]
    if len(parts) == 1:
        candidates.insert(0, os.path.join(os.path.dirname(importer), name + ".py"))
    return next((os.path.normpath(c) for c in candidates if os.path.normpath(c) in files), None)


def imports_of(path, files):
    """The project files that `path` imports, anywhere in its source (a package's __init__.py
    too: importing llmc.cuda runs llmc/__init__.py first)."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)   # from llmc import cuda
    for name in list(names):
        parts = name.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts)))          # the packages on the way
    found = {resolve(name, path, files) for name in names}
    return found - {None, path}


def import_graph():
    files = set(project_files())
    return {path: imports_of(path, files) for path in files}


def circles(graph):
    """The strongly connected components of more than one module (each a circle of imports)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):                                  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def reachable(graph, start):
    """Every file `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def test_the_graph_sees_imports_wherever_they_stand():
    graph = import_graph()
    assert "llmc/utils.py" in graph["llmc/cli.py"]                      # from llmc.utils import ...
    assert "llmc/cuda.py" in graph["llmc/multinode.py"]                 # from llmc import cuda
    assert "llmc/emulator/device.py" in graph["llmc/cuda.py"]           # inside a function: counted
    assert "dev/eval/export_hf.py" in graph["dev/eval/import_hf.py"]    # a bare name beside the importer
    assert "gpt2_cpu.py" in graph["dev/eval/export_hf.py"]              # a bare name at the root
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_in_a_circle():
    found = circles(import_graph())
    assert not found, "imports in a circle: " + "; ".join(" <-> ".join(c) for c in found)


def test_llmc_process_layers_import_downward_only():
    graph = import_graph()
    for i, lower in enumerate(LAYERS):
        higher = set(LAYERS[i + 1:]) & reachable(graph, lower)
        assert not higher, f"{lower} imports {sorted(higher)}, a layer above it (cuda < comm < multinode < cli)"
    for lower, upper in zip(LAYERS, LAYERS[1:]):
        assert lower in reachable(graph, upper), f"{upper} no longer builds on {lower}: update LAYERS and the map"


def test_trainers_stay_within_llm_c_size():
    for path, counterpart, limit in SIZE_LIMITS:
        lines = len(open(os.path.join(ROOT, path)).read().splitlines())
        assert lines <= limit, f"{path} has {lines} lines, more than llm.c's {counterpart} ({limit})"
