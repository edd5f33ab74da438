"""
llmc/debugger/stepper.py: stop a reference trainer after each op of its training step, without
changing a line of it.

What it is: the trainer's own train() runs as it always does (gpt2_cpu.train, llama3_cpu.train:
the loader, the step loop, the printed step line), under a profile function (sys.setprofile,
Python's hook for profilers; pdb's sys.settrace stays free). The hook sees every Python call and
return. It picks out the *ops* of a training step by where they are called from:
    a container   the trainer's forward (gpt2_forward), block (block_forward) and backward
                  (gpt2_backward), entered from train() itself (not from the validation loss or
                  the sampler, which call the same forward from their own functions);
    an op         a function named `*_forward` or `*_backward` called directly from a container
                  (LoRA's adapter calls only on a layer with adapters: adds_nothing)
                  (layernorm_forward, matmul_backward, ...), or the step's gradient norm and
                  AdamW update (gpt2_grad_norm, gpt2_update) called from train().
When an op returns, the hook hands its frame (arguments and locals, the reference's own names)
and its return value to a listener, which may block there: the step then stands after that op,
exactly as pdb would show it with a breakpoint on the op's last line.

The list of ops, in the order a step runs them, is found once before training by the same hook
on a tiny model of the same family and depth (discover_ops): nothing is copied from the trainer.
Each op is described from the trainer's source: its function and `def` line, the statement that
calls it (the call's exact span comes from the bytecode position, code.co_positions()), the names
that statement assigns its results to, and the layer (the value of the `for` loop variable
around the call).

What it is not: a general Python debugger (pdb is that), or a profiler of time.
"""

import ast
import dataclasses
import inspect
import sys
from dataclasses import dataclass, field

import numpy as np

OP_SUFFIXES = ("_forward", "_backward")


def adds_nothing(frame):
    """Whether an op's call does nothing: LoRA's adapter calls (gpt2_cpu.lora_add_forward and
    _backward) on a layer without adapters (their `adapters` argument empty), which every step makes
    whether or not it fine-tunes: not ops of the list."""
    return frame.f_code.co_name.startswith("lora_add_") and not frame.f_locals.get("adapters")


# ----------------------------------------------------------------------------
# the two model families: which of the trainer's functions are containers and step ops

@dataclass(frozen=True)
class Family:
    """What the stepper needs to know of a reference trainer module: its name and the names of its
    functions. tiny: the config fields replaced for discover_ops's tiny model (same depth)."""
    name: str                  # "gpt2" or "llama3"
    module: str                # the trainer's module: "gpt2_cpu"
    forward: str               # model forward: (model, inputs, targets)
    block: str                 # one transformer block, called by forward
    backward: str              # model backward: (model, loss_scale)
    init: str                  # (config, seed) -> a fresh model
    tiny: dict = field(default_factory=dict)
    zero_grad: str = "gpt2_zero_grad"
    grad_norm: str = "gpt2_grad_norm"
    update: str = "gpt2_update"


GPT2 = Family("gpt2", "gpt2_cpu", "gpt2_forward", "block_forward", "gpt2_backward", "gpt2_init",
              tiny={"max_seq_len": 2, "vocab_size": 4, "padded_vocab_size": 4, "num_heads": 1, "channels": 2})
LLAMA3 = Family("llama3", "llama3_cpu", "llama3_forward", "block_forward", "llama3_backward", "llama3_init",
                tiny={"max_seq_len": 2, "vocab_size": 4, "num_heads": 2, "num_kv_heads": 1, "channels": 4,
                      "multiple_of": 4})
FAMILIES = {f.name: f for f in (GPT2, LLAMA3)}


# ----------------------------------------------------------------------------
# an op, described from the trainer's source

