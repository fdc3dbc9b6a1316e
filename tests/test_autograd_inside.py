"""Autograd used inside a region (hooks, ``detach_``, ``torch.autograd.grad``) and lazy
conjugate views among its outputs, under every transform: remat gives plain's results.

None of these is an op the recorded forward can replay (a hook is backward code, ``detach_``
reaches the dispatcher as an out-of-place ``detach`` nothing reads, autograd's backward ops
are not the graph an outer level differentiates): where something outside differentiates
the region's backward, the function runs again instead (``docs/design.md``).  Each case was
silently wrong under second order or forward mode until this (the error is in each test)."""

from __future__ import annotations

import pytest
import torch
from torch.func import grad, hessian, jacfwd, jvp, vjp, vmap

from remat_fn import RematError, remat

from ._util import assert_tree_close, ident, one_argument_transforms, two_argument_transforms

D = torch.float64
X = torch.tensor([0.3, -1.2, 2.0, 0.7], dtype=D)


def _close(a, b):
    assert_tree_close(a, b, rtol=1e-10, atol=1e-10)


_ALL = one_argument_transforms(X)
TRANSFORMS = {k: _ALL[k] for k in ("grad", "vjp", "jvp", "jacfwd", "hessian", "grad_of_grad", "vmap_grad",
                                   "eager_around_grad")}


def _hook_on_intermediate(x):
    h = x.sin()
    if h.requires_grad:  # (plain code under jvp alone: nothing requires grad)
        h.register_hook(lambda g: g * 2)
    return (h.cos() * x).sum()


def _hook_on_argument(x):
    x = x * 1.0
    if x.requires_grad:
        x.register_hook(lambda g: g * 3)
    return (x.sin() * x).sum()


def _detach_in_place(x):
    h = x.exp()
    k = h * 1.0
    k.detach_()
    return (k * h + k).sum()


def _autograd_grad_inside(x):
    h = x.sin()
    if not h.requires_grad:  # (plain code under jvp alone cannot differentiate inside)
        return (3 * h.pow(3) * x.cos()).sum()
    (g,) = torch.autograd.grad(h.pow(3).sum(), x, create_graph=True)
    return (g * h).sum()


