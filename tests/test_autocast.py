"""Mixed precision and differentiation inside regions: what real training runs do.

Autocast: gradients bitwise equal to ``torch.utils.checkpoint`` under CPU
autocast (bf16, fp16) in eager mode, and equal to the plain function under
``torch.func``.  The CUDA path is the same code with another device type; its
state handling is checked here on CPU by setting the CUDA autocast flags, which
torch allows without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import grad, vmap
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from remat_fn import policies, remat
from remat_fn._region import AutocastState
from remat_fn.compat import checkpoint

from ._util import assert_tree_close

DTYPES = [torch.bfloat16, torch.float16]


def _f(x, y):
    return torch.mm(x, y).sin() @ y + torch.tanh(x).sum()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("policy", [None, "dots"])
def test_eager_autocast_bitwise_equal_to_torch_checkpoint(dtype, policy):
    torch.manual_seed(0)
    x, y = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    ctx = None
    if policy == "dots":
        import functools

        import torch.utils.checkpoint as tc

        ctx = functools.partial(tc.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    res = []
    for cp in (checkpoint, torch_checkpoint):
        with torch.autocast("cpu", dtype=dtype):
            out = cp(_f, x, y, use_reentrant=False, **({"context_fn": ctx} if ctx else {}))
            assert out.dtype == dtype
            loss = out.float().sum()
        res.append(torch.autograd.grad(loss, (x, y)))
    assert_tree_close(res[0], res[1], exact=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("how", ["grad", "vmap_grad"])
def test_torch_func_autocast_equal_to_plain(dtype, how):
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def loss(x, y, use):
        with torch.autocast("cpu", dtype=dtype):
            return (remat(_f) if use else _f)(x, y).float().sum()

    if how == "grad":
        got = grad(loss, argnums=(0, 1))(x, y, True)
        want = grad(loss, argnums=(0, 1))(x, y, False)
    else:
        xs = torch.stack([x, x * 0.5])
        got = vmap(grad(loss), in_dims=(0, None, None))(xs, y, True)
        want = vmap(grad(loss), in_dims=(0, None, None))(xs, y, False)
    assert_tree_close(got, want, exact=True)


def test_backward_inside_a_different_autocast_recomputes_under_the_forward_state():
    x = torch.randn(4, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = checkpoint(lambda x: torch.mm(x, x).exp(), x, use_reentrant=False)
    with torch.autocast("cpu", dtype=torch.float16):  # backward under another autocast
        out.float().sum().backward()
    ref = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = torch.mm(ref, ref).exp()
    o.float().sum().backward()
    assert torch.equal(x.grad, ref.grad)


def test_region_without_autocast_recomputes_without_it():
    x = torch.randn(4, 4, requires_grad=True)
    out = checkpoint(lambda x: torch.mm(x, x).exp(), x, use_reentrant=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out.sum().backward()  # would fail with a dtype mismatch if autocast leaked in
    assert x.grad.dtype == torch.float32


def test_cuda_autocast_state_is_captured_and_restored_without_a_gpu():
    """The CUDA path's logic: the flags recorded at forward are set around the
    recomputation and the caller's flags come back afterwards."""
    prev = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    try:
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", torch.bfloat16)
        state = AutocastState()
        torch.set_autocast_enabled("cuda", False)
        torch.set_autocast_dtype("cuda", torch.float16)
        with state:
            assert torch.is_autocast_enabled("cuda")
            assert torch.get_autocast_dtype("cuda") == torch.bfloat16
        assert not torch.is_autocast_enabled("cuda")
        assert torch.get_autocast_dtype("cuda") == torch.float16
    finally:
        torch.set_autocast_enabled("cuda", prev[0])
        torch.set_autocast_dtype("cuda", prev[1])


def test_autocast_state_is_reentrant_and_leaves_nothing_behind():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = AutocastState()
    with state:
        with state:
            assert torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("dtype", DTYPES)
