"""
llmc/debugger/session.py: the debugger's state between the trainer and the page: what each op of
the current step left behind, where the step stands, and the controls that move it on.

What it is: the listener of stepper.StepHook. The trainer runs in the main thread; after each op
the hook calls op_returned here, which keeps references to the op's arrays and, if the page asked
to stop there, blocks until the page says go on (the controls: next op, run to an op, finish the
step, next step). The page's requests run in the server's threads and read the arrays only while
the trainer stands still (ViewGate: a control waits for the views being computed).

What is kept of an op, and for how long:
    its returned values      as the arrays the op returned; a forward result the trainer copies
                             into model.acts (`a["ln1"] = ...`, `A["lnf"][...] = ...`) is shown
                             from model.acts once copied, costing nothing; others are kept while
                             they fit in --keep-mib (the oldest let go first)
    its arguments            those that are views into the model's tables (parameters, their
                             gradients, activations) for every op; all of them for the current one
    its locals               the current op's only, plus KEPT_LOCALS (attention_backward's datt,
                             for the attention view), within --keep-mib
    AdamW                    the parameters before the update are copied once (one model-sized
                             buffer), and after it hold the update, model.params - before
Everything shown is read from these arrays; what is derived (statistics, histograms, the
update-to-parameter ratio, a tile's block means) is computed here and labelled so on the page.
"""

import contextlib
import math
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from llmc.debugger import tensors
from llmc.debugger.stepper import StepHook

KEPT_LOCALS = {"attention_backward": ("datt",)}      # locals the attention view reads after the op
ATTENTION_FORWARD, ATTENTION_OUTPUT = "attention_forward", "att"
ATTENTION_BACKWARD, ATTENTION_GRADIENT = "attention_backward", "datt"
LOSSES = "losses"                                     # the acts entry of the per-position losses
DEFAULT_KEEP_MIB = 1024
STATE_WAIT_MAX_S = 30.0


class NotFound(LookupError):
    """A request names something that does not exist (an op, a tensor, a layer): 404."""


class BadRequest(ValueError):
    """A request's value is out of range or malformed: 400."""


class Conflict(RuntimeError):
    """The request needs the trainer stopped (or running) and it is not: 409."""


@dataclass
class OpRecord:
    """One op's run in the current step (see the module docstring)."""
    index: int
    step: int
    micro: int
    layer: int | None
    serial: int                         # blocks returned before this op ran (to know when it is copied)
    args: dict = field(default_factory=dict)
    returned: list = field(default_factory=list)       # [(name, array or scalar)]
    locals: dict = field(default_factory=dict)
    kept: dict = field(default_factory=dict)
    scalars: dict = field(default_factory=dict)
    acts_done: bool = False
    evicted: bool = False
    kept_bytes: int = 0