CASES = {
    # off by 1.55 under grad of grad and hessian, 8.4 in eager autograd around grad
    "hook_on_intermediate": _hook_on_intermediate,
    # off by 5.3 under grad of grad
    "hook_on_argument": _hook_on_argument,
    # off by 0.94 under jvp/jacfwd, 1.47 under grad of grad/hessian, 14.3 eager around grad
    "detach_in_place": _detach_in_place,
    # off by 7.27 under grad of grad/hessian; vmap(grad) raised an internal RematError
    "autograd_grad_inside": _autograd_grad_inside,
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("case", list(CASES))
def test_autograd_inside_a_region_matches_plain(case, transform):
    f, t = CASES[case], TRANSFORMS[transform]
    if case == "autograd_grad_inside" and transform == "eager_around_grad":
        pytest.skip("torch.autograd.grad of a tensor torch.func.grad wraps: plain code refuses it")
    _close(t(remat(f)), t(f))


# -- the same at a level outside the call's innermost (a hostile pass) ------------------------
def _detach_in_place_vector(x):
    k = x.sin()
    k.detach_()
    return k * x


def _detach_in_place_of_a_clone(x):
    h = (x * 2).clone()
    h.detach_()
    return h.exp() * x.sin()


def _data_vector(x):
    k = x.sin()
    return k.data * x + x.cos().data * k


def _hook_vector(x):
    k = x.sin()
    if k.requires_grad:
        k.register_hook(lambda g: g * 3)
    return k * x


def _nonlinear(f):
    return lambda z: f(z).pow(2).sum()


_XB = torch.stack([X, 0.5 * X + 0.1])
OUTER = {
    "grad_of_grad": lambda f: grad(lambda y: grad(_nonlinear(f))(y).pow(2).sum())(X),
    "grad_of_grad_of_grad": lambda f: grad(lambda z: grad(lambda y: grad(_nonlinear(f))(y).pow(2).sum())(z).pow(2).sum())(X),
    "maml_grad_vmap_grad": lambda f: grad(lambda y: vmap(grad(_nonlinear(f)))(_XB * y).pow(2).sum())(X),
    "jacrev_vmap_grad": lambda f: torch.func.jacrev(lambda y: vmap(grad(_nonlinear(f)))(_XB * y).sum(0))(X),
    "vmap_grad_of_grad": lambda f: vmap(lambda y: grad(lambda y: grad(_nonlinear(f))(y).pow(2).sum())(y))(_XB),
    "eager_around_grad": lambda f: (lambda xl: torch.autograd.grad(grad(_nonlinear(f))(xl).pow(2).sum(), xl)[0])(
        X.clone().requires_grad_()),
    "jacrev_of_jacrev": lambda f: torch.func.jacrev(torch.func.jacrev(_nonlinear(f)))(X),
    "hessian": lambda f: hessian(_nonlinear(f))(X),
    "jvp_of_grad": lambda f: jvp(grad(_nonlinear(f)), (X,), (torch.ones_like(X),))[1],
    "jvp": lambda f: jvp(f, (X,), (torch.ones_like(X),))[1],
    "vmap_grad": lambda f: vmap(grad(_nonlinear(f)))(_XB),
}


@pytest.mark.parametrize("transform", list(OUTER))
@pytest.mark.parametrize("case", ["detach_in_place", "detach_in_place_of_a_clone", "data", "hook"])
@pytest.mark.parametrize("nested", [False, True], ids=["alone", "nested"])
def test_detach_data_or_hook_inside_differentiated_at_an_outer_level(case, transform, nested):
    """functorch applies the region's Function at every level, and plain code's ``detach_``, ``.data``
    or hook acts at the innermost level of the call alone: the levels outside differentiate through
    it.  The Function's rules at an outer level took the innermost level's (the forward level's graph,
    or a run again whose own vjp level ``detach_`` cut): 10 to 61 off under grad of grad with a loss
    whose cotangent depends on the input, 16 to 1.8e4 under MAML's grad(vmap(grad)), 7.6e5 under
    grad^3; the run again there runs under a level of its own inside (``outside_innermost``).  Nested in
    another region, the enclosing one's replay ran the nested one's recorded ops without them (0.83 off
    under jvp alone, 3.8 to 8.8e5 under the compositions above): it runs again too (``region_call``).  That run
    again skipped the ops the forward's backward needs not (``Tape.plan``), whose recorded values stood in, constants
    to the outer level: ``detach_`` of a clone under ``grad(vmap(grad))`` 4x off, silently (this session)."""
    f = {"detach_in_place": _detach_in_place_vector, "detach_in_place_of_a_clone": _detach_in_place_of_a_clone,
         "data": _data_vector, "hook": _hook_vector}[case]
    g = (lambda z: remat(f)(z * 1.0)) if nested else f
    _close(OUTER[transform](remat(g)), OUTER[transform](f))


# -- lazy conjugate views among the outputs ------------------------------------------------
def _conj(z):
    return z.conj()


def _mh(z):
    return z.reshape(2, 2).mH


def _pair(z):
    h = z.exp()
    return h, h.conj()


def _complex(x):
    return torch.complex(x, x.flip(-1) * 0.5)


def _loss(g):
    def f(x):
        out = g(_complex(x))
        outs = out if isinstance(out, tuple) else (out,)
        return sum((o * o.exp()).real.sum() + o.imag.sum() for o in outs)
    return f


@pytest.mark.parametrize("g", [_conj, _mh, _pair], ids=["conj", "mH", "pair"])
@pytest.mark.parametrize("transform", ["vmap", "grad", "jvp", "vjp", "grad_of_grad"])  # (jacfwd, vmap(grad):
# torch has no batching rule for the _neg_view the loss's imaginary part makes, plain code included)
def test_conjugate_view_outputs_keep_their_conjugation(g, transform):
    """``z.conj()`` is a view with a lazy conjugate bit, which the torch.func path's rebuild
    of view outputs (``as_strided`` of the base) dropped: under vmap the region returned
    ``z`` itself (4.0 off), and every derivative was off (1.0; 102 under vmap for a pair)."""
    def run(wrap):
        r = wrap(g)
        if transform == "vmap":
            return vmap(r)(torch.stack([_complex(X), 2 * _complex(X)]))
        f = _loss(r)
        if transform == "vmap_grad":
            return vmap(grad(f))(torch.stack([X, 2 * X]))
        if transform == "grad_of_grad":
            return grad(lambda y: grad(f)(y).pow(2).sum())(X)
        if transform == "jvp":
            return jvp(lambda x: r(_complex(x)), (X,), (torch.ones_like(X),))
        if transform == "vjp":
            return vjp(f, X)[1](torch.ones((), dtype=D))
        return {"grad": grad, "jacfwd": jacfwd}[transform](f)(X)

    _close(run(remat), run(ident))


def test_data_read_in_a_batchnorm_module_under_jvp_runs():
    """``.data`` read in a module with BatchNorm (training), under ``jvp`` through
    ``functional_call``: the function runs again for the tangents, and reading the storage
    of a functorch wrapper there crashed inside torch ("invalid python storage").  Plain code
    refuses the buffer update ("mutate a captured Tensor"); remat gives the tangent of the
    same module without running statistics, and updates them once."""
    from torch.func import functional_call

    from remat_fn.nn import remat_module

    class M(torch.nn.Module):
        def __init__(self, track=True):
            super().__init__()
            self.bn = torch.nn.BatchNorm1d(4, track_running_stats=track).to(D)

        def forward(self, x):
            h = self.bn(x)
            return (h.data * h).sum()

    x = torch.linspace(-1, 1, 12, dtype=D).reshape(3, 4) ** 3
    t = torch.full_like(x, 0.3) + x
    m = M()
    state = dict(m.named_parameters()) | dict(m.named_buffers())
    got = jvp(lambda x: functional_call(remat_module(m), state, (x,)), (x,), (t,))
    p = M(track=False)
    want = jvp(lambda x: functional_call(p, dict(p.named_parameters()), (x,)), (x,), (t,))
    assert_tree_close(got, want, rtol=1e-10, atol=1e-10)
    assert int(m.bn.num_batches_tracked) == 1


@pytest.mark.parametrize("transform", ["grad", "vmap_grad"])
def test_data_of_a_closed_over_parameter_is_a_constant_to_eager_autograd(transform):
    """``p.data`` of a parameter the region closes over (eager, requires grad) is a constant to
    eager autograd, as in plain code: the gradient computed under ``grad`` does not depend on
    ``p`` (plain: ``None``).  The function read ``.data`` of the region's own input standing for
    ``p``, one level up, which still carried eager autograd's history (found by a hostile pass;
    a gradient ``[1.41, 0.15, 0.03]`` for plain's ``None``)."""
    def run(wrap):
        g = torch.Generator().manual_seed(1)
        p, q = (torch.randn(3, dtype=D, generator=g).requires_grad_() for _ in range(2))
        x = torch.randn(3, dtype=D, generator=g)
        r = wrap(lambda x: torch.tanh(x * p.data + q).pow(2).sum())
        gx = grad(r)(x) if transform == "grad" else vmap(grad(r))(torch.stack([x, x.cos()]))
        return gx, torch.autograd.grad(gx.pow(2).sum(), [p, q], allow_unused=True)

    got, want = run(remat), run(ident)
    assert got[1][0] is None and want[1][0] is None
    assert_tree_close((got[0], got[1][1]), (want[0], want[1][1]))


def _data_in_grad_inside(x, w):
    return torch.func.grad(lambda z: (torch.sin(z * w.data) * z).sum())(x) * w


@pytest.mark.parametrize("transform", ["hessian", "jacfwd"])
def test_data_read_in_a_torch_func_transform_the_region_calls(transform):
    """``.data`` inside a ``torch.func.grad`` the region calls: the region is opaque (no replay),
    and where forward mode reaches it, its run again runs under a vjp level of its own, as its
    forward did (a first version of the replay of such regions ran it without: 0.35 for plain's
    0.53 on the Hessian's diagonal)."""
    x = torch.tensor([0.3, -0.7, 1.1], dtype=D)
    w = torch.tensor([0.5, 1.5, -0.2], dtype=D)

    def run(wrap):
        f = lambda w: (wrap(_data_in_grad_inside)(x, w) ** 2).sum()  # noqa: E731
        return hessian(f)(w) if transform == "hessian" else jacfwd(grad(f))(w)

    _close(run(remat), run(ident))


_DATA_OUTSIDE = {
    "hessian": lambda f, w: hessian(f)(w),
    "jacfwd_grad": lambda f, w: jacfwd(grad(f))(w),
    "jvp_grad": lambda f, w: jvp(grad(f), (w,), (torch.ones_like(w),))[1],
    "grad_jvp": lambda f, w: grad(lambda w: jvp(f, (w,), (torch.ones_like(w),))[1])(w),
    "jvp": lambda f, w: jvp(f, (w,), (torch.ones_like(w),))[1],
}


@pytest.mark.parametrize("transform", list(_DATA_OUTSIDE))
@pytest.mark.parametrize("reads", ["argument", "closed_over"])
def test_data_of_an_argument_under_hessian(reads, transform):
    """``w.data`` strips the innermost level only: under hessian the jvp level still sees through
    it, under ``grad(jvp)`` the grad level.  The jvp rule ran the function again under a jvp level
    of its own, which ``.data`` stripped instead (0.089 for plain's 0.133), and under ``grad(jvp)``
    backward differentiated the forward level's graph, where it stripped that level (0.906 off):
    the rule's run again now runs under a vjp level where a grad level was the innermost, and
    where a jvp level was, backward runs the function again under a jvp level of its own."""
    x = torch.tensor([0.3, -0.7, 1.1], dtype=D)
    w = torch.tensor([0.5, 1.5, -0.2], dtype=D)

    def run(wrap):
        if reads == "argument":
            f = lambda w: (wrap(lambda x, w: torch.sin(x * w.data) * w)(x, w) ** 2).sum()  # noqa: E731
        else:
            f = lambda w: wrap(lambda x: x.cos() * w.data + x.cos() * w)(x).pow(2).sum()  # noqa: E731
        return _DATA_OUTSIDE[transform](f, w)

    _close(run(remat), run(ident))


_X, _W = X[:3], torch.tensor([0.5, -0.3, 1.1], dtype=D)
_TWO = two_argument_transforms(X[:3], torch.tensor([0.5, -0.3, 1.1], dtype=D))


def _func_of_closed_over(x, w, wrap, how):
    """A region that hands the weight it closes over (differentiated outside) to a
    ``torch.func`` transform it calls itself."""
    def region(a):
        h = torch.sin(a)
        if how == "grad":
            return torch.func.grad(lambda z: (z * h).sin().sum())(w).sum() * h
        if how == "vjp":
            return torch.func.vjp(lambda z: (z * h).sin().sum(), w)[0] * h
        if how == "grad_reads_it_too":
            return torch.func.grad(lambda z: (z * w * h).sin().sum())(w).sum() * h
        return torch.func.jvp(lambda z: (z * h).sin(), (w,), (torch.ones_like(w),))[1] * h  # jvp

    return wrap(region)(x).pow(2).sum()


@pytest.mark.parametrize("transform", ["eager", "grad", "vjp", "jvp", "vmap_grad", "jacfwd", "hessian", "grad_of_grad"])
@pytest.mark.parametrize("how", ["grad", "vjp", "grad_reads_it_too", "jvp"])
def test_torch_func_inside_a_region_given_a_tensor_it_closes_over(how, transform):
    """``torch.func.grad(g)(w)`` with ``w`` closed over: the transform wraps ``w`` itself, where
    no torch function replaces it by the Function's input, so ``w``'s gradient through it
    was lost (eager 0.50 off, ``vjp`` inside 5.2, ``w`` read inside too 3.7).  The forward now
    runs with the replacements in the closure's places."""
    run = _TWO[transform]
    want = run(lambda x, w: _func_of_closed_over(x, w, ident, how))
    got = run(lambda x, w: _func_of_closed_over(x, w, remat, how))
    _close(got, want)


@pytest.mark.parametrize("how", ["grad", "vjp", "jvp"])
@pytest.mark.parametrize("outer", ["grad_of_grad", "hessian", "grad"])
def test_torch_func_inside_a_region_given_a_constant_made_under_the_transforms(how, outer):
    """A constant made inside the caller's transforms (``w0 * 1``: a wrapper of their levels, which
    the region's forward sets aside) that the region hands to a ``torch.func`` transform it calls:
    functorch's internal assert (``wrapped->level() < level``) under ``grad`` of ``grad`` and
    ``hessian`` until this; it reaches the transform unwrapped, as the forward's ops see it."""
    def loss(x, wrap):
        return _func_of_closed_over(x, _W * 1.0, wrap, how)

    run = {"grad": lambda f: grad(f)(_X), "hessian": lambda f: torch.func.hessian(f)(_X),
           "grad_of_grad": lambda f: grad(lambda y: grad(f)(y).pow(2).sum())(_X)}[outer]
    _close(run(lambda x: loss(x, remat)), run(lambda x: loss(x, ident)))


@pytest.mark.parametrize("uses_h", [False, True], ids=["transform_of_a_constant", "transform_closing_over_h"])
def test_torch_func_inside_a_region_after_a_side_output(uses_h):
    # A region's first call that reaches torch.func after appending to a list: the try that finds
    # torch.func (it refuses the forward's saved-tensor hooks) stops and the function runs again, so
    # the list held the stopped try's tensor first, a constant to the gradient (1.15 off under grad
    # until this, silently).  That is refused now, naming the fix, as eager refuses it; the same
    # function object keeps its graph from its second call on and matches plain code.
    side: list = []

    def region(a):
        h = torch.sin(a)
        side.append(h)
        k = h if uses_h else 2
        return (h * _W + torch.func.grad(lambda z: (z * k).sin().sum())(torch.ones(3, dtype=D))).sum() * h

    def loss(f):
        def run(x):
            side.clear()
            return f(x).pow(2).sum() + side[0].pow(3).sum()
        return grad(run)(_X)  # (the side output depends on x)

    want = loss(region)
    r = remat(region)
    with pytest.raises(RematError, match="try that stopped.*Fix: return it"):
        loss(r)
    _close(loss(r), want)


@pytest.mark.parametrize("transform", ["grad", "grad_of_vmap", "eager"])
def test_vmap_inside_a_region_runs_it_once(transform):
    # A torch.func.vmap's output is made where no torch function sees it: the capture check took it
    # for a tensor from outside, and every call under torch.func ran the function again to find what
    # its ops made.  The region's own tape saw its ops make it: one run, the first call too.
    xb = torch.randn(3, 2, 4, dtype=D, generator=torch.Generator().manual_seed(3))
    w0 = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(4))

    def make(calls):
        def g(xr, v):
            calls.append(1)
            return vmap(lambda x, v: x * v, in_dims=(0, None))(xr, v).sin() + v
        return g

    def run(g):
        if transform == "grad":
            return grad(lambda v: g(xb[0], v).pow(2).sum())(w0)
        if transform == "grad_of_vmap":
            return grad(lambda v: vmap(g, in_dims=(0, None))(xb, v).pow(2).sum())(w0)
        w = w0.clone().requires_grad_()
        vmap(g, in_dims=(0, None))(xb, w).pow(2).sum().backward()
        return w.grad
    calls_plain: list = []
    want = run(make(calls_plain))
    calls: list = []
    rg = remat(make(calls))
    for _ in range(3):
        calls.clear()
        _close(run(rg), want)
        assert len(calls) == len(calls_plain) == 1