@dataclass
class Op:
    """One op of a training step. index: its place in the step (forward ops, backward ops, then
    the gradient norm and AdamW); phase: "forward", "backward" or "update"; layer: the block's
    index, None outside the blocks; function: the op's name; def_file/def_line: where it is
    defined; caller/call_line/call_text/statement: the function, line, call expression and whole
    statement that call it; outputs: one name per returned value (None for an unnamed one);
    term_of: the name the result is added into, when the call is a term of a larger expression;
    acts: per output, the model.acts table entry the trainer copies it into (or None)."""
    index: int
    phase: str
    layer: int | None
    function: str
    def_file: str
    def_line: int
    caller: str
    call_file: str
    call_line: int
    call_text: str
    statement: str
    outputs: list
    term_of: str | None
    acts: list

    def label(self):
        """A short name for the op list: `layernorm_forward -> ln1, ln1_mean, ln1_rstd`."""
        names = [n for n in self.outputs if n]
        if self.term_of:
            return f"{self.function} -> {self.term_of} (a term)"
        return f"{self.function} -> {', '.join(names)}" if names else self.function

    def key(self):
        """What must match between the discovery run and the real one."""
        return (self.function, self.caller, self.call_line, self.call_text)

    def as_json(self):
        return {**dataclasses.asdict(self), "label": self.label()}


