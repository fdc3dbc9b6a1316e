"""Reverse mode around ``vmap``: backward replays the recorded forward on the batched tensors.

Under ``grad(vmap(f))``, ``jacrev(vmap(f))``, ``vjp(vmap(f))``, ``grad(vmap(vmap(f)))`` (a vmap
inside the grad level, the common functional training loop computing a batch's loss with vmap)
and eager autograd around ``vmap(f)``
the forward kept no tape: it ran as a planned re-run, and backward ran the function again with
placeholders, its Python side effects twice (a list one entry longer than plain code's).  Now the
forward keeps its tape and backward pulls the cotangents back through it on the tensors below the
vmap levels (``remat_fn._replay_live.replay_vjp``): the function runs once per forward.  Where an
outer level differentiates that backward (``hessian(vmap(f))``, ``create_graph=True``), the replay
runs below the vmap levels only, so the levels outside differentiate it (it ran the function again
before).  Under ``vmap(grad(vmap(f)))`` a vmap outside the grad level keeps each example's
gradient apart: where it batches every differentiated input, as here, the replay below both vmaps
does too (it ran again until this); otherwise it still runs again (tests/test_tape.py).  Every
case compares with the plain function.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import grad, hessian, jacrev, vjp, vmap

from remat_fn import remat

from ._util import assert_tree_close, ident
from .test_vmap_forward_replay import _CASES, compare_with_plain

D = torch.float64
_G = torch.Generator().manual_seed(48)
_XB = torch.randn(3, 4, dtype=D, generator=_G)
_XBB = torch.randn(3, 2, 4, dtype=D, generator=_G)
_V = torch.randn(4, dtype=D, generator=_G)


def _loss(out):
    if isinstance(out, tuple):
        return sum((o * o).sum() for o in out)
    return (out * out).sum()


def _scaled(f):  # (a weight the vmap does not batch, differentiated)
    return lambda v: vmap(lambda x: f(x * v))(_XB)


def _vjp_of(g):
    out, vjp_fn = vjp(g, _XB)
    return vjp_fn(tuple(o.cos() for o in out) if isinstance(out, tuple) else out.cos())


def _eager(g, create_graph: bool = False):
    x = _XB.clone().requires_grad_()
    loss = _loss(g(x))
    if create_graph:  # (eager autograd differentiates the backward: the replay, as the function)
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        loss = (gx * gx).sum()
    loss.backward()
    return x.grad


_TRANSFORMS = {
    "grad_vmap": lambda f: grad(lambda x: _loss(vmap(f)(x)))(_XB),
    "grad_vmap_in_dims_1": lambda f: grad(lambda x: _loss(vmap(f, in_dims=1)(x)))(_XB.T.contiguous()),
    "grad_vmap_out_dims_1": lambda f: grad(lambda x: _loss(vmap(f, out_dims=1)(x)))(_XB),
    "grad_vmap_unbatched_weight": lambda f: grad(lambda v: _loss(_scaled(f)(v)))(_V),
    "vjp_vmap": lambda f: _vjp_of(vmap(f)),
    "jacrev_vmap": lambda f: jacrev(lambda x: vmap(f)(x))(_XB),
    "grad_vmap_vmap": lambda f: grad(lambda x: _loss(vmap(vmap(f))(x)))(_XBB),
    "vmap_grad_vmap": lambda f: vmap(grad(lambda x: _loss(vmap(f)(x))))(_XBB),
    # (jacrev's basis vmap, between the outer vmap's level and the rule's: from_physical wraps in level order)
    "vmap_jacrev_vmap": lambda f: vmap(jacrev(lambda x: vmap(f)(x)))(_XBB),
    "vmap_jacrev_vmap_chunked": lambda f: vmap(jacrev(lambda x: vmap(f)(x), chunk_size=5))(_XBB),
    "hessian_vmap": lambda f: hessian(lambda v: _loss(_scaled(f)(v)))(_V),
    "eager_around_vmap": lambda f: _eager(vmap(f)),
    "eager_double_around_vmap": lambda f: _eager(vmap(f), create_graph=True),
}


@pytest.mark.parametrize("case", _CASES)
@pytest.mark.parametrize("transform", list(_TRANSFORMS))
def test_function_runs_once_under_reverse_mode_around_vmap(transform, case):
    if transform == "grad_vmap_out_dims_1" and case == "output_not_batched":
        pytest.skip("plain code fails: vmap's out_dims=1 expands an unbatched 1-d output to the wrong shape")
    compare_with_plain(_TRANSFORMS[transform], case, True)


def test_nested_region_storing_an_unbatched_input_under_grad_of_vmap():
    # Found by a hostile pass over this replay: the nested region's backward, run with grad mode
    # off under the grad level, was taken for one nothing differentiates (as eager autograd
    # around vmap is): w's gradient was 4.88 for plain's 1.45, silently.  It then ran the function
    # again there (three runs for plain's one); it now replays below the vmap levels only, under
    # the grad level, which differentiates the replay: one run.
    x = torch.randn(3, 4, dtype=D, generator=_G)
    y = torch.randn(4, dtype=D, generator=_G)

    def build(wrap, calls):
        box: list = []

        def inner(x, w):
            calls.append(1)
            box.append(w)
            return (x * w).sin()
        ri = wrap(inner)
        ro = wrap(lambda x, w: (ri(x, w) * x).sum())
        return lambda x, w: ro(x, w) + (box[-1] * x).sum()

    def run(wrap, calls):
        return grad(lambda x, w: vmap(build(wrap, calls), in_dims=(0, None))(x, w).sum(), argnums=(0, 1))(x, y)
    calls_plain: list = []
    calls_remat: list = []
    assert_tree_close(run(remat, calls_remat), run(ident, calls_plain), rtol=1e-10, atol=1e-10)
    assert len(calls_remat) == len(calls_plain) == 1


@pytest.mark.parametrize("depth", [2, 3, 4])
def test_nested_regions_with_a_no_grad_view_side_output_under_grad_of_vmap(depth):
    # Found by a hostile pass: from three regions deep, a region nested in a replayed span ran
    # as a region at the span's depth, so the span took its Function for a custom Function no
    # replay step stands for and ran again, failing its check (RecomputeMismatchError).
    xb = torch.randn(2, 3, dtype=D, generator=_G)
    cb = torch.randn(2, 3, dtype=D, generator=_G)

    def prog(wrap):
        def p(x, c):
            side: list = []

            def g(c):
                with torch.no_grad():
                    side.append(c[1:])
                return c * 2
            gg = wrap(g)
            for _ in range(depth - 1):
                gg = (lambda inner: wrap(lambda c: inner(c)))(gg)
            h = wrap(lambda x, c: gg(c) * x.cos())(x, c)
            return (h * side[0].sum()).sum() + h.sum()
        return p

    def run(wrap):
        return grad(lambda x, c: vmap(prog(wrap))(x, c).sum(), argnums=(0, 1))(xb, cb)
    assert_tree_close(run(remat), run(ident), rtol=1e-10, atol=1e-10)


_CLOSED = {
    "grad_vmap": lambda g, w0: grad(lambda w: vmap(g, in_dims=(0, None))(_XB, w).pow(2).sum())(w0),
    "jacrev_vmap": lambda g, w0: jacrev(lambda w: vmap(g, in_dims=(0, None))(_XB, w).sum(0))(w0),
    "grad_vmap_vmap": lambda g, w0: grad(lambda w: vmap(vmap(g, in_dims=(0, None)), in_dims=(0, None))(
        torch.stack([_XB, -_XB]), w).pow(2).sum())(w0),
    "grad_of_grad": lambda g, w0: grad(lambda w: grad(lambda v: g(_XB[0], v).pow(2).sum())(w).pow(2).sum())(w0),
}


@pytest.mark.parametrize("transform", list(_CLOSED))
def test_function_closing_over_the_tensor_it_is_given(transform):
    # Found by a hostile pass: f reads w0 from its closure (a constant to every transform) and is
    # given the same object as its differentiated argument.  The tape sees one tensor, so a replay
    # differentiated both reads: under grad(vmap) (new with this replay) and grad of grad (older)
    # the gradient was off (0.84 for plain's -1.05), silently.  Such a forward keeps no replay.
    w0 = torch.randn(4, dtype=D, generator=_G)

    def f(x, w):
        return (x * w).sin() * w0.cos()
    assert_tree_close(_CLOSED[transform](remat(f), w0), _CLOSED[transform](f, w0), rtol=1e-10, atol=1e-10)


_UNBATCHED = {
    "grad_vmap": lambda g: grad(lambda w: _loss(vmap(g, in_dims=(0, None))(_XB, w)))(_V),
    "jacrev_vmap": lambda g: jacrev(lambda w: vmap(g, in_dims=(0, None))(_XB, w)[1])(_V),
    "vjp_vmap": lambda g: vjp(lambda w: vmap(g, in_dims=(0, None))(_XB, w), _V)[1](
        (_XB.cos(), torch.ones(3, 4, dtype=D), torch.ones(3, 4, dtype=D))),
    "grad_vmap_vmap": lambda g: grad(lambda w: _loss(vmap(vmap(g, in_dims=(0, None)), in_dims=(0, None))(
        torch.stack([_XB, -_XB]), w)))(_V),
}


@pytest.mark.parametrize("transform", list(_UNBATCHED))
def test_differentiated_outputs_the_vmap_does_not_batch(transform):
    # An output that depends only on the input the vmap does not batch (w itself, w.sin()) gets
    # batched cotangents: summed over the rule's batch where the recorded output is not batched
    # (sum_levels).  The function ran again there, its values exact (found by a hostile pass).
    def make(calls):
        def f(x, w):
            calls.append(1)
            return (x * w).sin(), w.sin() * 2, w
        return f
    calls_plain: list = []
    calls_remat: list = []
    want = _UNBATCHED[transform](make(calls_plain))
    got = _UNBATCHED[transform](remat(make(calls_remat)))
    assert_tree_close(got, want, rtol=1e-10, atol=1e-10)
    assert len(calls_remat) == len(calls_plain)


def _second_order_eager(loss):
    w = _V.clone().requires_grad_()
    (gw,) = torch.autograd.grad(loss(w), w, create_graph=True)
    (g2,) = torch.autograd.grad((gw * gw).sum(), w)
    return gw.detach(), g2


_SECOND_ORDER = {
    "eager_create_graph": _second_order_eager,
    "jacrev_jacrev": lambda loss: jacrev(jacrev(loss))(_V),
    "hessian": lambda loss: hessian(loss)(_V),
    "grad_grad": lambda loss: grad(lambda w: (grad(loss)(w) ** 2).sum())(_V),
}


@pytest.mark.parametrize("transform", list(_SECOND_ORDER))
def test_nested_vmapped_regions_sharing_an_unbatched_weight_second_order(transform):
    # Found by a hostile pass: a region under vmap holding a region under vmap of its own, the
    # weight unbatched in both and read again outside the inner one.  The inner region's graph
    # node under vmap(vmap) is of the class torch's vmap rule generates from the one it generates
    # at the outer vmap; the outer region took it for a custom Function no replay step stands for
    # and ran again, and the second derivatives through that run were silently wrong: under
    # eager create_graph [-33.31, 324.41, ...] for plain's [-13.18, 183.63, ...], under
    # jacrev(jacrev) a Hessian diagonal [32.27, 31.54, ...] for plain's [12.77, 17.85, ...].
    def loss(wrap):
        def f(x, w):
            return (x @ w.diag()).tanh() * w

        def g(xr, w):
            return vmap(wrap(f), in_dims=(0, None))(xr, w) + w
        return lambda w: vmap(wrap(g), in_dims=(0, None))(_XBB, w).pow(2).sum()
    run = _SECOND_ORDER[transform]
    assert_tree_close(run(loss(remat)), run(loss(ident)), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("trigger", ["dropout_different", "torch_func_grad_inside"])
def test_region_run_again_with_a_nested_vmapped_region_and_an_unbatched_weight(trigger):
    # Found by a hostile pass: an outer region under vmap that runs again in backward (its draws are
    # batched by randomness='different', or it calls torch.func.grad itself) holds a region under vmap
    # of its own, the weight unbatched.  In the run again, the nested region's forward sits under
    # vmap(grad(vmap)); its backward, called after that grad level exited, saw no grad level and
    # replayed below both vmaps, summing the weight's gradient over the outer examples too (and the
    # outer vmap's rule summed it again): f's share of w.grad came out B times plain's, silently
    # ([-0.85, 18.3, ...] for plain's [-0.37, 14.9, ...]).  The forward's levels now say so
    # (apart_inputs): that replay is refused there and the nested region runs again.
    xb = torch.randn(3, 2, 4, dtype=D, generator=torch.Generator().manual_seed(5))
    w0 = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(6))

    def run(wrap):
        torch.manual_seed(1)
        w = w0.clone().requires_grad_()

        def f(xi, w):
            return (xi * w).sin()

        def g(xr, w):
            if trigger == "dropout_different":
                extra = torch.nn.functional.dropout(w, 0.5)
            else:
                extra = grad(lambda v: (v * v).sin().sum())(w)
            return vmap(wrap(f), in_dims=(0, None))(xr, w) + extra
        randomness = "different" if trigger == "dropout_different" else "error"
        vmap(wrap(g), in_dims=(0, None), randomness=randomness)(xb, w).pow(2).sum().backward()
        return w.grad
    assert_tree_close(run(remat), run(ident), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", ["unused_argument", "unused_closure", "used_under_no_grad", "int_output_only"])
def test_eager_around_vmap_leaves_an_unused_input_without_a_gradient(case):
    # Plain autograd leaves .grad None for an input no output is computed from (an optimizer skips
    # it: momentum, weight decay); remat's backward under eager autograd around vmap gave zeros.
    x0 = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(7))

    def run(wrap):
        x, y, c = (x0.clone().requires_grad_() for _ in range(3))

        def f(x, y):
            if case == "unused_closure":
                _ = c  # (read, never computed from)
            if case == "used_under_no_grad":
                with torch.no_grad():
                    s = (y * 2).sum()
                return x.sin() * s
            if case == "int_output_only":
                return x.sin(), (y > 0).long()
            return x.sin()
        out = vmap(wrap(f))(x, y)
        out = out[0] if isinstance(out, tuple) else out
        out.pow(2).sum().backward()
        return x.grad, y.grad, c.grad
    want, got = run(ident), run(remat)
    for w, g in zip(want, got):
        assert (w is None) == (g is None)
        if w is not None:
            assert_tree_close(g, w, rtol=1e-10, atol=1e-10)