@pytest.mark.parametrize("transform", ["grad", "vjp", "vmap_grad"])
def test_vmap_inside_a_region_returning_a_tensor_it_closes_over(transform):
    # Found by a hostile pass: the region hands a tensor it closes over (computed outside from w) to
    # a torch.func.vmap that returns its slices as they are.  The vmap reads the caller's tensor where
    # no torch function replaces it, and its output, a view of that tensor, was taken for one the
    # region made: w's gradient was lost, zeros for plain's [-6.97, 4.85, ...], silently.  An unknown
    # tensor sharing the storage of a tensor the region closes over now makes the forward run again
    # with the replacements in the closure's places (as torch.func.grad(g)(w) does).
    x0 = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(10))
    w0 = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(11))

    def loss(wrap, x, w):
        big = (w.expand(3, 4) * 1).T

        def f(x):
            return x * vmap(lambda xi, wi: wi, in_dims=(0, 1))(x, big)
        return wrap(f)(x).pow(2).sum()

    def run(wrap):
        if transform == "grad":
            return grad(lambda x, w: loss(wrap, x, w), argnums=(0, 1))(x0, w0)
        if transform == "vjp":
            out, fn = vjp(lambda x, w: loss(wrap, x, w), x0, w0)
            return fn(torch.ones_like(out))
        return vmap(lambda s: grad(lambda x, w: loss(wrap, x * s, w), argnums=(0, 1))(x0, w0))(torch.tensor([1.0, -0.5], dtype=D))
    _close(run(remat), run(ident))


_CLOSURE_READ_UNSEEN = {
    # (a closed-over tensor a vmap inside returns unbatched, broadcast by vmap, under eager autograd
    # around an outer vmap: its gradient None for plain's, the replay not seeing vmap's broadcast)
    "vmap_returns_it_unbatched": lambda wrap: _eager_outer_vmap(wrap),
    # (returned as jvp's auxiliary output, under hessian: the run again in backward, the region calling
    # torch.func, reads it as a constant; the first derivative is exact)
    "jvp_aux_under_hessian": lambda wrap: hessian(lambda w: _jvp_aux_loss(wrap, w))(_W4),
}
_X34 = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(12))
_W4 = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(13))


def _eager_outer_vmap(wrap):
    x = _X34.clone().requires_grad_()
    ws = torch.stack([_W4, _W4.cos()]).requires_grad_()
    vmap(lambda w: wrap(lambda x: x * vmap(lambda xi: w)(x))(x).pow(2).sum())(ws).sum().backward()
    return x.grad, ws.grad


def _jvp_aux_loss(wrap, w):
    def f(x):
        o, t, aux = jvp(lambda a: (a.sin(), w), (x,), (torch.ones_like(x),), has_aux=True)
        return o * aux + t
    return wrap(f)(_X34).pow(2).sum()


@pytest.mark.xfail(strict=True, reason="open: a closed-over tensor reached where neither the capture mode nor the tape sees it "
                   "(see docs/design.md, the torch.func-inside row); found by a hostile pass, wrong at 84af571 too")
@pytest.mark.parametrize("case", sorted(_CLOSURE_READ_UNSEEN))
def test_closed_over_tensor_read_unseen_inside_a_region(case):
    run = _CLOSURE_READ_UNSEEN[case]
    want, got = run(ident), run(remat)
    for w, g in zip(*(x if isinstance(x, tuple) else (x,) for x in (want, got))):
        assert g is not None
        _close(g, w)


@pytest.mark.parametrize("order", ["first", "create_graph"])
def test_data_setter_inside_a_region_under_eager_autograd(order):
    """``z.data = ...`` re-points ``z`` at another tensor's storage where no op shows it: the tape
    took ``z`` for the op's output it was and the replay recomputed that (4.70 off first order,
    64.1 with create_graph, silently; found by a hostile pass, at d38d384 too).  A node's output
    read with another storage is now a tensor from outside, read as it is."""
    w0 = torch.randn(5, 5, dtype=D, generator=torch.Generator().manual_seed(21)) / 2
    x = torch.randn(4, 5, dtype=D, generator=torch.Generator().manual_seed(22))

    def f(w):
        h = torch.tanh(x @ w)
        z = h * 2
        z.data = h.data.clone() * 3
        return (z @ w).sin().sum()

    def run(wrap):
        w = w0.clone().requires_grad_()
        (g,) = torch.autograd.grad(wrap(f)(w), w, create_graph=order == "create_graph")
        return torch.autograd.grad(g.sin().sum(), w)[0] if order == "create_graph" else g

    _close(run(remat), run(ident))


def _data_on_a_view(x, w, w2):
    h = torch.tanh(x @ w)
    z = h.view(-1)
    z.data = (h.detach() * 3).reshape(-1).clone()
    return torch.sin(z.view(4, 5) @ w2)


def _grown_through_an_alias(x, w, w2):
    h = torch.tanh(x @ w)
    z = torch.sin(h)
    z.detach().resize_(1000)  # (the storage grows, its data moves: z is the same tensor, same values)
    return torch.sin(z @ w2)


@pytest.mark.parametrize("body", [_data_on_a_view, _grown_through_an_alias], ids=["data_on_a_view", "grown_through_an_alias"])
@pytest.mark.parametrize("how", ["eager", "eager_double", "grad_of_grad"])
def test_region_made_tensor_whose_storage_changes(body, how):
    """A view re-pointed by ``.data =`` is a tensor from outside too (15.9 off before); one whose storage
    grew in place keeps its op (its storage object stays: a first version compared data pointers and
    lost the second-order terms under grad(grad), 0.74 off; found by a hostile pass)."""
    g = torch.Generator().manual_seed(23)
    x, w0, w2 = (torch.randn(*s, dtype=D, generator=g) for s in ((4, 3), (3, 5), (5, 5)))

    def run(wrap):
        f = lambda w: wrap(body)(x, w, w2).sum()  # noqa: E731
        if how == "grad_of_grad":
            return grad(lambda w: grad(f)(w).pow(2).sum())(w0)
        w = w0.clone().requires_grad_()
        (gw,) = torch.autograd.grad(f(w), w, create_graph=how == "eager_double")
        return torch.autograd.grad(gw.sin().sum(), w)[0] if how == "eager_double" else gw

    if body is _data_on_a_view and how == "grad_of_grad":
        pytest.skip("plain code refuses .data writes inside a functorch transform")
    _close(run(remat), run(ident))


