"""
doc/llmc_map.py: the checks and numbers behind doc/llmc_map.md, the map from llm.c's files and
functions to this project's.

What it is: compute(fig_dir) reads doc/llmc_map.md itself and verifies every name in the "here"
column of its tables against this repository, so that the map cannot go stale:
    `gpt2_cpu.layernorm_forward`            import gpt2_cpu, getattr (any depth: `llmc.cli.TrainingRun.validate`)
    `kernels/layernorm.cu::layernorm_row`   the .cu/.cuh file defines that function, kernel or struct
    `tests/test_llmc.py::test_loader_...`   the test file defines that test function
    `dev/torch_reference.py`, `kernels/`    the file or directory exists
    `-r`, `--shuffle`                       gpt2_cuda.py's parser (which includes gpt2_cpu.py's) has the flag
and raises AssertionError, naming the cell, if one does not. It also checks the claims of the
"missing here" table (each returns `absent` or, once someone adds the feature, `present`, and the
test then fails until the text is updated), counts functions and classes per module with `ast`,
finds where gpt2_cpu.py's layers and training loop begin, and draws the table of llmc/'s import
layers from the modules' import statements (`ast`).
What it is not: a check of llm.c's column, which names files of another repository (as of its
mid-2024 layout) and is not available here.

Run:
    python doc/llmc_map.py
prints one `key = value` line per number the map quotes (e.g. `names_checked = 171`). It draws no
figure. About a second on 2 CPU cores (it imports gpt2_cpu, gpt2_cuda and llmc, but no CuPy).
    python doc/llmc_map.py --update
also rewrites the quoted counts and line numbers in doc/llmc_map.md (after the code has changed;
names that no longer exist still fail, and must be fixed in the table by hand).
"""

import ast
import glob
import importlib
import importlib.util
import io
import os
import re
import sys
import tokenize

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # doc/: tutorial.py, which puts the root on sys.path
from tutorial import DOC_DIR, ROOT, print_numbers  # noqa: E402

MAP = os.path.join(DOC_DIR, "llmc_map.md")
CODE = re.compile(r"`([^`]+)`")
MODULES = ["gpt2_cpu.py", "gpt2_cuda.py"] + sorted(os.path.relpath(p, ROOT)
                                                   for p in glob.glob(os.path.join(ROOT, "llmc", "*.py")))
WORD = r"[^\s|<`,)]*"                 # a quoted value of the map: a count, a name, `absent`, a file name


# ----------------------------------------------------------------------------
# the tables of the map, and the "here" column's names

def table_rows(text):
    """Every markdown table of text as (header cells, [row cells, ...]) (cells stripped)."""
    tables, header, rows = [], None, []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None:
                header = cells
            elif not all(set(c) <= set("-: ") for c in cells):
                rows.append(cells)
        elif header is not None:
            tables.append((header, rows))
            header, rows = None, []
    return tables


def here_names(text):
    """The backticked names in the "here" column of every table: [(row's first cell, name)]."""
    names = []
    for header, rows in table_rows(text):
        columns = [i for i, h in enumerate(header) if h.lower() == "here"]
        for row in rows:
            for i in columns:
                names += [(row[0], name) for name in CODE.findall(row[i])]
    return names


def parser_flags():
    """Every option string of gpt2_cuda.py's parser (gpt2_cpu.py's flags plus the GPU ones)."""
    import gpt2_cuda
    return {s for action in gpt2_cuda.build_parser()._actions for s in action.option_strings}


def defines_cuda(path, name):
    """True if the CUDA source at path defines `name`: a kernel or device function, a struct, a
    typedef or a macro."""
    with open(path) as f:
        src = f.read()
    patterns = (rf"(__global__|__device__)[^;{{]*\b{name}\s*\(",     # kernels and device functions
                rf"\bstruct\b[^;{{]*\b{name}\b",                      # structs (Packed128, SoftmaxState)
                rf"\btypedef\b[^;]*\b{name}\s*;",                     # typedefs (x128, floatX)
                rf"#define\s+{name}\b")                               # macros
    return any(re.search(p, src) for p in patterns)


def defines_python(path, name):
    """True if the Python file at path defines a top-level function or class `name`."""
    with open(path) as f:
        tree = ast.parse(f.read())
    return any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name for n in tree.body)


