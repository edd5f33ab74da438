"""Every hand-written backward pass of gpt2_cpu.py against central finite differences in float64.

For a layer out = f(x, w), we contract the output with a fixed random tensor R, giving the scalar
L = sum(f(x, w) * R), whose gradient with respect to the output is exactly R. The analytic
gradients (the backward called with dout = R) must match (L(x + h e_i) - L(x - h e_i)) / 2h for
every element i. In float64 with h = 1e-6 the truncation error is O(h^2) ~ 1e-12 and the
rounding error ~ 1e-16 / h ~ 1e-10, so a relative tolerance of 1e-6 leaves three orders of margin.
"""

import numpy as np
import pytest

import gpt2_cpu as g
from llmc import check

H = 1e-6            # finite-difference step
RTOL = 1e-6         # see the module docstring
ATOL = 1e-9


def numerical_grad(f, x, h=H, idx=None):
    """Central finite-difference gradient of the scalar function f() with respect to the array x,
    perturbing x in place element by element. With idx (flat indices), only those elements:
    returns a 1-D array of their gradients; without, the full gradient in x's shape."""
    flat = x.reshape(-1)
    indices = np.arange(flat.size) if idx is None else idx
    grad = np.zeros(indices.size)
    for j, i in enumerate(indices):
        old = flat[i]
        flat[i] = old + h
        up = f()
        flat[i] = old - h
        down = f()
        flat[i] = old
        grad[j] = (up - down) / (2 * h)
    return grad.reshape(x.shape) if idx is None else grad


def assert_close(a, ref, label):
    assert check.check_tensor(a, ref, label, ATOL, RTOL), label


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def test_encoder(rng):
    B, T, C, Vp, maxT = 2, 5, 4, 11, 7
    inp = rng.integers(0, Vp, (B, T))
    inp[0, 0] = inp[1, 3] = 2                       # a repeated token must accumulate
    wte, wpe = rng.standard_normal((Vp, C)), rng.standard_normal((maxT, C))
    R = rng.standard_normal((B, T, C))
    loss = lambda: float((g.encoder_forward(inp, wte, wpe) * R).sum())  # noqa: E731
    dwte, dwpe = np.zeros_like(wte), np.zeros_like(wpe)
    g.encoder_backward(dwte, dwpe, R, inp)
    assert_close(dwte, numerical_grad(loss, wte), "dwte")
    assert_close(dwpe, numerical_grad(loss, wpe), "dwpe")
    assert np.all(dwpe[T:] == 0)


@pytest.mark.parametrize("shape", [(2, 3, 8), (1, 7, 5)])
def test_layernorm(rng, shape):
    C = shape[-1]
    x = rng.standard_normal(shape) * 2 + 0.5
    w, b = rng.standard_normal(C), rng.standard_normal(C)
    R = rng.standard_normal(shape)
    loss = lambda: float((g.layernorm_forward(x, w, b)[0] * R).sum())  # noqa: E731
    out, mean, rstd = g.layernorm_forward(x, w, b)
    # forward against the definition, computed a second way
    ref = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + g.LN_EPS) * w + b
    assert_close(out, ref, "layernorm out")
    dw, db = np.zeros(C), np.zeros(C)
    dx = g.layernorm_backward(dw, db, R, x, w, mean, rstd)
    assert_close(dx, numerical_grad(loss, x), "layernorm dinp")
    assert_close(dw, numerical_grad(loss, w), "layernorm dweight")
    assert_close(db, numerical_grad(loss, b), "layernorm dbias")


