"""llmc/emulator/ptx.py: a kernel's inline PTX on the emulated device. kernels/tensor_core.cuh
reaches the tensor cores through `asm volatile("mma.sync...": outputs : inputs)`, as a GPU build
must; g++ cannot assemble PTX, so before g++ compiles a kernel file for the emulated device this
module rewrites each asm statement into a call of the emulator's implementation of the same
instruction (llmc/emulator/shim/tensor_cores.h, emulator.cpp), its operands bound as the asm
binds them. The kernel source stays the one a GPU compiles: no emulator-only branch in kernels/.

What it translates (NVIDIA, "Parallel Thread Execution ISA", the sections named after each):
- `{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }`: a generic address to the
  32-bit address of the .shared window (emulator.cpp shared_window_address);
- mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {d0..d3}, {a0..a3}, {b0, b1}, {c0..c3};
- ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16 {r...}, [address];
- cp.async.{ca,cg}.shared.global [dst], [src], cp-size[, src-size]; cp.async.commit_group;
  cp.async.wait_group N; cp.async.wait_all.
Any other instruction raises EmulatorError naming it: add it here and to the shim, with the
ISA's semantics, rather than a branch in the kernel.

How: comments and string contents are blanked (positions kept) to find `asm [volatile] (`, its
closing parenthesis and the top-level colons and commas; the template is the concatenation of
the string literals of the first section, whitespace collapsed; operand %N is the N-th of the
outputs, then the inputs, each `"constraint"(expression)`. The replacement is one statement,
`do { ... } while (0)`, followed by as many newlines as the asm statement spanned, so every line
after it keeps its number (gdb and g++'s messages point at the real file: emulated_sources
starts each copy with a #line directive).
"""

import os
import re

ASM_START = re.compile(r"\basm\s*(?:volatile\s*)?\(")
OPERAND = re.compile(r'\s*"([^"]*)"\s*\((.*)\)\s*$', re.S)
REGISTER = r"%\d+"


def blank_comments_and_strings(source):
    """`source` with each comment and the inside of each string or character literal replaced by
    spaces (newlines kept), so that parentheses, colons and commas can be matched on it."""
    out, i, n = list(source), 0, len(source)
    while i < n:
        if source.startswith("//", i):
            while i < n and source[i] != "\n":
                out[i] = " "
                i += 1
        elif source.startswith("/*", i):
            end = source.find("*/", i + 2)
            end = n if end < 0 else end + 2
            for j in range(i, end):
                out[j] = "\n" if source[j] == "\n" else " "
            i = end
        elif source[i] in "\"'":
            quote, j = source[i], i + 1
            while j < n and source[j] != quote:
                j += 2 if source[j] == "\\" else 1
            for k in range(i + 1, min(j, n)):
                out[k] = " "
            i = j + 1
        else:
            i += 1
    return "".join(out)


def split_top_level(text, blanked, separator):
    """Pieces of `text` between the `separator` characters of `blanked` (the same text, blanked)
    that are outside parentheses, braces and brackets."""
    pieces, depth, start = [], 0, 0
    for i, ch in enumerate(blanked):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == separator and depth == 0:
            pieces.append((text[start:i], blanked[start:i]))
            start = i + 1
    pieces.append((text[start:], blanked[start:]))
    return pieces


def string_literals(text):
    """The concatenated contents of the string literals in `text` (escapes as written)."""
    return "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', text))


def operands(text, blanked):
    """[(constraint, expression)] of one operand section ("" gives [])."""
    if not blanked.strip():
        return []
    result = []
    for piece, _ in split_top_level(text, blanked, ","):
        match = OPERAND.match(piece)
        if not match:
            raise ValueError(f"an asm operand that is not \"constraint\"(expression): {piece.strip()!r}")
        result.append((match.group(1), match.group(2).strip()))
    return result