def test_policy_under_autocast_under_grad(dtype):
    x, w = torch.randn(6, 6), torch.randn(6, 6)

    def f(x, w):
        return torch.tanh(x @ w) @ w

    def loss(w, use):
        with torch.autocast("cpu", dtype=dtype):
            g = remat(f, policy=policies.dots_saveable) if use else f
            return g(x, w).float().sum()

    assert_tree_close(grad(loss)(w, True), grad(loss)(w, False), exact=True)


# -- differentiation inside a region -----------------------------------------------
def _inner_grad(x):
    y = x.sin().exp()
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    return g * y


def _first_and_second(fn, x):
    x = x.detach().clone().requires_grad_()
    (g,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    return g.detach(), gg


@pytest.mark.parametrize("shape", ["single", "nested", "two_children"])
@pytest.mark.parametrize("policy", [None, policies.dots_saveable, policies.everything_saveable])
def test_autograd_grad_inside_a_region(shape, policy):
    r = lambda f: remat(f, policy=policy)  # noqa: E731
    fns = {
        "single": r(_inner_grad),
        "nested": r(lambda x: r(_inner_grad)(x)),
        "two_children": r(lambda x: r(_inner_grad)(x) + r(_inner_grad)(x * 2)),
    }
    plain = {"single": _inner_grad, "nested": _inner_grad,
             "two_children": lambda x: _inner_grad(x) + _inner_grad(x * 2)}
    x = torch.randn(5, dtype=torch.float64)
    assert_tree_close(_first_and_second(fns[shape], x), _first_and_second(plain[shape], x),
                      rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_func_grad_inside_a_region_differentiated_again(dtype):
    g = lambda x: (x.sin() * x).sum()  # noqa: E731
    inner = lambda x: grad(g)(x)  # noqa: E731
    x = torch.randn(5, dtype=dtype)
    got = grad(lambda x: remat(inner)(x).pow(2).sum())(x)
    want = grad(lambda x: inner(x).pow(2).sum())(x)
    assert_tree_close(got, want, rtol=1e-5, atol=1e-6)
    # and with eager autograd outside
    xe = x.clone().requires_grad_()
    (ge,) = torch.autograd.grad(remat(inner)(xe).pow(2).sum(), xe)
    assert_tree_close(ge, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["vmap_grad", "vmap_vjp", "grad_vmap", "vmap_hessian", "eager_vmap", "grad"])
def test_autocast_disabled_inside_a_region_under_vmap(how):
    # the region turns bf16 autocast off inside; under vmap backward runs the function again
    # under the forward's autocast: its own backward (vjp_fn) ran under it too, recomputing the
    # matmul's gradient in bf16 (1.3e-2 off), where autograd's backward runs without autocast
    from torch.func import hessian, vjp

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(8, 8, generator=g), torch.randn(4, 8, generator=g)

    def f(x, w):
        with torch.autocast("cpu", enabled=False):
            return (x @ w).sin().sum()

    def loss(fn):
        def step(w, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(x, w)
        return step

    def run(fn):
        if how == "vmap_grad":
            return vmap(grad(loss(fn)), in_dims=(None, 0))(w, x)
        if how == "vmap_vjp":
            return vmap(lambda xi: vjp(lambda w: loss(fn)(w, xi), w)[1](torch.tensor(1.0))[0])(x)
        if how == "grad_vmap":
            return grad(lambda w: vmap(loss(fn), in_dims=(None, 0))(w, x).sum())(w)
        if how == "vmap_hessian":
            return vmap(hessian(loss(fn)), in_dims=(None, 0))(w, x[:2])
        if how == "grad":
            return grad(loss(fn))(w, x[0])
        ww = w.clone().requires_grad_()
        vmap(loss(fn), in_dims=(None, 0))(ww, x).sum().backward()
        return ww.grad

    torch.testing.assert_close(run(remat(f)), run(f), rtol=0, atol=0)
