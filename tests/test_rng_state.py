"""preserve_rng_state: global-RNG code recomputes bitwise-identically, at no cost without RNG."""

from __future__ import annotations

import pytest
import torch
from torch.func import grad, jacfwd, vmap

from remat_fn import RematError, remat
from remat_fn._region import RNGSnapshot
from remat_fn.policies import dots_saveable, everything_saveable, memory_budget

from ._util import assert_tree_close, plain_and_remat


def drop_block(x, w):
    h = torch.nn.functional.dropout(torch.tanh(x @ w), p=0.5, training=True)
    return (h * torch.rand_like(h)).sum()


def _eager_grads(fn, x, w, seed):
    torch.manual_seed(seed)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(xs, ws)
    torch.rand(7)  # the program keeps drawing between forward and backward
    y.backward()
    return y.detach(), xs.grad, ws.grad


def test_dropout_recomputes_bitwise_eager():
    x, w = torch.randn(8, 6), torch.randn(6, 6)
    ref = _eager_grads(drop_block, x, w, 0)
    got = _eager_grads(remat(drop_block), x, w, 0)
    assert_tree_close(got, ref, exact=True)
    # and the caller's RNG stream continues as if no recompute happened
    torch.manual_seed(0)
    _eager_grads(remat(drop_block), x, w, 0)
    after_remat = torch.rand(3)
    _eager_grads(drop_block, x, w, 0)
    assert torch.equal(after_remat, torch.rand(3))


def test_dropout_recomputes_bitwise_under_grad_and_vmap():
    x, w = torch.randn(8, 6), torch.randn(6, 6)
    torch.manual_seed(1)
    ref = grad(drop_block, argnums=(0, 1))(x, w)
    torch.manual_seed(1)
    got = grad(remat(drop_block), argnums=(0, 1))(x, w)
    assert_tree_close(got, ref, exact=True)
    torch.manual_seed(2)
    ref = vmap(grad(drop_block), in_dims=(0, None), randomness="different")(x.reshape(2, 4, 6), w)
    torch.manual_seed(2)
    got = vmap(grad(remat(drop_block)), in_dims=(0, None), randomness="different")(x.reshape(2, 4, 6), w)
    assert_tree_close(got, ref, exact=True)


def test_without_preserve_rng_state_recompute_differs():
    x, w = torch.randn(8, 6), torch.randn(6, 6)
    ref = _eager_grads(drop_block, x, w, 0)
    # changed (issue 19): eager backward replays the recorded ops with their recorded
    # generator states, so even preserve_rng_state=False gives the exact gradients
    got = _eager_grads(remat(drop_block, preserve_rng_state=False), x, w, 0)
    assert_tree_close(got, ref, exact=True)
    # a real re-run of the function (debug=True) still draws fresh numbers without it
    got = _eager_grads(remat(drop_block, preserve_rng_state=False, debug=True), x, w, 0)
    assert not torch.equal(got[2], ref[2])


def test_no_random_numbers_keeps_no_state(monkeypatch):
    calls = []
    orig_enter = RNGSnapshot.__enter__

    def spy(self):
        calls.append(1)
        return orig_enter(self)

    monkeypatch.setattr(RNGSnapshot, "__enter__", spy)
    x = torch.randn(4, requires_grad=True)
    remat(lambda x: x.sin().sum())(x).backward()
    grad(remat(lambda x: x.sin().sum()))(x.detach())
    assert calls == []
    # changed (issue 19): eager backward replays random ops from the generator states
    # recorded with them, not from the snapshot; re-runs of the function use the snapshot
    remat(lambda x: (x * torch.rand(4)).sin().sum())(x).backward()
    assert calls == []
    grad(remat(lambda x: (x * torch.rand(4)).sin().sum()))(x.detach())  # (so does torch.func's)
    assert calls == []
    grad(remat(lambda x: (x * torch.rand(4)).sin().sum(), debug=True))(x.detach())
    assert calls == [1]
    remat(lambda x: (x * torch.rand(4)).sin().sum(), debug=True)(x).backward()
    assert calls == [1, 1]


def test_snapshot_restores_callers_state():
    torch.manual_seed(5)
    snap = RNGSnapshot([])
    a = torch.rand(3)
    assert snap.finish()
    b = torch.rand(3)
    with snap:
        assert torch.equal(torch.rand(3), a)
    assert not torch.equal(torch.rand(3), b)  # continues after b, not replaying it


