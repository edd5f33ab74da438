"""The visual debugger without a browser (llmc/debugger/): the op list of a step against the
order worked out by hand from gpt2_cpu.py's forward and backward, what it stops on against the
reference trainer run here step by step (every forward result, the gradients, the update, the
per-token losses, attention_backward's datt recomputed from its inputs), Llama 3 the same way, the
--check-save file and its table, the kernel-trace format, and the server's answers to hostile
requests (a bad token, another Host, an unknown op, a huge index, a path).
The page in a real browser: tests/test_debugger_browser.py."""

import http.client
import importlib
import json
import os
import socket
import threading

import numpy as np
import pytest

import gpt2_cpu as g
import llama3_cpu
from llmc.check import TOLERANCES, load_comparison, save_comparison
from llmc.dataloader import DataLoader
from llmc.debugger import __main__ as cli
from llmc.debugger.checkrun import CheckRun
from llmc.debugger.harness import DebuggerProcess
from llmc.debugger.kerneltrace import KernelTrace
from llmc.debugger.session import Conflict, NotFound, Session
from llmc.debugger.stepper import GPT2, discover_ops, run_hooked
from llmc.paths import DEFAULT_TRAIN
from llmc.utils import InputError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, T = 2, 16
ARGS = ["-e", "d2", "-b", str(B), "-t", str(T), "-x", "2"]

pytestmark = pytest.mark.skipif(not os.path.exists(DEFAULT_TRAIN), reason="no Shakespeare data: make data")


# ---------------------------------------------------------------------------- the op list

def expected_gpt2_ops(L):
    """A GPT-2 step's ops, written out from gpt2_cpu.py's gpt2_forward, block_forward and
    gpt2_backward by hand: (function, layer)."""
    block = ["layernorm_forward", "matmul_forward", "attention_forward", "matmul_forward", "residual_forward",
             "layernorm_forward", "matmul_forward", "gelu_forward", "matmul_forward", "residual_forward"]
    block_back = ["residual_backward", "matmul_backward", "gelu_backward", "matmul_backward", "layernorm_backward",
                  "residual_backward", "matmul_backward", "attention_backward", "matmul_backward", "layernorm_backward"]
    ops = [("encoder_forward", None)]
    ops += [(f, l) for l in range(L) for f in block]
    ops += [(f, None) for f in ("layernorm_forward", "matmul_forward", "softmax_forward", "crossentropy_forward",
                                "crossentropy_softmax_backward", "matmul_backward", "layernorm_backward")]
    ops += [(f, l) for l in reversed(range(L)) for f in block_back]
    ops += [("encoder_backward", None), ("gpt2_grad_norm", None), ("gpt2_update", None)]
    return ops


@pytest.mark.parametrize("depth", [2, 4])
def test_gpt2_op_list_is_the_step_in_order(depth):
    ops = discover_ops(g, GPT2, g.config_from_descriptor(f"d{depth}"))
    assert [(op.function, op.layer) for op in ops] == expected_gpt2_ops(depth)
    assert [op.index for op in ops] == list(range(len(ops)))
    phases = [op.phase for op in ops]
    assert phases.count("forward") == 1 + 10 * depth + 4 and phases.count("update") == 2
    by_label = {op.label(): op for op in ops}
    ln1 = by_label["layernorm_forward -> ln1, ln1_mean, ln1_rstd"]
    assert ln1.acts == ["ln1", "ln1_mean", "ln1_rstd"] and ln1.caller == "block_forward"
    assert ln1.def_line == g.layernorm_forward.__code__.co_firstlineno
    with open(ln1.call_file) as f:
        assert "layernorm_forward(" in f.read().splitlines()[ln1.call_line - 1]
    assert "matmul_backward -> dln2" in by_label and "layernorm_backward -> dresidual (a term)" in by_label


def test_llama3_op_list_has_its_own_layers():
    ops = discover_ops(llama3_cpu, cli.LLAMA3, llama3_cpu.config_from_descriptor("llama3:d2"))
    names = [op.function for op in ops]
    per_block = ["rmsnorm_forward", "matmul_forward", "rope_forward", "rope_forward", "repeat_kv_forward",
                 "repeat_kv_forward", "attention_forward", "matmul_forward", "residual_forward", "rmsnorm_forward",
                 "matmul_forward", "matmul_forward", "swiglu_forward", "matmul_forward", "residual_forward"]
    assert names[:1 + len(per_block)] == ["encoder_forward"] + per_block
    assert names[-2:] == ["gpt2_grad_norm", "gpt2_update"] and "rope_backward" in names
    assert [op.label() for op in ops][3:5] == ["rope_forward -> q", "rope_forward -> k"]   # two calls on one line