class Session:
    """The debugger's state for one trainer module (gpt2_cpu or llama3_cpu) and family."""

    def __init__(self, module, family, ops, keep_mib=DEFAULT_KEEP_MIB, tokenizer=None, on_first_stop=None):
        """ops: stepper.discover_ops's list for the model the trainer will build (found before
        training starts: the hook cannot watch a second run from inside its own callback)."""
        self.module, self.family = module, family
        self.keep_bytes = keep_mib << 20
        self.tokenizer = tokenizer
        self.on_first_stop = on_first_stop
        self.ops, self.described = list(ops), [False] * len(ops)
        self.model = None
        self.records = {}
        self.step, self.micro, self.blocks_done = None, 0, 0
        self.current = None                    # the OpRecord the trainer stands after
        self.state, self.error = "starting", None
        self.cond = threading.Condition()
        self.gate = ViewGate()
        self.target = ("op", None, None)       # stop at the first op
        self.before = None                     # the parameters before AdamW, then the update
        self.update_step = None
        self.history = []                      # [(step, printed loss, norm, lr)]
        self.last_losses = None                # (step, losses (B,T), inputs, targets) of the last forward
        self.step_line = None
        self.version = 0                       # bumps at every stop: the page's cache key
        self.hook = StepHook(module, family, self)
        self.stopped_at = time.perf_counter()

    # ------------------------------------------------------------------
    # the listener: called by StepHook in the trainer's thread

    def step_started(self, step, micro):
        if step != self.step:
            self.records = {}
            self.step = step
        self.micro = micro

    def op_called(self, index, frame, layer):
        if self.model is None:
            self.model = _find_model(frame)
        self._copy_into_acts()
        if index >= len(self.ops) or self.ops[index].function != frame.f_code.co_name:
            raise RuntimeError(f"op {index} is {frame.f_code.co_name}, not the {self.ops[index].function if index < len(self.ops) else 'end'} "
                               f"that the discovery step found")
        if not self.described[index]:                         # this run's own call site (train() for AdamW)
            self.ops[index] = self.hook.describe(index, frame, layer, self.ops[index].phase)
            self.described[index] = True
        if frame.f_code.co_name == self.family.update:
            if self.before is None or self.before.shape != self.model.params.shape:
                self.before = np.empty_like(self.model.params)
            np.copyto(self.before, self.model.params)
            self.update_step = None
            train = frame.f_back.f_locals
            self.step_line = {k: _scalar(train.get(k)) for k in ("loss", "norm", "lr")}
        record = OpRecord(index, self.step, self.micro, layer, self.blocks_done)
        record.args = {k: v for k, v in frame.f_locals.items()}
        self.calling = record

    def op_returned(self, index, frame, value, layer):
        record = self.calling
        op = self.ops[index]
        values = list(value) if isinstance(value, tuple) else ([] if value is None else [value])
        for i, v in enumerate(values):
            name = op.outputs[i] if i < len(op.outputs) and op.outputs[i] else f"return value {i}"
            record.returned.append((name, v))
        if op.function == self.family.update:
            np.subtract(self.model.params, self.before, out=self.before)   # before -> the update
            self.update_step = self.step
            self.history.append((self.step, self.step_line["loss"], self.step_line["norm"], self.step_line["lr"]))
        record.locals = {k: v for k, v in frame.f_locals.items() if k not in record.args or v is not record.args[k]}
        record.kept = {k: record.locals[k] for k in KEPT_LOCALS.get(op.function, ()) if k in record.locals}
        record.scalars = {k: _scalar(v) for k, v in frame.f_locals.items() if _scalar(v) is not None}
        self.records[index] = record
        self._account(record)
        if self._should_stop(index):
            self._stop(record)
        self._forget_current(record)

    def block_returned(self, value):
        self.blocks_done += 1

    def forward_returned(self):
        self._copy_into_acts()
        acts = self.model.acts
        self.last_losses = (self.step, acts[LOSSES].copy(), np.array(self.model.inputs), np.array(self.model.targets))

    # ------------------------------------------------------------------
    # what is kept

    def _copy_into_acts(self):
        """Forward results the trainer has copied into model.acts by now: show them from there."""
        acts = self.model.acts
        for record in self.records.values():
            op = self.ops[record.index]
            if record.acts_done or op.phase != "forward" or not any(op.acts):
                continue
            in_block = op.caller == self.family.block
            if in_block and record.serial == self.blocks_done:
                continue                                           # its block has not returned yet
            for i, name in enumerate(op.acts):
                if name and name in acts and i < len(record.returned):
                    table = acts[name] if op.layer is None or not in_block else acts[name][op.layer]
                    value = record.returned[i][1]                  # None: let go before the copy
                    if value is None or isinstance(value, np.ndarray) and table.shape == value.shape:
                        record.returned[i] = (record.returned[i][0], table)
            record.evicted = any(v is None for _, v in record.returned)
            record.acts_done = True
        self._account(None)

    def _model_view(self, x):
        return self.names.locate(x) is not None

    def _account(self, newest):
        """Let go of the oldest records' own arrays while the kept bytes pass --keep-mib."""
        self.names = tensors.TableNames(self.model)
        total, seen = 0, set()
        for record in self.records.values():
            record.kept_bytes = 0
            if record.evicted:
                continue
            for _, v in record.returned + list(record.kept.items()):
                if isinstance(v, np.ndarray) and id(v) not in seen and not self._model_view(v):
                    seen.add(id(v))
                    record.kept_bytes += v.nbytes
            total += record.kept_bytes
        for record in sorted(self.records.values(), key=lambda r: r.index):
            if total <= self.keep_bytes:
                break
            if record is newest or record.evicted or record.kept_bytes == 0:
                continue
            record.returned = [(n, v if not isinstance(v, np.ndarray) or self._model_view(v) else None)
                               for n, v in record.returned]
            record.kept = {}
            record.evicted = True
            total -= record.kept_bytes

    def _forget_current(self, record):
        """After the trainer moves on: an op's arguments beyond the model's tables, and its locals,
        are let go (the arrays may be freed or overwritten)."""
        record.args = {k: v for k, v in record.args.items() if isinstance(v, np.ndarray) and self._model_view(v)}
        record.locals = {}

    # ------------------------------------------------------------------
    # stopping and going on

    def _should_stop(self, index):
        kind, op, step = self.target
        if kind == "op":
            return True
        if kind == "to":
            return index == op
        if kind == "finish":
            return index == len(self.ops) - 1 or (self.step != step and index == 0)
        if kind == "next_step":
            return self.step != step and index == 0
        return False

    def _stop(self, record):
        """Stand after `record`'s op until a control says go on (the trainer's thread waits here)."""
        first = self.state == "starting"
        with self.cond:
            self.current = record
            self.state = "paused"
            self.version += 1
            self.stopped_at = time.perf_counter()
            self.cond.notify_all()
        if first and self.on_first_stop:
            self.on_first_stop()
        with self.cond:
            while self.state == "paused":
                self.cond.wait(0.5)                       # short waits: Ctrl-C still ends the process

    def control(self, action, op=None):
        """A control from the page: "op" (the next op), "to" (run to op index `op`, in this step or
        the next), "finish" (to AdamW), "next_step" (to the next step's first op). Raises Conflict
        unless the trainer stands still, BadRequest for an unknown action or op."""
        if action not in ("op", "to", "finish", "next_step"):
            raise BadRequest(f"unknown action {action!r}")
        if action == "to" and (not isinstance(op, int) or not 0 <= op < len(self.ops)):
            raise BadRequest(f"op must be an integer in [0, {len(self.ops)})")
        with self.gate.writing(), self.cond:
            if self.state != "paused":
                raise Conflict(f"the trainer is {self.state}")
            self.target = (action, op, self.step)
            self.state = "running"
            self.current = None
            self.version += 1
            self.cond.notify_all()

    def finished(self, error=None):
        """The trainer returned (or failed with `error`, one line)."""
        with self.cond:
            self.state = "failed" if error else "finished"
            self.error = error
            self._copy_into_acts() if self.model is not None and self.records else None
            self.current = None
            self.version += 1
            self.cond.notify_all()

    def wait_state(self, seconds):
        """Wait up to `seconds` while the trainer runs (the page's long poll), then state()."""
        deadline = time.monotonic() + min(max(seconds, 0.0), STATE_WAIT_MAX_S)
        with self.cond:
            while self.state in ("running", "starting") and time.monotonic() < deadline:
                self.cond.wait(min(0.5, max(0.0, deadline - time.monotonic())))
        return self.state_json()

    # ------------------------------------------------------------------
    # what the page reads (server threads; inside gate.reading())

    def readable(self):
        """Raise Conflict unless the arrays stand still (paused or finished): call it inside
        gate.reading()."""
        if self.state not in ("paused", "finished"):
            raise Conflict(f"the trainer is {self.state}: ask again when it stops")

    def state_json(self):
        cur = self.current
        model = self.model
        info = None
        if model is not None and model.inputs is not None:
            cfg = model.config
            B, T = model.inputs.shape
            info = {"family": self.family.name, "B": B, "T": T, "L": cfg.num_layers, "NH": cfg.num_heads,
                    "C": cfg.channels, "V": cfg.vocab_size, "Vp": cfg.padded_vocab_size,
                    "parameters": int(model.num_parameters)}
        loss = None
        if cur is not None:
            done = [r for r in self.records.values() if r.step == self.step]
            losses = next((v for r in done for n, v in r.returned if n == LOSSES and isinstance(v, np.ndarray)), None)
            loss = float(losses.mean(dtype=np.float64)) if losses is not None else None
        return {"state": self.state, "error": self.error, "version": self.version,
                "step": None if self.step is None else self.step + 1,
                "micro": self.micro, "op": None if cur is None else cur.index,
                "op_label": None if cur is None else self.ops[cur.index].label(),
                "phase": None if cur is None else self.ops[cur.index].phase,
                "layer": None if cur is None else cur.layer,
                "loss": loss, "step_line": self.step_line, "history": self.history,
                "update_step": None if self.update_step is None else self.update_step + 1,
                "model": info, "num_ops": len(self.ops)}

    def ops_json(self):
        done = {i: (r.step, r.micro) for i, r in self.records.items()}
        return [{**op.as_json(), "ran": op.index in done,
                 "kept": op.index in self.records and not self.records[op.index].evicted} for op in self.ops]

    def record(self, index):
        """The OpRecord of op `index` in this step. NotFound for an unknown op or one not run yet."""
        if not isinstance(index, int) or not 0 <= index < len(self.ops):
            raise NotFound(f"no op {index} (the step has {len(self.ops)})")
        if index not in self.records:
            raise NotFound(f"op {index} has not run in this step yet")
        return self.records[index]

    def op_json(self, index):
        """An op's detail: its description, its tensors (returned, arguments, locals), scalars and
        parameters."""
        record = self.record(index)
        op = self.ops[index]
        items = []

        def add(key, role, name, value):
            if isinstance(value, np.ndarray) and value.ndim >= 1 and value.size > 0 and value.dtype.kind == "f":
                items.append({"key": key, "role": role, "name": name, "shape": list(value.shape),
                              "dtype": str(value.dtype), "where": self.names.name(value),
                              "heads": tensors.heads_of(value, *self._BT())})
        for i, (name, v) in enumerate(record.returned):
            if v is None:
                items.append({"key": f"out{i}", "role": "returned", "name": name, "evicted": True})
            else:
                add(f"out{i}", "returned", name, v)
        for k, v in record.args.items():
            add(f"arg:{k}", "argument", k, v)
        for k, v in (record.locals or record.kept).items():
            add(f"local:{k}", "local", k, v)
        params = []
        for k, v in record.args.items():
            where = self.names.locate(v) if isinstance(v, np.ndarray) else None
            if where and where[0] in ("P", "G") and where[3]:
                entry = {"name": where[1], "layer": where[2]}
                if entry not in params:
                    params.append(entry)
        scalars = {k: v for k, v in record.scalars.items()}
        scalars.update({name: _scalar(v) for name, v in record.returned if _scalar(v) is not None})
        return {"op": op.as_json(), "step": record.step + 1, "micro": record.micro, "tensors": items,
                "params": params, "scalars": scalars, "current": self.current is record,
                "evicted": record.evicted}

    def _BT(self):
        return self.model.inputs.shape

    def tensor(self, index, key):
        """The array behind a tensor key: out<i>, arg:<name>, local:<name> of op `index`, or
        P:<name>:<layer>, G:..., update:... (layer '-' for none). NotFound if there is none."""
        if key.startswith(("P:", "G:", "update:")):
            return self.parameter(*key.split(":", 2))
        record = self.record(index)
        if key.startswith("out") and key[3:].isdigit():
            i = int(key[3:])
            if i < len(record.returned):
                value = record.returned[i][1]
                if value is None:
                    raise NotFound(f"op {index}'s {record.returned[i][0]} was let go (--keep-mib)")
                if isinstance(value, np.ndarray):
                    return value
        elif key.startswith("arg:") and isinstance(record.args.get(key[4:]), np.ndarray):
            return record.args[key[4:]]
        elif key.startswith("local:"):
            table = record.locals or record.kept
            if isinstance(table.get(key[6:]), np.ndarray):
                return table[key[6:]]
        raise NotFound(f"op {index} has no tensor {key!r}")

    def parameter(self, table, name, layer):
        """model.P / model.G / the last update's view of parameter `name`, layer `layer` ('-': the
        whole tensor)."""
        if name not in self.model.P:
            raise NotFound(f"no parameter {name!r}")
        if table == "update":
            if self.update_step is None:
                raise NotFound("no AdamW update has run yet")
            views = self.module.tensor_views(self.before, self.model.param_shapes)
        else:
            views = self.model.P if table == "P" else self.model.G
        t = views[name]
        if layer == "-":
            return t
        if not layer.isdigit() or int(layer) >= t.shape[0] or t.ndim < 2 or \
                t.shape[0] != self.model.config.num_layers:
            raise NotFound(f"parameter {name!r} has no layer {layer!r}")
        return t[int(layer)]

    def matrix(self, x, b, h):
        """as_matrix with b and h checked: BadRequest when out of range."""
        B, T = self._BT()
        if not 0 <= b < B:
            raise BadRequest(f"sequence b={b} out of range [0, {B})")
        heads = tensors.heads_of(x, B, T)
        if not 0 <= h < heads:
            raise BadRequest(f"head h={h} out of range [0, {heads})")
        return tensors.as_matrix(x, B, T, b, h)

    def parameter_json(self, name, layer):
        """The parameter, its gradient and its last AdamW update: summaries, and the update-to-
        parameter ratio ||update|| / ||parameter|| (derived)."""
        out = {"name": name, "layer": None if layer == "-" else int(layer) if layer.isdigit() else layer,
               "update_step": None if self.update_step is None else self.update_step + 1}
        p = self.parameter("P", name, layer)
        out["shape"] = list(p.shape)
        out["P"] = tensors.clean(tensors.summary(p))
        out["G"] = tensors.clean(tensors.summary(self.parameter("G", name, layer)))
        if self.update_step is not None:
            u = self.parameter("update", name, layer)
            out["update"] = tensors.clean(tensors.summary(u))
            norm_p, norm_u = out["P"]["norm"], out["update"]["norm"]
            out["ratio"] = norm_u / norm_p if norm_p else None
        return out

    def adamw_json(self):
        """Every parameter tensor (per layer where it has layers): ||update|| / ||parameter|| of the
        last AdamW update (derived), with both norms."""
        if self.update_step is None:
            raise NotFound("no AdamW update has run yet")
        views = self.module.tensor_views(self.before, self.model.param_shapes)
        rows = []
        L = self.model.config.num_layers
        for name, shape in self.model.param_shapes:
            layers = range(L) if len(shape) >= 2 and shape[0] == L else [None]
            for l in layers:
                p = self.model.P[name] if l is None else self.model.P[name][l]
                u = views[name] if l is None else views[name][l]
                norm_p, norm_u = _norm(p), _norm(u)
                rows.append({"name": name, "layer": l, "norm_p": norm_p, "norm_update": norm_u,
                             "ratio": norm_u / norm_p if norm_p > 0 else None})
        return {"step": self.update_step + 1, "rows": rows}

    def attention_source(self, layer, gradient):
        """(array (B,NH,T,T), where it came from) of layer `layer`'s attention probabilities
        (attention_forward's att) or their gradient (attention_backward's local datt), from this
        step's records. NotFound when that op has not run in this step (or was let go)."""
        function, name = (ATTENTION_BACKWARD, ATTENTION_GRADIENT) if gradient else (ATTENTION_FORWARD, ATTENTION_OUTPUT)
        for record in self.records.values():
            op = self.ops[record.index]
            if op.function == function and record.layer == layer:
                value = (record.locals or record.kept).get(name) if gradient else \
                    next((v for n, v in record.returned if n == name), None)
                if isinstance(value, np.ndarray):
                    source = f"{function}'s {'local ' if gradient else ''}{name}, op {record.index}"
                    return value, source, record.index
                raise NotFound(f"{function}'s {name} of layer {layer} was let go (--keep-mib)")
        raise NotFound(f"{function} of layer {layer} has not run in this step yet")

    def tokens_json(self, b):
        """Sequence b's input tokens as text, its targets, and the loss at each position: this
        step's losses once crossentropy has run, else the last forward's (which step is said)."""
        B, T = self._BT()
        if not 0 <= b < B:
            raise BadRequest(f"sequence b={b} out of range [0, {B})")
        inputs, targets = self.model.inputs, self.model.targets
        losses, step = None, None
        for record in self.records.values():
            for n, v in record.returned:
                if n == LOSSES and isinstance(v, np.ndarray):
                    losses, step = v, record.step
        if losses is None and self.last_losses is not None:
            step, losses, inputs, targets = self.last_losses
        return {"b": b, "tokens": [self.token_text(int(i)) for i in inputs[b]],
                "targets": [self.token_text(int(i)) for i in targets[b]],
                "losses": None if losses is None else [float(v) for v in losses[b]],
                "loss_step": None if step is None else step + 1}

    def token_text(self, token):
        if self.tokenizer is None:
            return f"<{token}>"
        return self.tokenizer.token_bytes[token].decode("utf-8", errors="replace")