@pytest.mark.parametrize("p", [0.1, 0.9])
def test_nn_dropout_module(p):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.Dropout(p), torch.nn.Linear(5, 1))
    x = torch.randn(16, 5)
    grads = []
    for fn in (net, remat(net)):
        net.zero_grad()
        torch.manual_seed(3)
        fn(x).sum().backward()
        grads.append([q.grad.clone() for q in net.parameters()])
    assert_tree_close(grads[0], grads[1], exact=True)


# Regions nested in regions that draw from torch's global generator (bug 4): where an enclosing
# region's backward runs it again (vmap around its forward; a region with regions nested in it), a
# nested region's forward runs inside that re-run and records, for each draw, the state it reads
# from the live generator; the re-run replays the draws from the enclosing region's recorded states
# without moving it, so every draw of the nested region recorded the first draw's state and its
# own backward replayed r1 for r2 (remat gave 11 * r1 for r1 + 10 * r2).  Compared with the plain
# function (same seed), bit for bit up to float64 rounding.

_D = torch.float64


def _two_draws(h):
    return torch.rand_like(h) * torch.rand_like(h) * h


def _r1_plus_10_r2(h):
    return torch.rand_like(h) * h + 10 * torch.rand_like(h) * h


def _dropout_and_rand_like(h):
    return torch.nn.functional.dropout(h, 0.5, training=True) * torch.rand_like(h)


def _bernoulli_and_randn_like(h):
    return torch.bernoulli(torch.full((h.shape[-1],), 0.5, dtype=h.dtype)) * torch.randn_like(h) * h


def _nest(wrap, body, levels, between):
    f = wrap(body)
    for _ in range(levels - 1):
        if between:  # (the enclosing region draws too, before and after the nested one)
            f = wrap(lambda x, g=f: g(x * torch.rand_like(x)) + torch.randn_like(x).sin() * x)
        else:
            f = wrap(lambda x, g=f: g(x))
    return f


def _grads(f, how, x):
    torch.manual_seed(7)
    if how in ("same", "different"):
        return vmap(grad(lambda x: f(x).sin().sum()), randomness=how)(x)
    if how == "grad":
        return grad(lambda x: f(x).sin().sum())(x)
    if how == "vjp":
        out, vjp_fn = torch.func.vjp(lambda x: f(x).sin(), x)
        return vjp_fn(torch.ones_like(out))[0]
    if how == "jacrev":
        return torch.func.jacrev(lambda x: f(x).sin().sum(0))(x)
    xs = x.clone().requires_grad_()
    f(xs).sin().sum().backward()
    return xs.grad


def _check_nested(body, levels, between, how, policy=None):
    x = torch.randn(3, 4, dtype=_D, generator=torch.Generator().manual_seed(0)) / 2
    ref = _grads(_nest(lambda f: f, body, levels, between), how, x)
    got = _grads(_nest(lambda f: remat(f, policy=policy), body, levels, between), how, x)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("randomness", ["same", "different"])
def test_nested_region_two_draws_under_vmap_grad(randomness):
    _check_nested(_two_draws, 2, False, randomness)  # (was off by 0.49 / 0.84)


def test_nested_region_r1_plus_10_r2_under_vmap_grad():
    xs = torch.ones(2, 3, dtype=_D)
    inner = remat(_r1_plus_10_r2)
    outer = remat(lambda x: inner(x))
    torch.manual_seed(7)
    got = vmap(grad(lambda x: outer(x).sum()), randomness="same")(xs)
    torch.manual_seed(7)
    r1, r2 = torch.rand(3, dtype=_D), torch.rand(3, dtype=_D)
    torch.testing.assert_close(got, (r1 + 10 * r2).expand(2, 3), rtol=0, atol=1e-12)  # (remat gave 11 * r1)
    for how in ("same", "different", "grad", "eager"):
        _check_nested(_r1_plus_10_r2, 2, False, how)


@pytest.mark.parametrize("levels", [2, 3])
@pytest.mark.parametrize("between", [False, True], ids=["only-nested-draws", "enclosing-draws-too"])
@pytest.mark.parametrize("how", ["same", "different", "grad", "vjp", "eager"])
def test_nested_region_dropout_and_rand_like(levels, between, how):
    _check_nested(_dropout_and_rand_like, levels, between, how)