# ---------------------------------------------------------------------------- stepping, in this process

class Stepper:
    """The debugger's session on the trainer's train() in a thread, as `python -m llmc.debugger`
    runs it (there in the main thread)."""

    def __init__(self, argv):
        self.args = cli.parse_args(argv)
        family = cli.choose_family(self.args.model, self.args.resume)
        module = importlib.import_module(family.module)
        ops = discover_ops(module, family, cli.model_config(module, family, self.args))
        self.session = Session(module, family, ops, self.args.keep_mib)

        def run():
            try:
                run_hooked(self.session.hook, module.train, self.args)
            finally:
                self.session.finished()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        self.wait()

    def wait(self):
        state = self.session.wait_state(0)
        while state["state"] in ("starting", "running"):
            state = self.session.wait_state(10)
        return state

    def go(self, action, op=None):
        self.session.control(action, op)
        return self.wait()


def reference_gpt2(seed=42):
    """gpt2_cpu's first training step on the first batch, as train() takes it: (model before the
    update with its activations and gradients, the model after the update, inputs, targets)."""
    model = g.gpt2_init(g.config_from_descriptor("d2"), seed)
    x, y = DataLoader(DEFAULT_TRAIN, B, T).next_batch()
    g.gpt2_zero_grad(model)
    g.gpt2_forward(model, x, y)
    g.gpt2_backward(model)
    norm = g.gpt2_grad_norm(model)
    after = g.GPT2(model.config)
    after.params[...], after.grads[...] = model.params, model.grads
    lr = g.learning_rate_at(0, "cosine", 3e-4, 0, 2, 0.0)
    g.gpt2_update(after, lr, g.ADAMW_BETA1, g.ADAMW_BETA2, g.ADAMW_EPS, 0.0, 1, 1.0 / norm if norm > 1.0 else 1.0)
    return model, after, x, y


def test_every_stop_shows_the_reference_values():
    ref, after, x, y = reference_gpt2()
    st = Stepper(ARGS)
    s = st.session
    ops = s.ops
    seen_forward = 0
    for i, op in enumerate(ops):
        state = st.wait() if i == 0 else st.go("op")
        assert state["state"] == "paused" and state["op"] == i and state["step"] == 1
        detail = s.op_json(i)
        if op.phase == "forward" and op.acts and op.acts[0]:
            name = op.acts[0]
            want = ref.acts[name] if op.layer is None else ref.acts[name][op.layer]
            np.testing.assert_array_equal(s.tensor(i, "out0"), want, err_msg=f"op {i} {op.label()}")
            seen_forward += 1
        if op.function == "crossentropy_forward":
            assert state["loss"] == ref.mean_loss
            tok = s.tokens_json(1)
            assert tok["losses"] == [float(v) for v in ref.acts["losses"][1]]
            assert tok["tokens"][:3] == [s.token_text(int(t)) for t in x[1, :3]]
        if op.function == "crossentropy_softmax_backward":
            onehot = np.zeros_like(ref.acts["probs"])
            onehot[np.arange(B)[:, None], np.arange(T)[None, :], y] = 1.0
            expected = (ref.acts["probs"].astype(np.float64) - onehot) / (B * T)   # d(mean loss)/dlogits
            np.testing.assert_allclose(s.tensor(i, "out0"), expected, rtol=0, atol=1e-9)
        if op.function == "attention_backward":
            # datt = dout @ v^T, recomputed here from the op's inputs: datty (the op before) and qkv
            datty = s.tensor(i - 1, "out0")
            v = ref.acts["qkv"][op.layer].reshape(B, T, 3, 4, 32)[:, :, 2].transpose(0, 2, 1, 3)
            dout = datty.reshape(B, T, 4, 32).transpose(0, 2, 1, 3)
            datt = s.tensor(i, "local:datt")
            np.testing.assert_allclose(datt, dout @ v.transpose(0, 1, 3, 2), rtol=1e-5, atol=1e-12)
            assert s.attention_source(op.layer, True)[0] is datt
            att, _, _ = s.attention_source(op.layer, False)
            np.testing.assert_array_equal(att, ref.acts["att"][op.layer])
            np.testing.assert_allclose(att.sum(axis=-1), 1.0, rtol=0, atol=1e-6)
        if op.function == "gpt2_grad_norm":
            np.testing.assert_array_equal(s.model.grads, ref.grads)
            assert detail["scalars"]["norm"] == pytest.approx(g.gpt2_grad_norm(ref), rel=1e-12)
        if op.function == "gpt2_update":
            np.testing.assert_array_equal(s.model.params, after.params)
            p = s.parameter_json("qkvw", "0")
            delta = after.P["qkvw"][0].astype(np.float64) - ref.P["qkvw"][0]
            assert p["ratio"] == pytest.approx(np.linalg.norm(delta) / np.linalg.norm(after.P["qkvw"][0]), rel=1e-5)
            assert state["step_line"]["loss"] == ref.mean_loss
    assert seen_forward == 1 + 10 * 2 + 4
    state = st.go("next_step")
    assert (state["step"], state["op"]) == (2, 0)
    assert s.op_json(0)["step"] == 2
    with pytest.raises(NotFound):
        s.record(5)                                  # not run yet in step 2
    state = st.go("finish")
    assert state["op"] == len(ops) - 1 and state["step"] == 2
    state = st.go("next_step")                        # -x 2: the trainer ends
    assert state["state"] == "finished"
    with pytest.raises(Conflict):
        s.control("op")
    st.thread.join(timeout=30)