@pytest.mark.parametrize("transform", ["hessian", "jvp_grad", "jacfwd_grad"])
def test_data_of_a_closed_over_leaf_requiring_grad_under_forward_over_reverse(transform):
    """``.data`` of a closed-over leaf that requires grad: the forward counted the read as one of its
    calls where the run again did not (a false RecomputeMismatchError under hessian, found by a
    hostile pass, at d38d384 too); both count it now."""
    cp = torch.tensor([0.3, -0.8, 1.2], dtype=D, requires_grad=True)
    w = torch.tensor([0.5, 1.5, -0.2], dtype=D)

    def run(wrap):
        f = lambda w: wrap(lambda w: (cp.data * w).sin().sum() + (cp * w).cos().sum())(w)  # noqa: E731
        return {"hessian": lambda: hessian(f)(w),
                "jvp_grad": lambda: jvp(grad(f), (w,), (torch.ones_like(w),))[1],
                "jacfwd_grad": lambda: jacfwd(grad(f))(w)}[transform]()

    _close(run(remat), run(ident))


# -- a hook under a vmap, .data of a tensor the innermost level does not wrap (hostile passes) ----
def _hooked(calls):
    def inner(x, w):
        k = x.sin() * w
        if k.requires_grad:
            k.register_hook(lambda g: (calls.append(1), g * 3)[1])
        return k
    return inner


_W3 = torch.tensor([1.5, 0.4, -0.8], dtype=D)
_X3 = torch.tensor([0.3, -1.2, 0.7], dtype=D)
_UNDER_VMAP = {
    "eager_around_vmap": lambda f: (lambda x, w: torch.autograd.grad(
        vmap(lambda xx: f(xx, w))(torch.stack([x, 2 * x])).sum(0).pow(2).sum(), (x, w)))(
        _X3.clone().requires_grad_(), _W3.clone().requires_grad_()),
    "grad_of_vmap": lambda f: grad(lambda x: vmap(lambda xx: f(xx, _W3))(torch.stack([x, 2 * x])).pow(2).sum())(_X3),
    "jacrev_of_vmap": lambda f: torch.func.jacrev(lambda x: vmap(lambda xx: f(xx, _W3))(torch.stack([x, 2 * x])).pow(2).sum(1))(_X3),
}


@pytest.mark.parametrize("nested", [False, True], ids=["alone", "nested"])
@pytest.mark.parametrize("transform", list(_UNDER_VMAP))
def test_a_hook_inside_a_region_under_a_vmap_never_fires(transform, nested):
    """Plain code's hook on a tensor a vmap innermost at the call batches never fires; the region's run
    again registered it under a vjp level of its own, where it did: 3x plain's gradient (at 2f9f171
    too; nested in a region, since the enclosing one runs again when the nested one hooks)."""
    results = []
    for wrap in (ident, remat):
        calls: list = []
        f = wrap(_hooked(calls))
        g = wrap(lambda x, w: f(x * 1.0, w)) if nested and wrap is remat else f
        results.append((_UNDER_VMAP[transform](g), len(calls)))
    _close(results[1][0], results[0][0])
    assert results[1][1] == results[0][1] == 0


def test_data_of_a_closed_over_tensor_under_eager_autograd_around_vjp():
    """``w.data`` strips the eager autograd ``w`` carries (vjp does not wrap it): the run again at the
    eager level wrapped every input in a level of its own, ``w`` too, which ``.data`` stripped
    instead (0.3 to 2.9 off, a regression of this session found by a hostile pass)."""
    f = lambda x, w: (x * w.data).sin().sum() + (x * w).pow(2).sum()
    results = []
    for wrap in (ident, remat):
        x, w = _X3.clone().requires_grad_(), _W3.clone().requires_grad_()
        o, fn = vjp(lambda y: wrap(f)(y, w), x)
        results.append(torch.autograd.grad(fn(o)[0].pow(2).sum(), (x, w)))
    _close(results[1], results[0])


def test_a_hook_inside_the_functions_own_grad_under_a_vmap():
    """The innermost transform at the hook is the function's own ``grad``, not the vmap the region is
    called under: the hook fires as in plain code (it was dropped, 8 to 250 off, a regression of this
    session found by a hostile pass)."""
    X = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(3))

    def g(x):
        def loss(z):
            v = z.sin() * 2
            v.register_hook(lambda gr: gr * 3)
            return (v ** 2).sum()
        return grad(loss)(x)

    _close(vmap(remat(g))(X), vmap(g)(X))
    _close(grad(lambda x: vmap(remat(g))(x).pow(2).sum())(X), grad(lambda x: vmap(g)(x).pow(2).sum())(X))


def test_a_hook_in_a_region_nested_under_the_enclosing_functions_own_grad_fires_once():
    """The nested region's hook acts inside the enclosing function's own ``grad``, whose backward the
    enclosing region's recorded ops hold: it replays, and the hook fires once, as in plain code (the
    enclosing region ran again, firing it twice; a hostile pass)."""
    X = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(3))

    def run(wrap):
        fired: list = []

        def inner(z):
            v = z.sin() * 2
            if v.requires_grad:
                v.register_hook(lambda g: (fired.append(1), g * 3)[1])
            return (v ** 2).sum()
        outer = wrap(lambda x: grad(wrap(inner))(x))
        x = X.clone().requires_grad_()
        out = vmap(outer)(x)
        return out, torch.autograd.grad(out.pow(2).sum(), x)[0], len(fired)

    (o1, g1, n1), (o2, g2, n2) = run(ident), run(remat)
    _close((o2, g2), (o1, g1))
    assert n2 == n1 == 1


_XB2 = torch.tensor([[.3, -.7, 1.1], [.5, .2, -.4]], dtype=D)


def _hook_on_unbatched(kind):
    def run(wrap):
        W = torch.tensor([.9, 1.2, -.5], dtype=D, requires_grad=True)
        if kind == "grad_level_intermediate":
            def outer(x):
                h = x.sin()

                def g(y):
                    k = h * 2
                    k.register_hook(lambda gr: gr * 3)
                    return (y * k).sum()
                return vmap(wrap(g))(_XB2).sum()
            return grad(outer)(_X3)
        if kind == "closed_over_leaf":
            def g(y):
                W.register_hook(lambda gr: gr * 3)
                return (y.sin() * W).sum()
        else:  # an intermediate of the closed-over leaf
            def g(y):
                h = W * 2
                h.register_hook(lambda gr: gr * 3)
                return (y.sin() * h).sum()
        vmap(wrap(g))(_XB2).sum().backward()
        return W.grad
    return run


@pytest.mark.parametrize("kind", ["grad_level_intermediate", "closed_over_leaf", "closed_over_intermediate"])
def test_a_hook_on_a_tensor_a_vmap_does_not_batch_fires_inside_a_region_under_it(kind):
    """Plain code's hook on a tensor the vmap does not batch (a closed-over leaf, a grad level's intermediate)
    fires; this session's first rule dropped every hook under a vmap innermost at the call (3x off, a
    regression found by a hostile pass): only a tensor plain code holds batched (``batched_first``) skips it."""
    run = _hook_on_unbatched(kind)
    _close(run(remat), run(ident))


_W3 = torch.tensor([.9, 1.2, -.5], dtype=D)
_BY_GRAD_INSIDE = {  # (the function's own transform over the nested region ``gi``, its cotangent depending on the input)
    "grad": lambda gi: lambda y: grad(lambda z: (gi(z) * z).sum())(y),
    "vjp": lambda gi: lambda y: (lambda o: o[1](y.cos())[0] * o[0])(vjp(gi, y)),
    "jacrev": lambda gi: lambda y: torch.func.jacrev(lambda z: gi(z) * z.exp())(y).sum(0),
    "grad_of_grad": lambda gi: lambda y: grad(lambda z: grad(lambda u: (gi(u) * u).sum())(z).pow(2).sum())(y),
    "jvp": lambda gi: lambda y: jvp(gi, (y,), (y.cos(),))[1] * y,
    "vmap_grad": lambda gi: lambda y: vmap(grad(lambda z: (gi(z) * z).sum()))(torch.stack([y, 2 * y])).sum(0),
}
_AROUND = {
    "eager": lambda L: (lambda x: torch.autograd.grad(L(x), x)[0])(_X3.clone().requires_grad_()),
    "create_graph": lambda L: (lambda x: torch.autograd.grad(torch.autograd.grad(L(x), x, create_graph=True)[0].pow(2).sum(), x)[0])(
        _X3.clone().requires_grad_()),
    "grad": lambda L: grad(L)(_X3),
    "vjp": lambda L: vjp(L, _X3)[1](torch.tensor(1., dtype=D))[0],
    "hessian": lambda L: hessian(L)(_X3),
    "jacfwd_of_grad": lambda L: jacfwd(grad(L))(_X3),
    "vmap_grad": lambda L: vmap(grad(L))(torch.stack([_X3, 2 * _X3])),
}