def resolve(name):
    """Python object for a dotted name: the longest importable module prefix, then getattr."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


def check_name(name, flags):
    """Verify one name of the "here" column; returns its kind. Raises AssertionError if it is
    missing from this repository."""
    if name.startswith("-"):
        assert name in flags, f"no flag {name} in gpt2_cuda.build_parser()"
        return "flag"
    if "::" in name:
        path, symbol = name.split("::")
        full = os.path.join(ROOT, path)
        assert os.path.isfile(full), f"no file {path}"
        if path.endswith(".py"):
            assert defines_python(full, symbol), f"{path} defines no {symbol}"
            return "test" if path.startswith("tests/") else "python"
        assert defines_cuda(full, symbol), f"{path} defines no {symbol}"
        return "kernel"
    if "/" in name or name.endswith((".py", ".md", ".cu", ".cuh")) or name == "Makefile":
        assert os.path.exists(os.path.join(ROOT, name)), f"no file or directory {name}"
        return "file"
    try:
        resolve(name)
    except (ImportError, AttributeError) as e:
        raise AssertionError(f"{name} does not resolve: {type(e).__name__}: {e}") from None
    return "python"


def verify_map(text):
    flags = parser_flags()
    kinds = {}
    for row, name in here_names(text):
        try:
            kind = check_name(name, flags)
        except AssertionError as e:
            raise AssertionError(f"doc/llmc_map.md, row '{row}': {e}") from None
        kinds[kind] = kinds.get(kind, 0) + 1
    return {
        "names_checked": f"{sum(kinds.values())}",
        "python_names": f"{kinds.get('python', 0)}",
        "kernel_names": f"{kinds.get('kernel', 0)}",
        "file_names": f"{kinds.get('file', 0)}",
        "test_names": f"{kinds.get('test', 0)}",
        "flag_names": f"{kinds.get('flag', 0)}",
    }


# ----------------------------------------------------------------------------
# the claims of the "missing here" table

def code_names(paths):
    """Every identifier in the code (not the comments or strings) of the given Python files, lowercased."""
    names = set()
    for path in paths:
        with open(os.path.join(ROOT, path), "rb") as f:
            for tok in tokenize.tokenize(io.BytesIO(f.read()).readline):
                if tok.type == tokenize.NAME:
                    names.add(tok.string.lower())
    return names


def kernel_names():
    """The names of every extern "C" kernel in kernels/*.cu, lowercased."""
    names = set()
    for path in glob.glob(os.path.join(ROOT, "kernels", "*.cu")):
        with open(path) as f:
            names |= {m.lower() for m in re.findall(r'extern "C" __global__ void (\w+)', f.read())}
    return names


def missing_claims():
    """Each feature of llm.c listed as missing here: 'absent' while that is still true."""
    python = code_names(MODULES)
    kernels = kernel_names()
    flags = parser_flags()
    state = lambda present: "present" if present else "absent"  # noqa: E731
    claims = {
        "absent_cudnn": any("cudnn" in n for n in python | kernels),
        "absent_flash": any("flash" in n for n in kernels),
        "absent_zero": "-z" in flags or any("zero_stage" in n for n in python),
        "absent_gelu_fusion": "-ge" in flags or any("cublaslt" in n for n in python),
        "absent_dev_cuda": bool(glob.glob(os.path.join(ROOT, "dev", "cuda", "*.cu"))),
        "absent_multinode": any(f in flags for f in ("-pn", "-pr", "-pg", "-pf", "-pi")),
        "absent_profile": bool(glob.glob(os.path.join(ROOT, "**", "profile*"), recursive=True)),
        "absent_mmlu": bool(glob.glob(os.path.join(ROOT, "dev", "data", "*mmlu*"))),
        "absent_scripts": os.path.isdir(os.path.join(ROOT, "scripts")),
    }
    numbers = {key: state(present) for key, present in claims.items()}
    # the progressions are the ops `make dev-cuda` runs (dev/cuda/run_all.py's OPS); the other
    # scripts there are tools (the harness, the compile check, tensor_core.py's layouts, a tile sweep)
    spec = importlib.util.spec_from_file_location("run_all", os.path.join(ROOT, "dev", "cuda", "run_all.py"))
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    numbers["dev_cuda_ops"] = f"{len(run_all.OPS)}"
    numbers["kernel_files"] = f"{len(glob.glob(os.path.join(ROOT, 'kernels', '*.cu')))}"
    numbers["kernel_count"] = f"{len(kernels)}"
    return numbers


# ----------------------------------------------------------------------------
# the modules at a glance

def module_counts():
    """The table of top-level functions (public and _private) and classes of each module, via ast
    (one value: a module added to llmc/ adds a row); and where gpt2_cpu.py's first layer and its
    training loop begin."""
    rows = ["| module | functions | classes |", "|---|---|---|"]
    for path in MODULES:
        with open(os.path.join(ROOT, path)) as f:
            tree = ast.parse(f.read())
        functions = sum(isinstance(n, ast.FunctionDef) for n in tree.body)
        classes = sum(isinstance(n, ast.ClassDef) for n in tree.body)
        rows.append(f"| `{path}` | {functions} | {classes} |")
    numbers = {"module_table": "\n" + "\n".join(rows)}
    numbers["llmc_modules"] = f"{sum(p.startswith('llmc') and not p.endswith('__init__.py') for p in MODULES)}"
    with open(os.path.join(ROOT, "gpt2_cpu.py")) as f:
        tree = ast.parse(f.read())
    lines = {n.name: n.lineno for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    numbers["line_first_layer"] = f"{lines['encoder_forward']}"
    numbers["line_train"] = f"{lines['train']}"
    return numbers


# ----------------------------------------------------------------------------
# the layers of llmc/: who imports whom

LLMC_FILES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "llmc", "**", "*.py"), recursive=True)
                    if not p.endswith("__init__.py"))


def llmc_imports(path):
    """The llmc/ files that `path` imports, wherever the import statement stands (ast)."""
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    files = {os.path.join(*name.split(".")) + ".py" for name in names if name.startswith("llmc.")}
    return sorted(files & set(LLMC_FILES) - {path})


def layer_table():
    """Each llmc/ module's layer: 0 for one that imports no other llmc/ module, else one more
    than the highest layer it imports (a circle would never settle: AssertionError). Returns the
    markdown table, one row per layer."""
    imports = {path: llmc_imports(path) for path in LLMC_FILES}
    layer = {}

    def layer_of(path, chain=()):
        assert path not in chain, f"llmc/ imports in a circle: {' -> '.join(chain + (path,))}"
        if path not in layer:
            layer[path] = 1 + max((layer_of(p, chain + (path,)) for p in imports[path]), default=-1)
        return layer[path]
    for path in LLMC_FILES:
        layer_of(path)
    rows = ["| layer | modules (each imports only from the layers below it) |", "|---|---|"]
    for level in range(max(layer.values()) + 1):
        modules = ", ".join(f"`{os.path.relpath(p, 'llmc')}`" for p in LLMC_FILES if layer[p] == level)
        rows.append(f"| {level} | {modules} |")
    return {"layer_table": "\n" + "\n".join(rows),
            "layer_cuda": f"{layer['llmc/cuda.py']}", "layer_comm": f"{layer['llmc/comm.py']}",
            "layer_multinode": f"{layer['llmc/multinode.py']}", "layer_cli": f"{layer['llmc/cli.py']}"}


# ----------------------------------------------------------------------------
# the map's numbers

def compute(fig_dir):
    """Verify doc/llmc_map.md against this repository; return {key: text}. fig_dir is unused
    (the map has no figures)."""
    with open(MAP) as f:
        text = f.read()
    numbers = {}
    numbers |= verify_map(text)
    numbers |= missing_claims()
    numbers |= module_counts()
    numbers |= layer_table()
    return numbers


def update_map(numbers):
    """Rewrite the quoted values of doc/llmc_map.md with the ones just computed (--update): for
    bookkeeping numbers (counts, line numbers) after the code moved on. Only where the text already
    quotes the key; prints the keys it quotes nowhere, which need a sentence written by hand."""
    with open(MAP) as f:
        text = f.read()
    for key, value in numbers.items():
        table = key.endswith("_table")
        pattern = r"(\n\|[^\n]*)*" if table else WORD
        assert table or re.fullmatch(WORD, value), (key, value)
        text, n = re.subn(rf"<!--{key}-->{pattern}", lambda _: f"<!--{key}-->{value}", text)
        if n == 0:
            print(f"not quoted in doc/llmc_map.md: {key} = {value}")
    with open(MAP, "w") as f:
        f.write(text)


if __name__ == "__main__":
    if sys.argv[1:] == ["--update"]:
        update_map(compute(DOC_DIR))
        print_numbers(compute, argv=[])
    else:
        print_numbers(compute)