@pytest.mark.parametrize("bias", [True, False])
def test_matmul(rng, bias):
    B, T, C, OC = 2, 3, 5, 7
    x, w = rng.standard_normal((B, T, C)), rng.standard_normal((OC, C))
    b = rng.standard_normal(OC) if bias else None
    R = rng.standard_normal((B, T, OC))
    loss = lambda: float((g.matmul_forward(x, w, b) * R).sum())  # noqa: E731
    assert_close(g.matmul_forward(x, w, b), np.einsum("btc,oc->bto", x, w) + (b if bias else 0), "matmul out")
    dw = np.zeros_like(w)
    db = np.zeros(OC) if bias else None
    dx = g.matmul_backward(dw, db, R, x, w)
    assert_close(dx, numerical_grad(loss, x), "matmul dinp")
    assert_close(dw, numerical_grad(loss, w), "matmul dweight")
    if bias:
        assert_close(db, numerical_grad(loss, b), "matmul dbias")


def test_matmul_backward_accumulates(rng):
    x, w, R = rng.standard_normal((1, 2, 3)), rng.standard_normal((4, 3)), rng.standard_normal((1, 2, 4))
    dw, db = np.ones((4, 3)), np.ones(4)
    g.matmul_backward(dw, db, R, x, w)
    assert_close(dw, 1 + R[0].T @ x[0], "dweight += ")
    assert_close(db, 1 + R[0].sum(0), "dbias += ")