def test_run_to_an_op_and_llama3_loss():
    st = Stepper(["-e", "llama3:d2", "-b", str(B), "-t", str(T), "-x", "1"])
    s = st.session
    target = next(op.index for op in s.ops if op.function == "crossentropy_forward")
    state = st.go("to", target)
    assert state["op"] == target
    model = llama3_cpu.llama3_init(llama3_cpu.config_from_descriptor("llama3:d2"), 42)
    x, y = DataLoader(DEFAULT_TRAIN, B, T).next_batch()
    llama3_cpu.llama3_forward(model, x, y)
    assert state["loss"] == model.mean_loss
    np.testing.assert_array_equal(s.tensor(target, "out0"), model.acts["losses"])
    assert st.go("finish")["op"] == len(s.ops) - 1
    assert st.go("next_step")["state"] == "finished"


def test_gradient_accumulation_runs_each_micro_batch_and_keep_mib_lets_go():
    """-d 2*B*T: two micro-batches a step, the ops of forward and backward twice, AdamW once; with
    --keep-mib 0 a past op's own arrays are let go (the forward's stay, as views of model.acts)."""
    st = Stepper(["-e", "d2", "-b", str(B), "-t", str(T), "-x", "1", "-d", str(2 * B * T), "--keep-mib", "0"])
    s = st.session
    encoder_backward = next(op.index for op in s.ops if op.function == "encoder_backward")
    state = st.go("to", encoder_backward)
    assert (state["micro"], state["op"]) == (0, encoder_backward)
    dlogits = next(op.index for op in s.ops if op.function == "crossentropy_softmax_backward")
    assert s.op_json(dlogits)["evicted"]
    with pytest.raises(NotFound, match="let go"):
        s.tensor(dlogits, "out0")
    assert s.names.name(s.tensor(1, "out0")) == 'model.acts["ln1"][0]'          # a forward result: never let go
    state = st.go("op")
    assert (state["step"], state["micro"], state["op"]) == (1, 1, 0)             # the second micro-batch
    state = st.go("finish")
    assert (state["micro"], state["op"]) == (1, len(s.ops) - 1)
    assert st.go("next_step")["state"] == "finished"


def test_a_checkpoint_file_is_debugged_with_its_family(tmp_path):
    """-e a .bin: GPT-2's or Llama 3's model file, told apart by its header, stepped from its values."""
    gpt2_file, llama_file = str(tmp_path / "g.bin"), str(tmp_path / "l.bin")
    g.write_model(gpt2_file, g.gpt2_init(g.config_from_descriptor("d2"), 7))
    llama3_cpu.write_model(llama_file, llama3_cpu.llama3_init(llama3_cpu.config_from_descriptor("llama3:d2"), 7))
    assert cli.choose_family(gpt2_file, 0) is GPT2 and cli.choose_family(llama_file, 0) is cli.LLAMA3
    st = Stepper(["-e", gpt2_file, "-b", str(B), "-t", str(T), "-x", "1"])
    np.testing.assert_array_equal(st.session.model.params, g.read_model(gpt2_file).params)
    assert st.go("finish")["op"] == len(st.session.ops) - 1
    assert st.go("next_step")["state"] == "finished"


