"""The torch.func path: every transform and nesting against the plain function."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad, grad_and_value, hessian, jacfwd, jacrev, jvp, vjp, vmap

from remat_fn import remat

from ._util import assert_tree_close

torch.set_default_dtype(torch.float64)
G = torch.Generator().manual_seed(0)
X = torch.randn(3, 4, generator=G, dtype=torch.float64)
W = torch.randn(4, 4, generator=G, dtype=torch.float64)
torch.set_default_dtype(torch.float32)


def f(x, w):
    h = torch.tanh(x @ w)
    return (h.sin() * x).sum()


def f_vec(x, w):
    return torch.tanh(x @ w).sin().reshape(-1)


TRANSFORMS = {
    "grad": lambda g: grad(g, argnums=(0, 1)),
    "grad_and_value": lambda g: grad_and_value(g, argnums=(0, 1)),
    "vjp": lambda g: (lambda x, w: vjp(g, x, w)[1](torch.tensor(1.0, dtype=x.dtype))),
    "jvp": lambda g: (lambda x, w: jvp(g, (x, w), (torch.ones_like(x), w))),
    "jacrev": lambda g: jacrev(g, argnums=(0, 1)),
    "jacfwd": lambda g: jacfwd(g, argnums=(0, 1)),
    "hessian": lambda g: hessian(g, argnums=(0, 1)),
    "grad(grad)": lambda g: grad(lambda x, w: grad(g)(x, w).sum(), argnums=(0, 1)),
    "jvp(grad)": lambda g: (lambda x, w: jvp(grad(g), (x, w), (x, w))),
    "grad(jvp)": lambda g: grad(lambda x, w: jvp(g, (x, w), (x, w))[1], argnums=(0, 1)),
    "vmap(grad)": lambda g: vmap(grad(g, argnums=(0, 1)), in_dims=(0, None)),
    "grad(vmap)": lambda g: grad(lambda x, w: vmap(g, in_dims=(0, None))(x, w).sum(), argnums=(0, 1)),
    "vmap(jacrev)": lambda g: vmap(jacrev(g), in_dims=(0, None)),
    "jacrev(jacrev)": lambda g: jacrev(jacrev(g)),
    "vmap(vmap(grad))": lambda g: vmap(vmap(grad(g), in_dims=(0, None)), in_dims=(0, None)),
}
NEEDS_BATCH = {"vmap(grad)", "grad(vmap)", "vmap(jacrev)"}


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_transform_matches_plain(name):
    T = TRANSFORMS[name]
    x = X
    if name == "vmap(vmap(grad))":
        x = X.reshape(3, 2, 2, 1).expand(3, 2, 2, 4).contiguous()
    ref = T(f)(x, W)
    assert_tree_close(T(remat(f))(x, W), ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_transform_with_closure_matches_plain(name):
    """The weight is closed over; its gradient comes from an outer transform."""
    T = TRANSFORMS[name]
    x = X.reshape(3, 2, 2, 1).expand(3, 2, 2, 4).contiguous() if name == "vmap(vmap(grad))" else X

    def outer(fn_maker):
        def g(x, w):
            return fn_maker(w)(x)
        return g

    plain = outer(lambda w: (lambda x: f(x, w)))
    rem = outer(lambda w: remat(lambda x: f(x, w)))
    assert_tree_close(T(rem)(x, W), T(plain)(x, W), rtol=1e-10, atol=1e-12)


def test_bitwise_equal_under_grad():
    a = grad(f, argnums=(0, 1))(X, W)
    b = grad(remat(f), argnums=(0, 1))(X, W)
    assert_tree_close(a, b, exact=True)


def test_functional_call_module_params_get_gradients():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    class Wrapped(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net
            self.fn = remat(net)

        def forward(self, x):
            return self.fn(x)

    rnet = Wrapped(net)
    x = torch.randn(5, 4)
    params = {k: v.detach() for k, v in net.named_parameters()}
    rparams = {"net." + k: v for k, v in params.items()}

    def loss(m):
        return lambda p, x: functional_call(m, p, (x,)).pow(2).sum()

    ref = grad(loss(net))(params, x)
    got = grad(loss(rnet))(rparams, x)
    assert_tree_close({k[4:]: v for k, v in got.items()}, ref)
    # per-sample gradients
    ps = vmap(grad(loss(net)), in_dims=(None, 0))(params, x)
    got = vmap(grad(loss(rnet)), in_dims=(None, 0))(rparams, x)
    assert_tree_close({k[4:]: v for k, v in got.items()}, ps)


def test_blocks_of_a_model_rematerialised_under_functional_call():
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

        def forward(self, x, use_remat):
            for b in self.blocks:
                x = (remat(b) if use_remat else b)(x).tanh()
            return x.sum()

    net = Net()
    params = {k: v.detach() * 1.5 for k, v in net.named_parameters()}  # differ from the module's own
    x = torch.randn(2, 4)
    ref = grad(lambda p: functional_call(net, p, (x, False)))(params)
    got = grad(lambda p: functional_call(net, p, (x, True)))(params)
    assert_tree_close(got, ref)
    # MAML: inner step in functional form, outer gradient through it
    def maml(p, use_remat):
        g = grad(lambda q: functional_call(net, q, (x, use_remat)))(p)
        fast = {k: p[k] - 0.1 * g[k] for k in p}
        return functional_call(net, fast, (x, use_remat))

    assert_tree_close(grad(maml)(params, True), grad(maml)(params, False))


def test_nested_remat_under_grad():
    inner = remat(lambda x, w: torch.tanh(x @ w))
    outer = remat(lambda x, w: inner(inner(x, w), w).sum())
    plain = lambda x, w: torch.tanh(torch.tanh(x @ w) @ w).sum()
    for T in (lambda g: grad(g, argnums=(0, 1)), lambda g: hessian(g)):
        assert_tree_close(T(outer)(X, W), T(plain)(X, W), rtol=1e-10, atol=1e-12)


def test_vmap_of_remat_then_eager_backward():
    w = W.clone().requires_grad_()
    vmap(remat(lambda x: f(x, w)))(X.reshape(3, 1, 4)).sum().backward()
    g = w.grad.clone()
    w.grad = None
    vmap(lambda x: f(x, w))(X.reshape(3, 1, 4)).sum().backward()
    assert_tree_close(g, w.grad)


def test_eager_autograd_over_functorch_grad():
    """Result of torch.func.grad differentiated again by eager autograd."""
    w = W.clone().requires_grad_()
    g = grad(remat(lambda x: f(x, w)))(X)
    (gw,) = torch.autograd.grad(g.sum(), w)
    w2 = W.clone().requires_grad_()
    (ref,) = torch.autograd.grad(grad(lambda x: f(x, w2))(X).sum(), w2)
    assert_tree_close(gw, ref, rtol=1e-10, atol=1e-12)


class _Holder:
    w = None  # a class attribute: out of reach of the static scan


def test_capture_missed_by_scan_is_found_and_threaded():
    def fn(x):
        return f(x, _Holder.w)

    def loss(w, use):
        _Holder.w = w
        return (remat(fn) if use else fn)(X)

    try:
        assert_tree_close(grad(loss)(W, True), grad(loss)(W, False))
    finally:
        _Holder.w = None


def test_capture_that_changes_before_backward_raises_instead_of_zero():
    def fn(x):
        return f(x, _Holder.w)

    def loss(w, wrap=remat):
        _Holder.w = w
        out = wrap(fn)(X)
        _Holder.w = W.clone()  # swapped away before backward runs
        return out

    try:
        # backward replays the recorded forward, which read the tensor it used: as plain
        assert_tree_close(grad(loss)(W), grad(lambda w: loss(w, lambda g: g))(W))
        # under grad of grad too (its backward is differentiated: the recorded forward is
        # replayed on the Function's inputs; the function does not run again)
        assert_tree_close(grad(lambda w: grad(loss)(w).sum())(W),
                          grad(lambda w: grad(lambda w: loss(w, lambda g: g))(w).sum())(W))
    finally:
        _Holder.w = None


def test_int_inputs_and_outputs_under_vmap_grad():
    def g(x, idx):
        return x[idx].sin().sum(), idx + 1

    def loss(fn):
        return lambda x, idx: fn(x, idx)

    idx = torch.tensor([0, 2])
    ref = vmap(grad(loss(g), has_aux=True), in_dims=(0, None))(X, idx)
    assert_tree_close(vmap(grad(loss(remat(g)), has_aux=True), in_dims=(0, None))(X, idx), ref)


def test_vmap_over_batched_parameters_read_through_a_module():
    """MAML over tasks: one parameter set per task, swapped in and read by a closure."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 2, 4)
    p = {k: v.detach() for k, v in lin.named_parameters()}
    ps = {k: v.expand(3, *v.shape).clone() + 0.1 * torch.randn(3, *v.shape) for k, v in p.items()}

    def make(use):
        block = remat(lambda h: torch.tanh(lin(h))) if use else (lambda h: torch.tanh(lin(h)))

        def loss(p, x):
            with torch.nn.utils.stateless._reparametrize_module(lin, p):
                return block(x).pow(2).sum()
        return loss

    assert_tree_close(vmap(make(True))(ps, x), vmap(make(False))(ps, x))
    assert_tree_close(vmap(grad(make(True)))(ps, x), vmap(grad(make(False)))(ps, x))