class SourceIndex:
    """The trainer files' syntax trees, to describe a call site: the statement around a call, the
    names it assigns, the `for` loops around it. One parse per file."""

    def __init__(self):
        self.trees, self.texts = {}, {}

    def _load(self, filename):
        if filename not in self.trees:
            with open(filename) as f:
                self.texts[filename] = f.read()
            self.trees[filename] = ast.parse(self.texts[filename])
        return self.trees[filename]

    def text(self, filename, node):
        """The source text of an AST node, as written (several lines for a statement that spans them)."""
        self._load(filename)
        return ast.get_source_segment(self.texts[filename], node) or ""

    def call_site(self, code, lasti):
        """(call node, the statement holding it, the function's `for` loops around it) for the
        call instruction at bytecode offset lasti of `code`."""
        tree = self._load(code.co_filename)
        positions = list(code.co_positions())[lasti // 2]         # (line, end_line, col, end_col)
        func = next(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and n.name == code.co_name and n.lineno <= positions[0] <= n.end_lineno)
        stack = []

        def visit(node, parents):
            if isinstance(node, ast.Call) and (node.lineno, node.end_lineno, node.col_offset,
                                               node.end_col_offset) == positions:
                stack.extend(parents + [node])
                return True
            return any(visit(child, parents + [node]) for child in ast.iter_child_nodes(node))

        if not visit(func, []):
            raise LookupError(f"no call at {code.co_filename}:{positions[0]}")
        call = stack[-1]
        statement = next(n for n in reversed(stack) if isinstance(n, ast.stmt))
        loops = [n for n in stack[:-1] if isinstance(n, ast.For) and isinstance(n.target, ast.Name)
                 and call in ast.walk(n) and not any(call is m for m in ast.walk(n.iter))]
        return call, statement, loops


def target_name(node):
    """The name an assignment target gives: `dln2` -> "dln2", `a["ln1"]` and `A["lnf"][...]` ->
    "ln1", "lnf" (the table key); None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    while isinstance(node, ast.Subscript):
        if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            return node.slice.value
        node = node.value
    return None


def is_table_key(node):
    """True for a target that writes a table entry (`a["ln1"]`, `A["lnf"][...]`), not a plain name."""
    return isinstance(node, ast.Subscript)


def describe_outputs(call, statement):
    """(outputs, term_of, table_keys) of a call inside its statement: the names each returned value
    is assigned to; or, when the call is one term of a larger expression (`dresidual = dresidual +
    layernorm_backward(...)`), the name that expression is assigned to; or, for a call standing
    alone that writes into its `out=` argument (`matmul_forward(..., out=A["logits"])`), that one."""
    if isinstance(statement, ast.Expr) and statement.value is call:
        out = [k.value for k in call.keywords if k.arg == "out"]
        if out and target_name(out[0]) is not None:
            return [target_name(out[0])], None, [target_name(out[0]) if is_table_key(out[0]) else None]
        return [], None, []
    if not isinstance(statement, ast.Assign) or len(statement.targets) != 1:
        return [], None, []
    target, value = statement.targets[0], statement.value
    if value is call:
        elements = target.elts if isinstance(target, ast.Tuple) else [target]
        return ([target_name(e) for e in elements], None,
                [target_name(e) if is_table_key(e) else None for e in elements])
    if isinstance(value, ast.Tuple) and isinstance(target, ast.Tuple) and len(value.elts) == len(target.elts):
        for element, name in zip(value.elts, target.elts):
            if element is call:
                return [target_name(name)], None, [target_name(name) if is_table_key(name) else None]
    return [], target_name(target), []


# ----------------------------------------------------------------------------
# the hook

class StepHook:
    """The profile function that finds a training step's ops as they run (see the module
    docstring). listener gets:
        step_started(step, micro)            train() calls forward: `step` is train()'s own
                                             0-based `step` (0 for a discovery run), micro the
                                             micro-batch within the step (0-based)
        op_called(index, frame, layer)       an op is entered; frame: its frame (the arguments)
        op_returned(index, frame, value, layer)  it returns `value`: the listener may block here
        block_returned(value)                a block returned its dict of activations
        forward_returned()                   forward returned (its results are in model.acts)
    A listener's exception is kept in `error` and the hook stops watching (the trainer goes on)."""

    def __init__(self, module, family, listener, step_callers=()):
        self.family, self.listener = family, listener
        fn = {name: getattr(module, name) for name in (family.forward, family.block, family.backward,
                                                       family.grad_norm, family.update)}
        self.forward = fn[family.forward].__code__
        self.block = fn[family.block].__code__
        self.backward = fn[family.backward].__code__
        self.step_ops = {fn[family.grad_norm].__code__, fn[family.update].__code__}
        self.step_callers = {module.train.__code__} | {c.__code__ for c in step_callers}
        self.containers = []         # frames of the active forward/block/backward
        self.op_frame = None
        self.index = 0
        self.step, self.micro = None, 0
        self.error = None
        self.sources = SourceIndex()
        self.loops = {}              # (code, lasti) -> the loop variables around that call

    # the profile function itself: called for every call and return of the thread
    def __call__(self, frame, event, arg):
        if self.error is not None or event.startswith("c_"):
            return
        try:
            if event == "call":
                self._call(frame)
            elif event == "return":
                self._return(frame, arg)
        except Exception as e:       # noqa: BLE001: a fault of the debugger never stops the trainer
            self.error = e
            print(f"debugger: internal error, the step is no longer followed: {type(e).__name__}: {e}",
                  file=sys.stderr)

    def _call(self, frame):
        code, parent = frame.f_code, frame.f_back
        if code is self.forward and parent is not None and parent.f_code in self.step_callers:
            step = parent.f_locals.get("step", 0)                  # train()'s own loop variable
            self.micro = self.micro + 1 if step == self.step else 0
            self.step, self.index = step, 0
            self.containers = [frame]
            self.listener.step_started(step, self.micro)
        elif code is self.backward and parent is not None and parent.f_code in self.step_callers:
            self.containers = [frame]
        elif code is self.block and self.containers and parent is self.containers[-1]:
            self.containers.append(frame)
        elif (self.containers and parent is self.containers[-1] and code.co_name.endswith(OP_SUFFIXES)
              and not adds_nothing(frame)):
            self._op_called(frame)
        elif code in self.step_ops and parent is not None and parent.f_code in self.step_callers:
            self._op_called(frame)

    def _op_called(self, frame):
        self.op_frame = frame
        self.op_layer = self.layer(frame.f_back) if self.containers else None   # train()'s own: no layer
        self.listener.op_called(self.index, frame, self.op_layer)

    def _return(self, frame, value):
        if frame is self.op_frame:
            self.op_frame = None
            index, self.index = self.index, self.index + 1
            self.listener.op_returned(index, frame, value, self.op_layer)
        elif self.containers and frame is self.containers[-1]:
            self.containers.pop()
            if frame.f_code is self.block:
                self.listener.block_returned(value)
            elif frame.f_code is self.forward:
                self.listener.forward_returned()

    def layer(self, caller):
        """The layer an op runs in: the value of the loop variable of the innermost `for` loop
        around the call, looking from the op's caller outwards through the containers; None
        where no loop surrounds it (the encoder, the final norm, the classifier)."""
        frames = [caller] + [f for f in reversed(self.containers) if f is not caller]
        for f in frames:
            key = (f.f_code, f.f_lasti)
            if key not in self.loops:
                _, _, loops = self.sources.call_site(f.f_code, f.f_lasti)
                self.loops[key] = [loop.target.id for loop in loops]
            if self.loops[key]:
                return f.f_locals.get(self.loops[key][-1])
        return None

    def describe(self, index, frame, layer, phase):
        """The Op at `index` whose frame is `frame` (called from a container or from train())."""
        caller = frame.f_back
        call, statement, _ = self.sources.call_site(caller.f_code, caller.f_lasti)
        outputs, term_of, acts = describe_outputs(call, statement)
        code = frame.f_code
        return Op(index=index, phase=phase, layer=layer, function=code.co_name, def_file=code.co_filename,
                  def_line=code.co_firstlineno, caller=caller.f_code.co_name, call_file=caller.f_code.co_filename,
                  call_line=call.lineno, call_text=self.sources.text(caller.f_code.co_filename, call),
                  statement=self.sources.text(caller.f_code.co_filename, statement), outputs=outputs,
                  term_of=term_of, acts=acts)

    def phase(self):
        """Where the op being called sits: "forward", "backward" or "update" (train()'s own calls)."""
        if not self.containers:
            return "update"
        return "forward" if self.containers[0].f_code is self.forward else "backward"