@pytest.mark.parametrize("around", list(_AROUND))
@pytest.mark.parametrize("inside", list(_BY_GRAD_INSIDE))
def test_a_region_calling_grad_over_another_region(inside, around):
    """The nested region's Function returned a detached alias of its output, which the enclosing region's tape
    recorded as a ``detach``: its replay computed the forward's value and cut the gradient through the nested
    region's output (0.18 to 58.6 off under every composition, eager too, silently, until this; a hostile pass).
    The alias is bookkeeping now, read by the enclosing tape as the output itself (``detached_alias``)."""
    results = []
    for outer, inner in ((ident, ident), (remat, remat), (remat, ident), (ident, remat)):
        gi = inner(lambda y: y.sin() * _W3)
        fr = outer(_BY_GRAD_INSIDE[inside](gi))
        results.append(_AROUND[around](lambda x: (fr(x) * x.sin()).sum()))
    for r in results[1:]:
        _close(r, results[0])


_AROUND["grad_vmap_grad"] = lambda L: grad(lambda x: vmap(grad(L))(torch.stack([x, 2 * x])).pow(2).sum())(_X3)


@pytest.mark.parametrize("around", ["eager", "grad", "hessian", "vmap_grad", "grad_vmap_grad"])
@pytest.mark.parametrize("read_after", [False, True])
def test_a_side_output_of_the_functions_own_grad_inside_a_region(around, read_after):
    """An intermediate the function keeps in a list under a ``torch.func.grad`` of its own and reads in it: after the
    region the list holds a wrapper of that exited transform, which functorch's internal assert refused where remat
    returned it as a side output ("result->level().has_value()", at 3915fbd too), and under eager autograd it holds the
    output remat would swap into it. It is returned as functorch reads it (``unwrap_if_dead``), the caller's object
    taking the content of an alias; so where backward runs the function again (``grad(vmap(grad))``, a hostile pass)."""
    side: list = []
    results = []
    for outer, inner in ((ident, ident), (remat, remat), (remat, ident), (ident, remat)):
        side.clear()
        gi = inner(lambda y: (side.append(y.cos() * _W3), y.sin() * _W3)[1])
        fr = outer(lambda y: grad(lambda z: (gi(z) * z).sum() + (side[-1] * z * z).sum())(y))
        results.append(_AROUND[around](lambda x: (fr(x) * x.sin()).sum() + ((side[-1] * x).sum() if read_after else 0)))
    for r in results[1:]:
        _close(r, results[0])


class _Box:
    pass


@pytest.mark.parametrize("around", ["eager", "grad", "vmap_grad"])
@pytest.mark.parametrize("where", ["attribute", "dict"])
def test_a_side_output_assigned_where_the_last_call_left_one(where, around):
    """``box.h = h`` under the function's own ``grad``, read after the region, on the second call (a training loop's
    second step): ``box.h`` held the first call's tensor, which the region closes over; the closure's places were put
    back after the forward, over what the function assigned, so the loss read the old tensor, a constant: 1.25 to 10.2
    off, silently (a hostile pass; a crash before this session's first fix). A place the function assigned keeps it."""
    results = []
    for wrap in (ident, remat):
        box, d = _Box(), {}

        def put(t, box=box, d=d):
            if where == "attribute":
                box.h = t
            else:
                d["h"] = t

        def get(box=box, d=d):
            return box.h if where == "attribute" else d["h"]

        def f(y, put=put):
            def inner(z):
                h = z.sin() * _W3
                put(h * 2)
                return (h * z).sum()
            return grad(inner)(y)

        fr = wrap(f)
        loss = lambda x, fr=fr, get=get: (fr(x) * x.sin()).sum() + (get() * x * x).sum()  # noqa: E731
        results.append([_AROUND[around](loss) for _ in range(2)])
    for r, p in zip(results[1], results[0]):
        _close(r, p)


_M3 = torch.tensor([[1., .2, -.3], [.5, .7, .1], [-.4, .3, .9]], dtype=D)


@pytest.mark.parametrize("around", ["eager", "grad", "vmap_grad"])
@pytest.mark.parametrize("levels", ["one", "two", "outer_only", "inner_only"])
def test_autograd_grad_with_create_graph_over_a_region_inside_a_transform(levels, around):
    """``torch.autograd.grad(..., create_graph=True)`` the user calls inside ``torch.func.grad`` over a region: the
    region's backward took the transform's own final backward for it (nothing outside differentiating it) and ran
    without a graph: ``cos(x)`` for ``cos(x) - x sin(x)``, 0.17 to 3.23 off, silently (a hostile pass). Who called
    ``torch.autograd.grad`` tells them apart (``outside_reach``)."""
    results = []
    for wrap in (ident, remat):
        inner_wrap = ident if levels == "outer_only" else wrap
        outer_wrap = ident if levels == "inner_only" else wrap
        hi = inner_wrap(lambda y: (_M3 @ y).sin() * _W3)
        gi = hi if levels == "one" else outer_wrap(lambda y, hi=hi: grad(lambda z: (hi(z) * z).sum())(y) * y)
        f = lambda y, gi=gi: torch.autograd.grad((gi(y) * y).sum(), y, create_graph=True)[0]  # noqa: E731
        results.append(_AROUND[around](lambda x, f=f: (f(x) * x.sin()).sum()))
    _close(results[1], results[0])


_HOOK_AROUND = {**_AROUND, "eager_non_leaf": lambda L: (lambda x0: torch.autograd.grad(L(x0 * 1), x0)[0])(_X3.clone().requires_grad_()),
                "jacrev": lambda L: torch.func.jacrev(L)(_X3),
                "grad_of_grad": lambda L: grad(lambda x: grad(L)(x).pow(2).sum())(_X3),
                "grad_vmap": lambda L: grad(lambda x: vmap(L)(torch.stack([x, 2 * x])).sum())(_X3)}


def _triple(g):
    return g * 3


def _hook_on_given(kind, wrap, calls):
    """A region registering a hook on what it is given (or closes over), the caller using that tensor outside too."""
    if kind == "argument":
        def f(x):
            calls.append(1)
            if x.requires_grad:
                x.register_hook(_triple)
            return x.sin() * 2
        return wrap(f)
    if kind == "argument_removed":
        def f(x):
            if x.requires_grad:
                x.register_hook(_triple).remove()
            return x.sin() * 2
        return wrap(f)
    if kind == "argument_of_a_nested_region":
        g = wrap(lambda y: (y.register_hook(_triple) if y.requires_grad else None, y.sin() * 2)[1])
        return wrap(lambda x: g(x).cos() * x)
    if kind == "intermediate_given_to_a_nested_region":
        g = wrap(lambda y: (y.register_hook(_triple) if y.requires_grad else None, y.sin() * 2)[1])
        return wrap(lambda x: g(x * 1.5) + g(x))
    if kind == "argument_of_a_region_calling_grad":
        def f(x):
            if x.requires_grad:
                x.register_hook(_triple)
            return grad(lambda z: (z.sin() * x).sum())(x) * x
        return wrap(f)
    raise AssertionError(kind)


@pytest.mark.parametrize("around", list(_HOOK_AROUND))
@pytest.mark.parametrize("kind", ["argument", "argument_removed", "argument_of_a_nested_region", "intermediate_given_to_a_nested_region",
                                  "argument_of_a_region_calling_grad"])
def test_a_hook_on_an_argument_the_caller_also_uses(kind, around):
    """Plain code's hook on an argument sees its whole gradient; the region's went on the Function's input standing for
    it and saw the region's share: 4.1 off under ``grad``, 26 under ``vmap(grad)``, 148 under ``grad`` of ``grad``, up to
    1.6e3 through nested regions, silently (a hostile pass of the last session); a region calling ``torch.func`` had
    its eager try's hook left on the argument, twice plain's. It goes on the caller's tensor (``remat_fn._hook_targets``), and
    the function runs as often as plain code's."""
    results, counts = [], []
    for wrap in (ident, remat):
        calls: list = []
        g = _hook_on_given(kind, wrap, calls)
        results.append(_HOOK_AROUND[around](lambda x, g=g: (g(x) * x.cos()).sum() + (x ** 3).sum()))
        counts.append(len(calls))
    _close(results[1], results[0])
    assert counts[1] == counts[0]