def registers(group):
    """The operand numbers of a PTX register list like '%0, %1'."""
    return [int(r[1:]) for r in re.findall(REGISTER, group)]


def value(token, ops):
    """A PTX operand as C++: %N is operand N's expression (parenthesized), a number itself."""
    return f"({ops[int(token[1:])]})" if token.startswith("%") else token


def mma(m, ops):
    d, a, b, c = (registers(m.group(i)) for i in range(1, 5))
    if (len(d), len(a), len(b), len(c)) != (4, 4, 2, 4):
        raise ValueError("mma.m16n8k16 takes 4 d, 4 a, 2 b and 4 c registers")
    lines = [f"const unsigned llmc_a[4] = {{{', '.join(f'(unsigned)({ops[i]})' for i in a)}}};",
             f"const unsigned llmc_b[2] = {{{', '.join(f'(unsigned)({ops[i]})' for i in b)}}};",
             f"const float llmc_c[4] = {{{', '.join(f'(float)({ops[i]})' for i in c)}}};",
             "float llmc_d[4];",
             "llmc_emu::mma_m16n8k16_row_col_f32_bf16(llmc_d, llmc_a, llmc_b, llmc_c);"]
    lines += [f"{ops[r]} = llmc_d[{k}];" for k, r in enumerate(d)]
    return " ".join(lines)


def ldmatrix(m, ops):
    num, trans, out = int(m.group(1)), m.group(2) is not None, registers(m.group(3))
    if len(out) != num:
        raise ValueError(f"ldmatrix .x{num} writes {num} registers, not {len(out)}")
    name = f"ldmatrix.sync.aligned.m8n8.x{num}{'.trans' if trans else ''}.shared.b16"
    lines = [f"unsigned llmc_r[{num}];",
             f"llmc_emu::ldmatrix_m8n8_b16(llmc_r, {num}, {'true' if trans else 'false'}, "
             f"llmc_emu::shared_window_pointer((unsigned){value(m.group(4), ops)}), \"{name}\");"]
    lines += [f"{ops[r]} = llmc_r[{k}];" for k, r in enumerate(out)]
    return " ".join(lines)


def cp_async(m, ops):
    cp_size = value(m.group(4), ops)
    src_size = value(m.group(5), ops) if m.group(5) else cp_size
    return (f"llmc_emu::cp_async(llmc_emu::shared_window_pointer((unsigned){value(m.group(2), ops)}), "
            f"(const void*){value(m.group(3), ops)}, (int){cp_size}, (int){src_size}, "
            f"\"cp.async.{m.group(1)}.shared.global\");")


# (the template, whitespace collapsed, as a regex; the C++ of one statement, from the match and
# the operands' expressions)
INSTRUCTIONS = [
    (re.compile(r"\{ ?\.reg \.u64 (\w+); cvta\.to\.shared\.u64 \1, (%\d+); cvt\.u32\.u64 (%\d+), \1; ?\}"),
     lambda m, ops: f"{ops[int(m.group(3)[1:])]} = llmc_emu::shared_window_address((const void*){value(m.group(2), ops)});"),
    (re.compile(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32 "
                r"\{([^}]*)\}, ?\{([^}]*)\}, ?\{([^}]*)\}, ?\{([^}]*)\};"), mma),
    (re.compile(r"ldmatrix\.sync\.aligned\.m8n8\.x([124])(\.trans)?\.shared\.b16 \{([^}]*)\}, ?\[(%\d+)\];"), ldmatrix),
    (re.compile(r"cp\.async\.(ca|cg)\.shared\.global \[(%\d+)\], ?\[(%\d+)\], ?(%\d+|\d+)(?:, ?(%\d+|\d+))?;"), cp_async),
    (re.compile(r"cp\.async\.commit_group;"), lambda m, ops: "llmc_emu::cp_async_commit_group();"),
    (re.compile(r"cp\.async\.wait_group (%\d+|\d+);"),
     lambda m, ops: f"llmc_emu::cp_async_wait_group((int){value(m.group(1), ops)});"),
    (re.compile(r"cp\.async\.wait_all;"),                     # the ISA: commit_group, then wait_group 0
     lambda m, ops: "llmc_emu::cp_async_commit_group(); llmc_emu::cp_async_wait_group(0);"),
]