# ---------------------------------------------------------------------------- --check-save and its table

def test_saved_comparison_table_is_llmc_check_rule(tmp_path):
    ref = np.linspace(-2.0, 2.0, 2 * 4 * 8, dtype=np.float32).reshape(2, 4, 8)       # (B, T, C), max|ref| = 2
    got = ref.copy()
    atol, rtol = TOLERANCES["cuda_bf16"]["activation"]
    got[1, 2, 3] += np.float32(3 * (atol * 2 + rtol * abs(ref[1, 2, 3])))          # 3x its tolerance: fails
    got[0, 0, 0] += np.float32(0.5 * (atol * 2 + rtol * abs(ref[0, 0, 0])))        # half of it: passes
    path = str(tmp_path / "c.npz")
    save_comparison(path, [("ln1", "activation", got, ref)], "cuda_bf16", model="d2", B=2, T=4, L=1, NH=1, C=8,
                    V=8, precision="bf16", attention="naive", device="cpu", reference_dtype="float32", ok=False)
    meta, entries = load_comparison(path)
    assert meta["group"] == "cuda_bf16" and entries[0][0] == "ln1"
    run = CheckRun(path)
    row = run.rows[0]
    assert (row["bad"], row["ok"]) == (1, False)
    assert row["atol"] == pytest.approx(atol * 2) and row["max_ratio"] == pytest.approx(3.0, rel=1e-4)
    tile = run.tile_json("ln1", 1, 0, "ratio", 0, 99, 0, 99)
    assert tile["reduce"] == "exact" and tile["slice_max"] == pytest.approx(3.0, rel=1e-4)
    with pytest.raises(NotFound):
        run.tile_json("nope", 0, 0, "error", 0, 1, 0, 1)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(InputError):
        CheckRun(str(tmp_path / "bad.npz"))


@pytest.mark.slow
def test_check_save_writes_what_check_compared(tmp_path):
    """gpt2_cuda.py --device cpu --check-save: the reference side is gpt2_cpu's own forward on
    the first batch, the device side within the tolerance, as the printed lines say."""
    import subprocess
    import sys
    path = tmp_path / "check.npz"
    r = subprocess.run([sys.executable, "gpt2_cuda.py", "--device", "cpu", "-e", "d2", "-b", "1", "-t", "16",
                        "--check-save", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "LLMC_EMULATOR_CACHE": os.environ.get("LLMC_EMULATOR_CACHE", "")}
                       if os.environ.get("LLMC_EMULATOR_CACHE") else None)
    assert r.returncode == 0 and "check: all tensors OK" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    meta, entries = load_comparison(str(path))
    assert (meta["B"], meta["T"], meta["precision"], meta["device"], meta["ok"]) == (1, 16, "fp32", "cpu", True)
    labels = [label for label, _, _, _ in entries]
    assert labels[0] == "encoded" and "mean loss" in labels and labels[-1] == "dwte"
    ref = g.gpt2_init(g.config_from_descriptor("d2"), 42)
    x, y = DataLoader(DEFAULT_TRAIN, 1, 16).next_batch()
    g.gpt2_forward(ref, x, y)
    saved = dict((label, (got, r)) for label, _, got, r in entries)
    np.testing.assert_array_equal(saved["losses"][1], ref.acts["losses"])
    np.testing.assert_array_equal(saved["ln1"][1], ref.acts["ln1"])
    run = CheckRun(str(path))
    printed = {line.split(":")[0]: line for line in r.stdout.splitlines() if "TENSOR OK" in line}
    for row in run.rows:
        assert row["ok"] and f"maxdiff={row['maxdiff']:.3e}" in printed[row["label"]]


# ---------------------------------------------------------------------------- the kernel trace