@pytest.mark.parametrize("around", ["grad", "vmap_grad", "hessian"])
def test_a_hook_on_a_closed_over_tensor_the_caller_also_uses(around):
    results = []
    for wrap in (ident, remat):
        def loss(x, wrap=wrap):
            w = x * 2  # (an intermediate of the caller, which the region closes over)
            f = wrap(lambda y: (w.register_hook(_triple) if w.requires_grad else None, y.sin() * w)[1])
            return (f(x) * w.cos()).sum()
        results.append(_AROUND[around](loss))
    _close(results[1], results[0])


_W3b = torch.tensor([.5, -1.5, 2.], dtype=D)
_MIXED = {  # (the argument ``w`` is wrapped by the outer level only: the inner ``grad`` differentiates ``x``)
    "data_of_w": lambda x, w: x.sin() * w.data + w * x.cos(),
    "data_of_x": lambda x, w: x.data.sin() * w + w * x.cos(),
    "detach_in_place_of_w_times_one": lambda x, w: (lambda h: (h.detach_(), h * x.sin() + w * x)[1])(w * 1),
    "detach_in_place_of_w_squared": lambda x, w: (lambda h: (h.detach_(), h * x.sin())[1])(w * w),
}


def _mixed_loss(g, x, w):
    return (g(x, w) * x.cos()).pow(2).sum() + (w * x).sum()


_MIXED_AROUND = {
    "grad_w_grad_x": lambda g: grad(lambda w: grad(lambda x: _mixed_loss(g, x, w))(_X3).pow(2).sum())(_W3b),
    "grad_x_grad_w": lambda g: grad(lambda x: grad(lambda w: _mixed_loss(g, x, w))(_W3b).pow(2).sum())(_X3),
    "eager_w_grad_x": lambda g: (lambda w: torch.autograd.grad(grad(lambda x: _mixed_loss(g, x, w))(_X3).pow(2).sum(), w)[0])(
        _W3b.clone().requires_grad_()),
    "jvp_w_grad_x": lambda g: jvp(lambda w: grad(lambda x: _mixed_loss(g, x, w))(_X3), (_W3b,), (_W3b.cos(),))[1],
    "grad_w_jvp_x": lambda g: grad(lambda w: jvp(lambda x: _mixed_loss(g, x, w), (_X3,), (_X3.cos(),))[1])(_W3b),
    "jacrev_w_grad_x": lambda g: torch.func.jacrev(lambda w: grad(lambda x: _mixed_loss(g, x, w))(_X3))(_W3b),
}


_JVP_INNERMOST_OPEN = pytest.mark.xfail(strict=True, reason="open, silent (at 3915fbd too): the jvp rule's run again under an inner "
                                        "jvp level, where functorch hands the saved argument back wrapped at that level without a "
                                        "tangent: kept, .data strips it instead of plain code's outer wrapper; stripped, detach_ "
                                        "of w * w acts at the outer level, which plain code's leaves alone")


@pytest.mark.parametrize("case,around", [
    pytest.param(c, a, marks=_JVP_INNERMOST_OPEN) if a == "grad_w_jvp_x" and c in ("data_of_w", "detach_in_place_of_w_squared") else (c, a)
    for c in _MIXED for a in _MIXED_AROUND])
def test_data_or_detach_in_place_of_a_tensor_the_inner_level_does_not_wrap(case, around):
    """``w.data`` strips ``w``'s own innermost wrapper (here the outer level's), ``h.detach_()`` acts at the innermost
    level, a no-op on ``h = w * 1`` that level does not wrap. functorch hands the Function's saved ``w`` back wrapped at
    the inner level too (``as_given`` strips that), and the outer level's run again had no inner level where the inner
    one wrapped none of what it differentiates (``_inside`` makes it all the same): 1.0 to 4.8 off for ``.data``, 1.9 to
    56 for ``detach_``, silently (this session)."""
    f = _MIXED[case]
    _close(_MIXED_AROUND[around](remat(f)), _MIXED_AROUND[around](f))


_XW, _WW = torch.tensor([[0.3, -1.2, 2.0, 0.7], [1.1, 0.4, -0.6, 0.2], [-0.9, 0.8, 0.5, -1.4]], dtype=D), \
    torch.tensor([[0.5, -1.5], [2.0, 0.3], [-0.7, 1.2], [0.9, -0.4]], dtype=D)
_PASSED = {  # (``w`` an argument of the inner transform, which differentiates ``X`` only: functorch wraps it there too)
    "data": lambda X, w: (X @ w.data).sin() * w.sum(),
    "detach_in_place": lambda X, w: (X @ (w * 1.0).detach_()).sin() * w.sum(),
    "data_times_w": lambda X, w: (X.sin() @ (w.data * w)).cos() * (w ** 2).sum(),
}
_PASSED_AROUND = {
    "grad_w_jacrev_x": lambda f: grad(lambda w: torch.func.jacrev(f)(_XW, w).pow(2).sum())(_WW),
    "grad_w_grad_x": lambda f: grad(lambda w: grad(lambda X, w: f(X, w).pow(2).sum())(_XW, w).pow(2).sum())(_WW),
    "jacrev_w_jacrev_x": lambda f: torch.func.jacrev(lambda w: torch.func.jacrev(f)(_XW, w).sum((0, 1)))(_WW),
    "grad_w_vmap_grad_x": lambda f: grad(lambda w: vmap(lambda x, w: grad(lambda x, w: f(x[None], w).pow(2).sum())(x, w),
                                                        in_dims=(0, None))(_XW, w).pow(2).sum())(_WW),
    "grad_w_jacfwd_x": lambda f: grad(lambda w: jacfwd(f)(_XW, w).pow(2).sum())(_WW),
    "jacfwd_w_jacrev_x": lambda f: jacfwd(lambda w: torch.func.jacrev(f)(_XW, w).sum((0, 1)))(_WW),
    "grad_w_grad_v_jacrev_x": lambda f: grad(lambda w: grad(lambda v, w: torch.func.jacrev(f)(_XW * v, w).pow(2).sum())(
        torch.tensor(1.3, dtype=D), w).pow(2))(_WW),
    "eager_w_jacrev_x": lambda f: (lambda w: torch.autograd.grad(torch.func.jacrev(f)(_XW, w).pow(2).sum(), w)[0])(
        _WW.clone().requires_grad_()),
}
def _nested_passing(body, wrap):
    inner = wrap(body)
    return wrap(lambda X, w: inner(X * 1.1, w).tanh() * w.mean())


@pytest.mark.parametrize("nested", [False, True], ids=["one_region", "nested"])
@pytest.mark.parametrize("around", list(_PASSED_AROUND))
@pytest.mark.parametrize("case", list(_PASSED))
def test_data_of_an_argument_a_transform_wraps_without_differentiating_it(case, around, nested):
    """``jacrev(f)(X, w)`` and ``grad(f)(X, w)`` wrap ``w`` at their level too, without a gradient: plain code's ``w.data``
    strips that wrapper, and the levels outside differentiate through it. ``jacrev``'s ``vjp_fn`` runs after its level
    exited, where the run again of a region reading ``.data`` saw ``w`` without that wrapper and stripped the outer
    level's: 2.2 to 8.5e3 off, eager autograd around ``jacrev`` too; and a region nested in one that runs again saw
    ``w`` wrapped below that run's own level, not at the innermost: 9.8 off under ``grad`` around ``grad(f)(X, w)``,
    silently (at 71e1192). ``w`` is wrapped at the run again's own level now (``rewrapped``)."""
    f = _PASSED[case]
    build = _nested_passing if nested else (lambda body, wrap: wrap(body))
    _close(_PASSED_AROUND[around](build(f, remat)), _PASSED_AROUND[around](build(f, ident)))


def _grad_of_x_inside(x, w):
    (g,) = torch.autograd.grad((x.sin() * w).sum(), x, create_graph=True)
    return g * w + x.cos()


def _grad_of_w_inside(x, w):
    (g,) = torch.autograd.grad((x.sin() * w * w).sum(), w, create_graph=True)
    return g * x + w.cos()


def _grad_of_both_inside(x, w):
    a, b = torch.autograd.grad((x.sin() * w.exp()).sum(), (x, w), create_graph=True)
    return a * b + x * w


_INSIDE = {"x": _grad_of_x_inside, "w": _grad_of_w_inside, "both": _grad_of_both_inside}
_X3w = torch.tensor([0.3, -1.2, 2.0], dtype=D)


def _in_loss(f, x, w):
    return (f(x, w) * x.cos()).sum()


def _leaf(t):
    return t.clone().requires_grad_()