def run_hooked(hook, fn, *args):
    """fn(*args) with hook as this thread's profile function (removed afterwards, whatever
    happens). Returns fn's result."""
    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        return fn(*args)
    finally:
        sys.setprofile(previous)


# ----------------------------------------------------------------------------
# the op list, from one step on a tiny model

class _Recorder:
    """A listener that describes each op as the discovery step runs it."""

    def __init__(self):
        self.ops, self.hook = [], None

    def step_started(self, step, micro):
        pass

    def op_called(self, index, frame, layer):
        self.ops.append(self.hook.describe(index, frame, layer, self.hook.phase()))

    def op_returned(self, index, frame, value, layer):
        pass

    def block_returned(self, value):
        pass

    def forward_returned(self):
        pass


def discovery_step(module, family, model):
    """One training step on `model` as train() takes it (zero_grad, forward, backward, gradient
    norm, AdamW with learning rate 0), on token ids 0: what discover_ops watches."""
    T = model.config.max_seq_len
    inputs = np.zeros((1, T), dtype=np.int32)
    getattr(module, family.zero_grad)(model)
    getattr(module, family.forward)(model, inputs, inputs)
    getattr(module, family.backward)(model)
    getattr(module, family.grad_norm)(model)
    getattr(module, family.update)(model, 0.0, module.ADAMW_BETA1, module.ADAMW_BETA2, module.ADAMW_EPS, 0.0, 1)


def discover_ops(module, family, config):
    """The ops of one training step of a model of `config`'s family and depth, in the order train()
    runs them: a list of Op. Found by running discovery_step under StepHook on a tiny model with
    config's depth (family.tiny replaces the other sizes). Raises RuntimeError if the hook failed."""
    tiny = dataclasses.replace(config, **{k: v for k, v in family.tiny.items()
                                          if k in {f.name for f in dataclasses.fields(config)}})
    model = getattr(module, family.init)(tiny, 0)
    recorder = _Recorder()
    hook = StepHook(module, family, recorder, step_callers=[discovery_step])
    recorder.hook = hook
    with np.errstate(all="ignore"):
        run_hooked(hook, discovery_step, module, family, model)
    if hook.error is not None:
        raise RuntimeError(f"the debugger could not follow the step: {hook.error!r}")
    return recorder.ops


def source_of(fn):
    """(file, first line) of a function, for a link to its source."""
    return inspect.getsourcefile(fn), fn.__code__.co_firstlineno