def test_kernel_trace_format(tmp_path):
    good = {"format": "llmc-kernel-trace-1", "kernel": "k", "source": "kernels/x.cu", "grid": [1, 1, 1],
            "block": [64, 1, 1], "buffers": [{"name": "inp", "space": "global", "elements": 64}],
            "accesses": [{"block": [0, 0, 0], "warp": 0, "line": 3, "op": "read", "buffer": "inp",
                          "lanes": [0, 1], "elements": [0, 1]}],
            "warps": [{"block": [0, 0, 0], "warp": 0, "requests": 1, "sectors_per_request": 4, "bank_conflicts": 0}]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(good))
    assert KernelTrace(str(path)).as_json()["loaded"]
    assert not KernelTrace().as_json()["loaded"]
    for fault in ({"format": "other"}, {"buffers": []}, {"accesses": [{**good["accesses"][0], "elements": [64, 1]}]},
                  {"accesses": [{**good["accesses"][0], "op": "rw"}]}):
        path.write_text(json.dumps({**good, **fault}))
        with pytest.raises(InputError):
            KernelTrace(str(path))


# ---------------------------------------------------------------------------- hostile requests

@pytest.fixture(scope="module")
def debugger():
    with DebuggerProcess(["-e", "d2", "-b", str(B), "-t", str(T)]) as dbg:
        yield dbg


def request(dbg, method, path, host=None, token=True, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", dbg.port, timeout=30)
    h = {"Host": host or f"127.0.0.1:{dbg.port}", **(headers or {})}
    if token:
        h["X-Debugger-Token"] = dbg.token
    conn.request(method, path, body=body, headers=h)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, data


def test_hostile_requests_get_a_clean_4xx(debugger):
    dbg = debugger
    assert request(dbg, "GET", "/api/state")[0] == 200
    before = len(dbg.errors)
    cases = [
        (("GET", "/api/state"), {"token": False}, 403),                       # no token
        (("GET", "/api/state?token=wrong"), {"token": False}, 403),           # a bad token
        (("GET", "/api/state"), {"host": "evil.example:80"}, 403),            # another Host (DNS rebinding)
        (("GET", "/api/op?op=999"), {}, 404),                                 # an unknown op
        (("GET", "/api/op?op=99999999999999999999999999"), {}, 400),          # a huge index
        (("GET", "/api/tile?op=0&tensor=out0&b=1000000"), {}, 400),           # a sequence past B
        (("GET", "/api/tile?op=0&tensor=nope"), {}, 404),                     # an unknown tensor
        (("GET", "/api/attention?layer=7"), {}, 400),                         # a layer past L
        (("GET", "/static/../../../etc/passwd"), {}, 404),                    # a path
        (("GET", "/source/%2Fetc%2Fpasswd"), {}, 404),
        (("GET", "/source/../gpt2_cpu.py"), {}, 404),
        (("GET", "/api/param?name=qkvw&layer=../../x"), {}, 404),
        (("POST", "/api/control"), {"body": "{not json", "headers": {"Content-Length": "9"}}, 400),
        (("POST", "/api/control"), {"body": json.dumps({"action": "rm -rf"})}, 400),
        (("POST", "/api/state"), {"body": "{}"}, 405),
        (("PUT", "/api/state"), {}, 501),
    ]
    for (method, path), kw, status in cases:
        got, body = request(dbg, method, path, **kw)
        assert got == status, (method, path, got, body)
        if status != 501:                                                      # http.server's own page
            assert "error" in json.loads(body)
    # a malformed request line, and a client that hangs up mid-request
    with socket.create_connection(("127.0.0.1", dbg.port), timeout=10) as sock:
        sock.sendall(b"GARBAGE\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.") or True
    with socket.create_connection(("127.0.0.1", dbg.port), timeout=10) as sock:
        sock.sendall(b"GET /api/st")
    status, body = request(dbg, "GET", "/api/state")                           # still serving
    assert status == 200 and json.loads(body)["state"] == "paused"
    source = request(dbg, "GET", "/source/gpt2_cpu.py")
    assert source[0] == 200 and source[1].decode() == open(os.path.join(ROOT, "gpt2_cpu.py")).read()
    import time
    time.sleep(0.5)
    new = dbg.errors[before:]
    assert not any("Traceback" in line for line in dbg.errors)
    assert len(new) >= len(cases) and all(line.startswith("debugger: ") for line in new), new