_INSIDE_AROUND = {
    "grad_x": lambda f: grad(lambda x: _in_loss(f, x, _W3b))(_X3w),
    "grad_xw": lambda f: grad(lambda x, w: _in_loss(f, x, w), argnums=(0, 1))(_X3w, _W3b),
    "grad_w_grad_x": lambda f: grad(lambda w: grad(lambda x: _in_loss(f, x, w))(_X3w).pow(2).sum())(_W3b),
    "grad_w_grad_x_passing_w": lambda f: grad(lambda w: grad(lambda x, w: _in_loss(f, x, w))(_X3w, w).pow(2).sum())(_W3b),
    "grad_x_grad_w": lambda f: grad(lambda x: grad(lambda w: _in_loss(f, x, w))(_W3b).pow(2).sum())(_X3w),
    "jvp_w_grad_x": lambda f: jvp(lambda w: grad(lambda x: _in_loss(f, x, w))(_X3w), (_W3b,), (_W3b.cos(),))[1],
    "jvp_x_grad_w": lambda f: jvp(lambda x: grad(lambda w: _in_loss(f, x, w))(_W3b), (_X3w,), (_X3w.cos(),))[1],
    "maml_grad_w_vmap_grad_x": lambda f: grad(lambda w: vmap(lambda x: grad(lambda x: _in_loss(f, x, w))(x))(
        torch.stack([_X3w, 2 * _X3w])).pow(2).sum())(_W3b),
    "hessian_w_passing_x": lambda f: hessian(lambda x, w: _in_loss(f, x, w), argnums=1)(_X3w, _W3b),
    "jacrev_w_grad_x_passing_w": lambda f: torch.func.jacrev(lambda w: grad(lambda x, w: _in_loss(f, x, w))(_X3w, w))(_W3b),
    "eager_double": lambda f: (lambda x, w: torch.autograd.grad(sum(g.pow(2).sum() for g in torch.autograd.grad(
        _in_loss(f, x, w), (x, w), create_graph=True)), (x, w)))(_leaf(_X3w), _leaf(_W3b)),
    "eager_w_grad_x": lambda f: (lambda w: torch.autograd.grad(grad(lambda x: _in_loss(f, x, w))(_X3w).pow(2).sum(), w))(
        _leaf(_W3b)),
}


@pytest.mark.parametrize("around", list(_INSIDE_AROUND))
@pytest.mark.parametrize("wrt", list(_INSIDE))
def test_autograd_inside_of_an_input_only_an_inner_level_differentiates(wrt, around):
    """``torch.autograd.grad(y, x)`` inside the region, under a transform over ``w`` around one over ``x`` (MAML's
    ``grad(vmap(grad))``, ``jvp`` of ``grad``, eager autograd around ``grad``): the run again at the outer level, or the
    jvp rule's, differentiated ``w`` alone, and ``x`` did not require grad there: "One of the differentiated Tensors
    does not require grad" (at 71e1192; plain code runs). An input the call's innermost level differentiated requires
    grad at the run again's own level now (``differentiable_at_top``)."""
    _as_plain(_INSIDE_AROUND[around], _INSIDE[wrt], remat(_INSIDE[wrt]))


def _as_plain(around, body, f):
    """``around(f)`` gives plain code's results, or raises where plain code raises (the input differentiated
    inside needs no gradient there: "does not require grad", "appears to not have been used")."""
    try:
        expected = around(body)
    except RuntimeError as e:
        with pytest.raises(RuntimeError, match=str(e).split(".")[0][:40]):
            around(f)
        return
    _close(around(f), expected)


def test_autograd_inside_in_every_order():
    """One function object through every composition above, in two orders: a failure under one of them marked the
    function as calling ``torch.func`` (its later calls keep the graph from the start), under which ``grad`` over ``w``
    around ``grad`` over ``x`` then failed where a fresh function ran (at 71e1192)."""
    for body in _INSIDE.values():
        for order in (list(_INSIDE_AROUND), list(reversed(_INSIDE_AROUND))):
            f = remat(body)
            for around in order:
                _as_plain(_INSIDE_AROUND[around], body, f)


def _count_hook(counts, key="hook"):
    def hook(g):
        counts[key] = counts.get(key, 0) + 1
        return g * 3
    return hook


@pytest.mark.parametrize("around", ["jvp", "jacfwd", "grad_vmap"])
@pytest.mark.parametrize("on", ["argument", "closed_over"])
def test_a_hook_where_plain_code_sees_no_gradient(on, around):
    """Under forward mode (plain code's argument reports ``requires_grad=False``, remat's forward level's True) and on a
    tensor a ``vmap`` batches, the hook the function registers when ``requires_grad`` says so goes nowhere: the caller's
    tensor needs no gradient (a RuntimeError "cannot register a hook on a tensor that doesn't require gradient" from this
    session's first redirect, a hostile pass)."""
    arounds = {"jvp": lambda L: jvp(L, (_X3,), (_X3.cos(),))[1], "jacfwd": lambda L: jacfwd(L)(_X3),
               "grad_vmap": lambda L: grad(lambda x: vmap(L)(torch.stack([x, 2 * x])).sum())(_X3)}
    results = []
    for wrap in (ident, remat):
        counts: dict = {}

        def loss(x, wrap=wrap, counts=counts):
            w = x * 2
            t = x if on == "argument" else w

            def f(a):
                if t is x:
                    t2 = a
                else:
                    t2 = w
                if t2.requires_grad:
                    t2.register_hook(_count_hook(counts))
                return a.sin() * w
            return (wrap(f)(x) * x).sum()
        results.append((arounds[around](loss), counts))
    _close(results[1][0], results[0][0])
    assert results[1][1] == results[0][1]


@pytest.mark.parametrize("kind", ["hook", "post_accumulate_grad_hook"])
@pytest.mark.parametrize("on", ["argument", "closed_over_parameter"])
def test_hooks_of_a_region_calling_torch_func_under_eager_autograd(on, kind):
    """The first call's eager try stops at the function's ``torch.func`` call: the hooks it registered on the arguments
    and on what the function closes over were left there and fired twice (P.grad 2.39 off); from the second call a hook
    on a closed-over parameter, reached through the closure's replacement, saw the region's share (1.1 off), and a
    post-accumulate-grad hook never fired (hostile passes). Each fires once, as plain code's."""
    results = []
    for wrap in (ident, remat):
        P = torch.nn.Parameter(_W3b.clone())
        counts: dict = {}

        def f(a, P=P, counts=counts):
            t = a if on == "argument" else P
            if kind == "hook":
                t.register_hook(_count_hook(counts))
            elif t.is_leaf:
                t.register_post_accumulate_grad_hook(lambda p, counts=counts: counts.__setitem__("post", counts.get("post", 0) + 1))
            return grad(lambda z: (z.sin() * P).sum())(a) * a * P

        g = wrap(f)
        steps = []
        for _ in range(2):
            x = _X3.clone().requires_grad_()
            (g(x) * x.cos()).sum().backward()
            steps.append((x.grad, P.grad.clone()))
        results.append((steps, counts))
    for (xr, pr), (xp, pp) in zip(results[1][0], results[0][0]):
        _close(xr, xp)
        _close(pr, pp)
    assert results[1][1] == results[0][1]


@pytest.mark.parametrize("on", ["argument", "closed_over"])
def test_a_hook_with_debug_true_under_eager_autograd(on):
    """``debug=True`` runs the function again in backward (the strict checks): on the hooks path that run registered
    the hook on the argument or the closed-over tensor a second time, which fired too: 3.7 off (2.5e8 under
    ``create_graph``), silently, at 3915fbd too (a hostile pass). The run's hooks are dropped."""
    results = []
    for wrap in (ident, lambda f: remat(f, debug=True)):
        counts: dict = {}
        x = _X3.clone().requires_grad_()
        w = x * 2

        def f(a, w=w, counts=counts):
            (a if on == "argument" else w).register_hook(_count_hook(counts))
            return a.sin() * w

        (wrap(f)(x) * x.cos()).sum().backward()
        results.append((x.grad, counts))
    _close(results[1][0], results[0][0])
    assert results[1][1] == results[0][1]