def _norm(x):
    """||x||, the squares summed by BLAS a chunk at a time (tensors.summary's rule)."""
    flat = x.reshape(-1)
    return math.sqrt(sum(float(np.dot(c, c)) for c in (flat[i:i + tensors.STATS_CHUNK]
                                                         for i in range(0, flat.size, tensors.STATS_CHUNK))))


class ViewGate:
    """Many views at once, or one control: reading() is held while a view reads the arrays,
    writing() while a control sets the trainer going; each waits for the other."""

    def __init__(self):
        self.cond = threading.Condition()
        self.readers, self.writer = 0, False

    @contextlib.contextmanager
    def reading(self):
        with self.cond:
            while self.writer:
                self.cond.wait()
            self.readers += 1
        try:
            yield
        finally:
            with self.cond:
                self.readers -= 1
                self.cond.notify_all()

    @contextlib.contextmanager
    def writing(self):
        with self.cond:
            while self.writer or self.readers:
                self.cond.wait()
            self.writer = True
        try:
            yield
        finally:
            with self.cond:
                self.writer = False
                self.cond.notify_all()


def _find_model(frame):
    """The model the step runs on: the `model` argument of the forward that calls the first op
    (gpt2_forward(model, inputs, targets)), found up the op's callers."""
    f = frame.f_back
    while f is not None:
        model = f.f_locals.get("model")
        if model is not None and hasattr(model, "params"):
            return model
        f = f.f_back
    raise RuntimeError("no model among the trainer's frames")


def _scalar(v):
    """v as a JSON number if it is a Python or NumPy scalar (not bool), else None."""
    if isinstance(v, (bool, np.bool_)):
        return None
    if isinstance(v, (int, float, np.integer, np.floating)):
        v = float(v) if isinstance(v, (float, np.floating)) else int(v)
        return v if not isinstance(v, float) or math.isfinite(v) else None
    return None