@pytest.mark.parametrize("levels", [2, 3])
@pytest.mark.parametrize("how", ["same", "different", "grad", "vjp", "eager"])
def test_nested_region_bernoulli_and_randn_like(levels, how):
    _check_nested(_bernoulli_and_randn_like, levels, True, how)  # (three levels: wrong under grad too)


@pytest.mark.parametrize("policy", ["dots_saveable", "everything_saveable", "memory_budget"])
@pytest.mark.parametrize("how", ["same", "grad"])
def test_nested_region_draws_with_policies(policy, how):
    pol = {"dots_saveable": dots_saveable, "everything_saveable": everything_saveable,
           "memory_budget": memory_budget(0.5)}[policy]
    for body in (_two_draws, _r1_plus_10_r2, _dropout_and_rand_like):
        _check_nested(body, 3, True, how, pol)


def test_nested_region_draws_under_jacrev():
    _check_nested(_r1_plus_10_r2, 2, True, "jacrev")
    # three levels: refused with a RematError until the nested spans replayed as regions of their own
    # (the middle region ran again inside jacrev's vmap, where torch forbids drawing); now exact
    _check_nested(_r1_plus_10_r2, 3, False, "jacrev")
    _check_nested(_r1_plus_10_r2, 3, True, "jacrev")
    _check_nested(_dropout_and_rand_like, 4, True, "jacrev")


# A region whose inputs are not vmapped, drawing inside vmap(randomness="different") (bug 8): the
# draw, and so the region's output, is batched all the same.  Backward differentiated the forward
# level's graph, whose saved draw came back from the tape below every transform, the batch
# dimension a plain one, so each example's gradient read every example's draw (w's gradient off
# by 0.5 to 20).  It now re-runs the region, each draw from its recorded state.  Compared with
# the plain function (same seed).

_W_RANDOM = {
    "w_times_rand": lambda w: w * torch.rand(4, dtype=_D),
    "w_times_randn": lambda w: w * torch.randn(4, dtype=_D),
    "w_times_rand_like": lambda w: w * torch.rand_like(w),
    "dropout": lambda w: torch.nn.functional.dropout(w, 0.5, training=True),
    "bernoulli": lambda w: w * torch.bernoulli(torch.full((4,), 0.5, dtype=_D)),
    "sin_of_product": lambda w: (w * torch.rand(4, dtype=_D)).sin(),
    "two_outputs": lambda w: (w * torch.rand(4, dtype=_D), w.sin() * torch.randn(4, dtype=_D)),
}


def _unbatched_region_grad(wrap, body, how, randomness):
    x = torch.randn(3, 4, dtype=_D, generator=torch.Generator().manual_seed(0))
    w = torch.randn(4, dtype=_D, generator=torch.Generator().manual_seed(1))
    f = wrap(body)

    def loss(w):
        out = vmap(lambda x: f(w), randomness=randomness)(x)
        return sum(o.pow(2).sum() for o in (out if isinstance(out, tuple) else (out,)))

    torch.manual_seed(0)
    if how == "grad":
        return grad(loss)(w)
    if how == "vjp":
        out, vjp_fn = torch.func.vjp(loss, w)
        return vjp_fn(torch.ones_like(out))[0]
    if how == "jacrev":
        return torch.func.jacrev(loss)(w)
    if how == "twice":
        return grad(lambda w: loss(w) + loss(w))(w)
    ws = w.clone().requires_grad_()
    loss(ws).backward()
    return ws.grad


@pytest.mark.parametrize("randomness", ["different", "same"])
@pytest.mark.parametrize("how", ["grad", "vjp", "eager", "twice"])
@pytest.mark.parametrize("body", sorted(_W_RANDOM))
def test_unbatched_region_drawing_under_vmap_randomness(body, how, randomness):
    ref = _unbatched_region_grad(lambda f: f, _W_RANDOM[body], how, randomness)
    for policy in (None, dots_saveable, memory_budget(0.5)):
        got = _unbatched_region_grad(lambda f: remat(f, policy=policy), _W_RANDOM[body], how, randomness)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