def translate_statement(template, ops):
    """The C++ statement for one asm template with operand expressions `ops` (outputs first).
    Raises ValueError for an instruction the emulated device does not implement."""
    text = " ".join(template.replace("\\n", " ").replace("\\t", " ").split())
    for pattern, emit in INSTRUCTIONS:
        match = pattern.fullmatch(text)
        if match:
            return emit(match, ops)
    raise ValueError(f"the emulated device has no implementation of the inline PTX {text!r} "
                     f"(add it to llmc/emulator/ptx.py and the shim, with the PTX ISA's semantics)")


def has_inline_asm(source):
    """Whether `source` holds an asm statement (outside comments and strings)."""
    return ASM_START.search(blank_comments_and_strings(source)) is not None


def translate(source):
    """`source` with every asm statement replaced by the emulator's call (see the module
    docstring), every line keeping its number. Raises ValueError for an instruction it lacks."""
    blanked = blank_comments_and_strings(source)
    out, pos = [], 0
    for match in ASM_START.finditer(blanked):
        if match.start() < pos:
            continue
        depth, end = 1, match.end()
        while depth:
            if end >= len(blanked):
                raise ValueError(f"an asm statement without its closing parenthesis at offset {match.start()}")
            depth += {"(": 1, ")": -1}.get(blanked[end], 0)
            end += 1
        inner, inner_blanked = source[match.end():end - 1], blanked[match.end():end - 1]
        sections = split_top_level(inner, inner_blanked, ":")
        ops = [expr for text, blank in sections[1:3] for _, expr in operands(text, blank)]
        statement = translate_statement(string_literals(sections[0][0]), ops)
        out += [source[pos:match.start()], f"do {{ {statement} }} while (0)", "\n" * source.count("\n", match.start(), end)]
        pos = end
    out.append(source[pos:])
    return "".join(out)


def emulated_sources(path, include_dirs, directory, included):
    """(the file to compile, the include directories) for the emulated device's build of the .cu
    file `path` with `include_dirs` (the file's own directory first). When no file of `included`
    (the absolute paths the build reads: build.included_files) holds inline asm, they are
    returned unchanged. Else
    every such file is copied, translated, under `directory` (one subdirectory per include
    directory, so that `#include "x.cuh"` finds the copy next to its includer), each copy starting
    with `#line 1 "<the original path>"`. Raises ValueError for an instruction it lacks."""
    files = {}
    for d in include_dirs:
        names = sorted(os.listdir(d)) if os.path.isdir(d) else []
        files[d] = [name for name in names if name.endswith((".cuh", ".h"))]
    own_dir = os.path.dirname(os.path.abspath(path))
    files.setdefault(own_dir, [])
    files[own_dir] = files[own_dir] + [os.path.basename(path)]

    def read(d, name):
        with open(os.path.join(d, name)) as f:
            return f.read()

    if not any(has_inline_asm(read(d, name)) for d, names in files.items() for name in names
               if os.path.abspath(os.path.join(d, name)) in included):
        return path, list(include_dirs)
    copies = {}
    for k, (d, names) in enumerate(files.items()):
        copies[d] = os.path.join(directory, str(k))
        os.makedirs(copies[d], exist_ok=True)
        for name in names:
            original = os.path.abspath(os.path.join(d, name))
            with open(os.path.join(copies[d], name), "w") as f:
                f.write(f'#line 1 "{original}"\n' + translate(read(d, name)))
    return os.path.join(copies[own_dir], os.path.basename(path)), [copies[d] for d in include_dirs if d in copies]
