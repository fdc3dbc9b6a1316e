"""The eager (saved-tensor hook) path under plain autograd."""

from __future__ import annotations

import pytest
import torch

from remat_fn import remat

from ._util import OpCount, assert_tree_close


def block(x, w):
    return torch.tanh(x @ w).sin() * x


def two(x, w):
    return block(block(x, w), w)


def _leaves(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(4, 4, generator=g, dtype=torch.float64)


def test_backward_bitwise_equal():
    x, w = _leaves()
    outs = []
    for fn in (two, remat(two)):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        fn(xs, ws).sum().backward()
        outs.append((xs.grad, ws.grad))
    assert_tree_close(outs[0], outs[1], exact=True)


def test_closure_gets_gradient_eager():
    x, w = _leaves()
    w = w.requires_grad_()
    remat(lambda x: block(x, w))(x).sum().backward()
    g = w.grad.clone()
    w.grad = None
    block(x, w).sum().backward()
    assert torch.equal(g, w.grad)


def test_autograd_grad_create_graph_double_backward():
    x, w = _leaves()
    res = []
    for fn in (two, remat(two)):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        (gx,) = torch.autograd.grad(fn(xs, ws).sum(), xs, create_graph=True)
        gg = torch.autograd.grad(gx.pow(2).sum(), (xs, ws))
        res.append((gx.detach(), gg))
    assert_tree_close(res[0], res[1], exact=True)


def test_retain_graph_repeated_backward_same_result():
    x, w = _leaves()
    counts = [0]

    def f(x, w):
        counts[0] += 1
        return two(x, w)

    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = remat(f)(xs, ws).sum()
    g1 = torch.autograd.grad(y, (xs, ws), retain_graph=True)
    g2 = torch.autograd.grad(y, (xs, ws), retain_graph=True)
    g3 = torch.autograd.grad(y, (xs, ws))
    assert_tree_close(g1, g2, exact=True)
    assert_tree_close(g1, g3, exact=True)
    assert_tree_close(g1, torch.autograd.grad(two(xs, ws).sum(), (xs, ws)))
    # changed (issue 19): each backward replays the recorded ops and never calls f again
    assert counts[0] == 1  # the forward only


def test_early_stop_skips_tail_of_region():
    ran = []

    def f(x):
        y = x.sin().exp()  # exp saves its output: backward recomputes the region
        ran.append("tail")
        return y * 2 + 1  # mul by scalar / add save nothing

    x = torch.randn(3, requires_grad=True)
    out = remat(f)(x)
    assert ran == ["tail"]
    with OpCount() as c:
        out.sum().backward()
    # the recomputation stopped at exp's output: the Python tail and the mul/add of
    # the region did not run again
    assert ran == ["tail"], "recompute should stop after the last saved tensor"
    assert (c.n["sin"], c.n["exp"], c.n.get("add", 0)) == (1, 1, 0), c.n
    assert torch.allclose(x.grad, 2 * x.cos() * x.sin().exp())


def test_nested_remat_eager():
    x, w = _leaves()
    inner = remat(block)
    outer = remat(lambda x, w: inner(inner(x, w), w))
    outs = []
    for fn in (two, outer):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        fn(xs, ws).sum().backward()
        outs.append((xs.grad, ws.grad))
    assert_tree_close(outs[0], outs[1], exact=True)


def test_inputs_not_requiring_grad_and_partial_grads():
    x, w = _leaves()
    ws = w.clone().requires_grad_()
    out = remat(two)(x, ws)
    (gw,) = torch.autograd.grad(out.sum(), ws)
    ws2 = w.clone().requires_grad_()
    (ref,) = torch.autograd.grad(two(x, ws2).sum(), ws2)
    assert torch.equal(gw, ref)


def test_functional_call_then_backward_outside_context_uses_swapped_tensors():
    # MAML-style: fast weights differ from the module's own; backward runs after
    # functional_call has put the module's parameters back.
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)
    fast = {k: (v * 2 + 1).detach().requires_grad_() for k, v in lin.named_parameters()}
    out = torch.func.functional_call(remat(lin), fast, (x,)) if False else None
    from torch.nn.utils.stateless import _reparametrize_module

    rl = remat(lambda x: torch.tanh(lin(x)) * x)
    with _reparametrize_module(lin, fast):
        out = rl(x)
    out.sum().backward()
    got = {k: v.grad.clone() for k, v in fast.items()}
    for v in fast.values():
        v.grad = None
    with _reparametrize_module(lin, fast):
        out = torch.tanh(lin(x)) * x
    out.sum().backward()
    assert_tree_close(got, {k: v.grad for k, v in fast.items()}, exact=True)


def test_module_with_dropout_and_batchnorm_free_region():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    x = torch.randn(6, 4)
    rnet = remat(net)
    rnet(x).pow(2).sum().backward()
    g = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    net(x).pow(2).sum().backward()
    assert_tree_close(g, [p.grad for p in net.parameters()], exact=True)


def test_nested_regions_keep_only_outer_inputs():
    """Inner regions store their inputs through the outer region's hooks."""
    from remat_fn.memory import LiveBytes

    step = lambda x: torch.tanh(x * 0.5 + 0.1)

    def four(x):
        for _ in range(4):
            x = step(x)
        return x

    inner = remat(four)
    nested = remat(lambda x: inner(inner(inner(inner(x)))))
    x = torch.randn(64, 64, requires_grad=True)
    with LiveBytes() as m:
        y = nested(x)
        live = m.live
    assert live == y.numel() * 4  # just the output; inner inputs were dropped
    y.sum().backward()
    g = x.grad.clone()
    x.grad = None
    four(four(four(four(x)))).sum().backward()
    assert torch.equal(g, x.grad)


def test_composes_with_save_on_cpu():
    x = torch.randn(8, 8, requires_grad=True)
    with torch.autograd.graph.save_on_cpu():
        y = remat(lambda x: torch.tanh(x @ x).sin())(x)
    y.sum().backward()
    g = x.grad.clone()
    x.grad = None
    torch.tanh(x @ x).sin().sum().backward()
    assert torch.equal(g, x.grad)


@pytest.mark.parametrize("wrap", ["remat", "compat"])
def test_debug_with_create_graph_double_backward(wrap):
    # debug=True compares the re-run's op sequence with the forward's: under create_graph autograd
    # adds detaches to the re-run, which change no value (a false RecomputeMismatchError before)
    import remat_fn

    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 4, dtype=torch.float64, generator=g).requires_grad_()
    f = lambda x: torch.tanh(x @ w)  # noqa: E731

    def run(call):
        x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        loss = (call(x) ** 2).sum()
        gs = torch.autograd.grad(loss, (x, w), create_graph=True)
        return torch.autograd.grad(sum((t ** 2).sum() for t in gs), (x, w))

    call = remat_fn.remat(f, debug=True) if wrap == "remat" else (lambda x: remat_fn.compat.checkpoint(f, x, debug=True))
    for a, b in zip(run(call), run(f)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