def test_unbatched_region_drawing_under_jacrev_of_vmap_randomness():
    body = _W_RANDOM["w_times_rand"]
    ref = _unbatched_region_grad(lambda f: f, body, "jacrev", "same")  # (unbatched draws: exact)
    torch.testing.assert_close(_unbatched_region_grad(remat, body, "jacrev", "same"), ref, rtol=0, atol=1e-12)
    # batched draws: the region runs again inside jacrev's vmap, where torch forbids drawing (was silently wrong)
    with pytest.raises(RematError, match="Fix: draw with explicit keys"):
        _unbatched_region_grad(remat, body, "jacrev", "different")


def test_unbatched_region_drawing_nested_under_vmap_randomness():
    x = torch.randn(3, 4, dtype=_D, generator=torch.Generator().manual_seed(0))
    w = torch.randn(4, dtype=_D, generator=torch.Generator().manual_seed(1))
    body = _W_RANDOM["sin_of_product"]
    outs = []
    for wrap in (lambda f: f, remat):
        inner = wrap(body)
        outer = wrap(lambda v: inner(v * 2).cos())
        torch.manual_seed(0)
        outs.append(grad(lambda w: vmap(lambda x: outer(w) * x, randomness="different")(x).pow(2).sum())(w))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-12)


def _drawing(calls):
    def f(x, w):
        calls.append(1)
        return torch.nn.functional.dropout((x * w).sin(), 0.5) + torch.rand(4, dtype=_D) * w
    return f


_BATCHED_DRAWS = {
    "grad_vmap": lambda g, x, w: grad(lambda w: g(x, w).pow(2).sum())(w),
    "jacrev_vmap": lambda g, x, w: torch.func.jacrev(lambda w: g(x, w).sum(0))(w),
    "jvp_vmap": lambda g, x, w: torch.func.jvp(lambda w: g(x, w), (w,), (w.cos(),))[1],
    "grad_grad_vmap": lambda g, x, w: grad(lambda w: grad(lambda w: g(x, w).pow(2).sum())(w).sin().sum())(w),
    "eager_around_vmap": lambda g, x, w: torch.autograd.grad(g(x, w.requires_grad_()).pow(2).sum(), w)[0],
    "eager_create_graph_around_vmap": lambda g, x, w: torch.autograd.grad(
        torch.autograd.grad(g(x, w.requires_grad_()).pow(2).sum(), w, create_graph=True)[0].sin().sum(), w)[0],
}


@pytest.mark.parametrize("randomness", ["different", "same"])
@pytest.mark.parametrize("how", sorted(_BATCHED_DRAWS))
def test_batched_region_drawing_under_vmap_replays_its_draws(how, randomness):
    # A region whose input the vmap batches, drawing inside it (dropout, rand), under a transform
    # around the vmap: backward (and the jvp rule) replay the recorded physical draws on the batched
    # tensors below the vmap, each from its recorded generator state, so the function runs once.  It
    # ran again until this (twice per forward), and under jacrev, whose vmap forbids drawing, that
    # run was refused with a RematError.
    x = torch.randn(3, 4, dtype=_D, generator=torch.Generator().manual_seed(2))
    w0 = torch.randn(4, dtype=_D, generator=torch.Generator().manual_seed(3))
    (want, n_plain), (got, n_remat) = plain_and_remat(
        _drawing, lambda f: _BATCHED_DRAWS[how](vmap(f, in_dims=(0, None), randomness=randomness), x, w0.clone()), seed=11)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert n_remat == n_plain == 1


_PER_SAMPLE_DRAWS = {
    "vmap_grad": (lambda g, xb, w: vmap(lambda x: grad(lambda w: g(x, w).pow(2).sum())(w), randomness="different")(xb), 1),
    "vmap_vjp_twice": (lambda g, xb, w: vmap(lambda x: (lambda o, fn: fn(o)[0] + fn(o.cos())[0])(
        *torch.func.vjp(lambda w: g(x, w), w)), randomness="different")(xb), None),
    "vmap_grad_grad": (lambda g, xb, w: vmap(lambda x: grad(lambda w: grad(lambda w: g(x, w).pow(2).sum())(w).sin().sum())(w),
                                             randomness="different")(xb), None),
    "eager_around_vmap_grad": (lambda g, xb, w: torch.autograd.grad(vmap(lambda x: grad(lambda v: g(x, v).pow(2).sum())(w),
                                                                         randomness="different")(xb).sin().sum(), w)[0], None),
}