@pytest.mark.parametrize("calls_torch_func", [False, True])
@pytest.mark.parametrize("on", ["argument", "closed_over"])
def test_a_hook_on_a_parameter_no_op_reads(on, calls_torch_func):
    """Plain code's hook on a parameter nothing reads never runs and ``.grad`` stays None. Where the function calls
    ``torch.func`` (its region a Function taking the parameter as an input), the hook ran with a zero gradient (at
    3915fbd), then, once the redirect put it on the caller's tensor and the input got no gradient, with None (a
    TypeError in the user's hook, a hostile pass): it runs on a gradient only."""
    results = []
    for wrap in (ident, remat):
        P = torch.nn.Parameter(_W3b.clone())
        Q = torch.nn.Parameter(_W3b.clone() + 1)
        fired: list = []

        def f(x, q, P=P, Q=Q, fired=fired):
            (Q if on == "closed_over" else q).register_hook(lambda g: (fired.append(1), g * 3)[1])
            if calls_torch_func:
                return grad(lambda a: (a.sin() * P).sum())(x) * x
            return x.sin() * P

        x = _X3.clone().requires_grad_()
        wrap(f)(x, Q).pow(2).sum().backward()
        results.append((x.grad, P.grad, Q.grad, len(fired)))
    _close(results[1][:2], results[0][:2])
    assert results[1][2] is None and results[0][2] is None
    assert results[1][3] == results[0][3] == 0



class _HooksOnce(torch.nn.Module):
    """A module registering its parameter's hooks on its first call only (behind a flag), calling ``torch.func``."""

    def __init__(self, every_call: bool):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 3, dtype=D, generator=torch.Generator().manual_seed(1)))
        self.every_call, self.handle, self.post_calls = every_call, None, 0

    def forward(self, x):
        if self.handle is None or self.every_call:
            self.handle = self.w.register_hook(lambda g: g.clamp(-0.05, 0.05))
            self.w.register_post_accumulate_grad_hook(lambda p: setattr(self, "post_calls", self.post_calls + 1))
        e = lambda p: torch.tanh(p @ self.w).pow(2).sum()  # noqa: E731
        return e(x) + grad(e)(x).pow(2).sum()


@pytest.mark.parametrize("every_call", [False, True], ids=["once", "every_call"])
def test_hooks_a_module_calling_torch_func_registers_on_its_parameter(every_call):
    """The first call's eager try stops at the ``torch.func`` call, then the region runs on the ``torch.func`` path: the
    hooks the try registered were left (fired twice when the forward registered them again: 1.65 off), then dropped
    (lost for a module registering them once, behind a flag: 15.2 off, a hostile pass). The forward claims them
    (``claiming``): each hook is on the parameter as often as plain code puts it there."""
    results = []
    for wrap in (ident, remat):
        m = _HooksOnce(every_call)
        x = torch.randn(4, 3, dtype=D, generator=torch.Generator().manual_seed(0), requires_grad=True)
        f = wrap(m)
        for _ in range(2):
            f(x).backward()
        results.append((m.w.grad, x.grad, m.post_calls, len(m.w._backward_hooks or {})))
    _close(results[1][:2], results[0][:2])
    assert results[1][2:] == results[0][2:]


@pytest.mark.parametrize("how", ["passed_twice", "passed_and_closed_over"])
def test_hooks_before_and_after_the_functions_torch_func_call(how):
    """Two hooks on one parameter, one registered before the function's ``torch.func`` call and one after, whose
    closure reads a value the function sets after that call: the first call's eager try stops at the call, and the
    ``torch.func`` forward claims the try's hooks (see the test above). Claimed as the try left them, the closure saw the
    try's value (5.4x off), and the tensor listed twice let the second hook claim the first's place (never fired, 1.0
    off; hostile passes). Each claim takes a place once, with this run's function."""
    results = []
    for wrap in (ident, remat):
        W = torch.nn.Parameter(torch.randn(3, 3, dtype=D, generator=torch.Generator().manual_seed(1)))
        fired: list = []

        def body(a, b, x, fired=fired):
            scale = torch.ones((), dtype=D)
            a.register_hook(lambda g: (fired.append("a"), g * scale)[1])
            e = lambda p: torch.tanh(p @ a).pow(2).sum()  # noqa: E731
            gx = grad(e)(x)
            scale = gx.abs().sum()
            b.register_hook(lambda g: (fired.append("b"), g + 1)[1])
            return e(x) + gx.pow(2).sum()

        f = (lambda x, a, b: body(a, b, x)) if how == "passed_twice" else (lambda x, a, W=W: body(a, W, x))
        x = torch.randn(4, 3, dtype=D, generator=torch.Generator().manual_seed(0), requires_grad=True)
        g = wrap(f)
        for _ in range(2):
            (g(x, W, W) if how == "passed_twice" else g(x, W)).backward()
        results.append((W.grad, x.grad, sorted(fired)))
    _close(results[1][:2], results[0][:2])
    assert results[1][2] == results[0][2]


def _grad_of_a_times_b(a, b):
    (g,) = torch.autograd.grad((torch.sin(a * b) ** 2).sum(), a, create_graph=True)
    return g * b


def _tied(W):
    def f(h):  # (W closed over, and h = X @ W computed from it outside)
        (g,) = torch.autograd.grad((h @ W).sin().sum(), W, create_graph=True)
        return (h @ g).tanh()
    return f


_X4 = torch.tensor([0.3, -1.2, 2.0, 0.7], dtype=D)
_W4 = torch.tensor([[0.5, -0.2, 0.1, 0.3], [0.2, 0.4, -0.3, 0.1], [-0.1, 0.3, 0.6, -0.2], [0.3, -0.1, 0.2, 0.5]], dtype=D)
_RELATED = {
    "view_of_the_differentiated_input_under_grad": lambda wrap: grad(
        lambda Y: (wrap(_grad_of_a_times_b)(Y, Y[:]) ** 2).sum())(_X4),
    "forward_value_under_grad": lambda wrap: grad(  # (the region's output itself, as the auxiliary output)
        lambda Y: (lambda o: ((o ** 2).sum(), o))(wrap(_grad_of_a_times_b)(Y, Y * 2.0)), has_aux=True)(_X4),
    "grad_w_of_grad_x_b_computed_from_x": lambda wrap: grad(lambda w: grad(
        lambda X, w: (wrap(_grad_of_a_times_b)(X, X * w) ** 2).sum())(_X4, w).sum())(_X4.cos()),
    "tied_weight_closed_over_under_grad": lambda wrap: grad(lambda W: wrap(_tied(W))(_W4[:2] @ W).pow(2).sum())(_W4),
    "tied_weight_closed_over_under_grad_of_grad": lambda wrap: grad(
        lambda W: grad(lambda W: wrap(_tied(W))(_W4[:2] @ W).pow(2).sum())(W).pow(2).sum())(_W4),
    "nested_the_enclosing_region_given_both": lambda wrap: grad(  # (the relation lies outside the enclosing region)
        lambda Y: (wrap(lambda a, b: wrap(_grad_of_a_times_b)(a, b).sin())(Y, Y * 2.0) ** 2).sum())(_X4),
    "nested_the_enclosing_region_given_both_under_hessian": lambda wrap: hessian(
        lambda Y: (wrap(lambda a, b: wrap(_grad_of_a_times_b)(a, b).sin())(Y, Y * 2.0) ** 2).sum())(_X4),
    "nested_relation_inside_the_enclosing_region": lambda wrap: grad(
        lambda Y: (wrap(lambda a: wrap(_grad_of_a_times_b)(a, a * 2.0))(Y) ** 2).sum())(_X4),
    "tied_weight_closed_over_under_jvp_of_grad": lambda wrap: jvp(
        grad(lambda W: wrap(_tied(W))(_W4[:2] @ W).pow(2).sum()), (_W4,), (torch.ones_like(_W4),)),
}


@pytest.mark.parametrize("case", list(_RELATED))
def test_autograd_inside_of_an_input_another_input_depends_on(case):
    """``torch.autograd.grad(y, x)`` inside the region where another of its inputs depends on ``x`` in the caller's graph
    (``f(Y, Y[:])``, ``f(X, X * w)``, a weight the function closes over and an argument computed from it): plain code's
    gradient takes the path through that other input too, which the region's own leaves cut: half of plain's forward
    value (under ``jvp``, ``grad``) and 4x off derivatives, silently (at 71e1192, a hostile pass). The call runs as plain
    code there (exact; it saves no memory)."""
    _close(_RELATED[case](remat), _RELATED[case](ident))


@pytest.mark.xfail(strict=True, reason="open, silent (at 71e1192 too): eager autograd over w around grad over X, the "
                   "region differentiating inside an input computed from w outside (a = X * w): 17 to 1.1e3 off")
def test_autograd_inside_of_an_input_computed_from_an_eager_leaf_under_grad():
    results = []
    for f in (_grad_of_a_times_b, remat(_grad_of_a_times_b)):
        w = _X4.cos().clone().requires_grad_()
        results.append(torch.autograd.grad(grad(lambda X, w: (f(X * w, w) ** 2).sum())(_X4, w).sum(), w)[0])
    _close(results[1], results[0])