def attention_reference(qkv, NH):
    """Causal attention written a second way: explicit loops over batch, head and position."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    HS = C // NH
    out = np.zeros((B, T, C))
    for b in range(B):
        for h in range(NH):
            q = qkv[b, :, h * HS:(h + 1) * HS]
            k = qkv[b, :, C + h * HS:C + (h + 1) * HS]
            v = qkv[b, :, 2 * C + h * HS:2 * C + (h + 1) * HS]
            for t in range(T):
                s = k[:t + 1] @ q[t] / np.sqrt(HS)
                p = np.exp(s - s.max())
                out[b, t, h * HS:(h + 1) * HS] = (p / p.sum()) @ v[:t + 1]
    return out


@pytest.mark.parametrize("B,T,NH,HS", [(2, 4, 2, 3), (1, 5, 3, 2)])
def test_attention(rng, B, T, NH, HS):
    C = NH * HS
    qkv = rng.standard_normal((B, T, 3 * C))
    R = rng.standard_normal((B, T, C))
    out, att = g.attention_forward(qkv, NH)
    assert_close(out, attention_reference(qkv, NH), "attention out")
    assert np.all(att[..., np.triu(np.ones((T, T), bool), 1)] == 0), "future positions must get probability 0"
    assert_close(att.sum(-1), np.ones((B, NH, T)), "attention rows sum to 1")
    loss = lambda: float((g.attention_forward(qkv, NH)[0] * R).sum())  # noqa: E731
    dqkv = g.attention_backward(R, qkv, att, NH)
    assert_close(dqkv, numerical_grad(loss, qkv), "attention dqkv")


def test_gelu(rng):
    x = rng.standard_normal((3, 4, 5)) * 3
    from math import erf, pi, sqrt, tanh
    ref = np.vectorize(lambda v: 0.5 * v * (1 + tanh(sqrt(2 / pi) * (v + 0.044715 * v ** 3))))(x)
    assert_close(g.gelu_forward(x), ref, "gelu out")
    # the tanh form approximates the exact x * Phi(x) to ~1e-3 (Hendrycks & Gimpel 2016)
    exact = np.vectorize(lambda v: 0.5 * v * (1 + erf(v / sqrt(2))))(x)
    assert np.abs(g.gelu_forward(x) - exact).max() < 2e-3
    R = rng.standard_normal(x.shape)
    loss = lambda: float((g.gelu_forward(x) * R).sum())  # noqa: E731
    assert_close(g.gelu_backward(R, x), numerical_grad(loss, x), "gelu dinp")


def test_residual(rng):
    a, b, R = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))
    assert_close(g.residual_forward(a, b), a + b, "residual out")
    loss = lambda: float((g.residual_forward(a, b) * R).sum())  # noqa: E731
    da, db = g.residual_backward(R)
    assert_close(da, numerical_grad(loss, a), "residual dinp1")
    assert_close(db, numerical_grad(loss, b), "residual dinp2")


def test_softmax_crossentropy(rng):
    B, T, V, Vp = 2, 3, 7, 10
    logits = rng.standard_normal((B, T, Vp)) * 3
    targets = rng.integers(0, V, (B, T))
    dlosses = rng.standard_normal((B, T))
    probs = g.softmax_forward(logits, V)
    assert np.all(probs[..., V:] == 0), "padded columns must have probability 0"
    lse = np.log(np.exp(logits[..., :V]).sum(-1))
    ref_losses = lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    assert_close(g.crossentropy_forward(probs, targets), ref_losses, "crossentropy losses")
    loss = lambda: float((g.crossentropy_forward(g.softmax_forward(logits, V), targets) * dlosses).sum())  # noqa: E731
    dlogits = g.crossentropy_softmax_backward(dlosses, probs, targets)
    num = numerical_grad(loss, logits)
    assert_close(dlogits, num, "dlogits")
    assert np.all(dlogits[..., V:] == 0)


def test_layers_keep_float32():
    """In float32 training every layer must stay float32 (no silent upcast to float64)."""
    rng = np.random.default_rng(0)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    x, w, b = f(2, 3, 8), f(8), f(8)
    assert g.layernorm_forward(x, w, b)[0].dtype == np.float32
    assert g.matmul_forward(x, f(5, 8), f(5)).dtype == np.float32
    assert g.attention_forward(f(2, 3, 24), 2)[0].dtype == np.float32
    assert g.gelu_forward(x).dtype == np.float32 and g.gelu_backward(x, x).dtype == np.float32
    assert g.softmax_forward(f(2, 3, 8), 6).dtype == np.float32


TINY = g.GPT2Config(max_seq_len=8, vocab_size=13, padded_vocab_size=16, num_layers=2, num_heads=2, channels=6)


def test_whole_model_finite_differences():
    """gpt2_backward against finite differences of the mean loss, float64, on every tensor.
    All elements of the small tensors; 12 random elements of each large one."""
    model = g.gpt2_init(TINY, seed=3, dtype=np.float64)
    rng = np.random.default_rng(5)
    model.params += rng.standard_normal(model.num_parameters) * 0.1   # move off the init's symmetric point
    model.P["wte"][TINY.vocab_size:] = 0.0
    B, T = 2, 5
    x = rng.integers(0, TINY.vocab_size, (B, T))
    y = rng.integers(0, TINY.vocab_size, (B, T))

    def loss():
        g.gpt2_forward(model, x, y)
        return model.mean_loss

    loss()
    g.gpt2_zero_grad(model)
    g.gpt2_backward(model)
    analytic = g.tensor_views(model.grads.copy(), model.param_shapes)
    for name, _ in model.param_shapes:
        view = model.P[name].reshape(-1)
        grad = analytic[name].reshape(-1)
        idx = np.arange(view.size) if view.size <= 64 else rng.choice(view.size, 12, replace=False)
        assert_close(grad[idx], numerical_grad(loss, view, idx=idx), f"d{name}")
    # padded vocabulary rows never receive gradient
    assert np.all(model.G["wte"][TINY.vocab_size:] == 0)


def test_gradient_accumulation_equals_big_batch():
    """Two micro-batches with loss_scale 1/2 give the gradient of the mean over both."""
    model = g.gpt2_init(TINY, seed=1, dtype=np.float64)
    rng = np.random.default_rng(2)
    x = rng.integers(0, TINY.vocab_size, (4, 6))
    y = rng.integers(0, TINY.vocab_size, (4, 6))
    g.gpt2_zero_grad(model)
    g.gpt2_forward(model, x, y)
    g.gpt2_backward(model)
    full = model.grads.copy()
    g.gpt2_zero_grad(model)
    for half in (slice(0, 2), slice(2, 4)):
        g.gpt2_forward(model, x[half], y[half])
        g.gpt2_backward(model, loss_scale=0.5)
    assert_close(model.grads, full, "accumulated grads")