@pytest.mark.parametrize("how", sorted(_PER_SAMPLE_DRAWS))
def test_per_sample_gradients_with_batched_draws(how):
    # Per-sample gradients (vmap(grad)) of a region drawing under randomness='different', its input
    # batched: backward differentiates the forward level's graph, the saved draws replayed from the
    # tape and batched again as they were saved (KeepHandles), so the function runs once under
    # vmap(grad) (twice until this).  Where something differentiates that backward it runs again,
    # each draw from its recorded state; values exact everywhere.
    xb = torch.randn(3, 4, dtype=_D, generator=torch.Generator().manual_seed(4))
    w0 = torch.randn(4, dtype=_D, generator=torch.Generator().manual_seed(5))
    run, runs = _PER_SAMPLE_DRAWS[how]
    (want, n_plain), (got, n_remat) = plain_and_remat(
        _drawing, lambda f: run(f, xb, w0.clone().requires_grad_(how.startswith("eager"))), seed=12)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert n_plain == 1 and (runs is None or n_remat == runs)


# -- a generator of the function's own where the function runs again (a hostile pass) ---------
def _own_generator_runs():
    """(name, run): each runs ``fn`` (plain or remat) under a transform whose region runs the function
    again (forward mode's rule under vmap, eager forward mode then backward, the strict checks)."""
    import torch.autograd.forward_ad as fwAD

    x = torch.tensor([0.3, -1.2, 2.0, 0.7], dtype=torch.float64)

    def eager_forward_mode(fn):
        xl = x.clone().requires_grad_()
        with fwAD.dual_level():
            p, t = fwAD.unpack_dual(fn(fwAD.make_dual(xl, torch.ones_like(x))))
            return p, t, torch.autograd.grad((p * t).sum(), xl)[0]

    def eager(fn):
        xl = x.clone().requires_grad_()
        y = fn(xl)
        return y, torch.autograd.grad(y.pow(2).sum(), xl)[0]

    return {
        "jacfwd_same": lambda fn: jacfwd(fn, randomness="same")(x),
        "jacfwd_different": lambda fn: jacfwd(fn, randomness="different")(x),
        "vmap_jvp_unbatched_primal": lambda fn: vmap(lambda t: torch.func.jvp(fn, (x,), (t,)), randomness="same")(
            torch.eye(4, dtype=torch.float64)),
        "eager_forward_mode_then_backward": eager_forward_mode,
        "eager_debug": eager,
        "grad_debug": lambda fn: grad(lambda z: fn(z).pow(2).sum())(x),
        "first_call_calling_torch_func": eager,
    }


@pytest.mark.parametrize("where", ["region", "two_draws", "nested"])
@pytest.mark.parametrize("name", list(_own_generator_runs()))
def test_a_generator_of_the_functions_own_where_the_function_runs_again(name, where):
    """The run again drew from the generator as the forward had left it: other numbers than the
    forward's (0.14 to 1.7 off), and the generator moved on twice; it starts where the forward did.
    Two draws from it: the state before the first (torch hands a dispatch mode a Python object of its
    own for each generator argument: keyed by object, the second draw's state was restored last).
    Drawn by a region nested in the one that runs again: the caller's generator, not the nested
    region's private one (0.05 to 0.4 off, a hostile pass)."""
    run = _own_generator_runs()[name]
    g = torch.Generator()

    def fn(z):
        if name == "first_call_calling_torch_func":  # (its first call tries eager, then the torch.func path)
            z = z + 0 * torch.func.grad(lambda u: u.sin().sum())(z.detach())
        y = z.sin() * torch.rand(4, generator=g, dtype=torch.float64)
        return y * torch.rand(4, generator=g, dtype=torch.float64) if where == "two_draws" else y

    debug = name.endswith("debug")
    if where == "nested":
        inner = remat(fn)
        region = remat(lambda z: inner(z * 1.0), debug=debug)
    else:
        region = remat(fn, debug=debug)
    results = {}
    for kind, wrapped in (("plain", fn), ("remat", region)):
        g.manual_seed(5)
        out = run(wrapped)
        results[kind] = (out, torch.rand(3, generator=g))
    assert_tree_close(results["remat"][0], results["plain"][0], rtol=0, atol=1e-12)
    assert torch.equal(results["remat"][1], results["plain"][1]), "the generator moved on otherwise than plain's"
