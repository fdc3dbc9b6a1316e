"""Hostile tests of the recorded-forward replay (remat_fn._tape), buffers written in
place under torch.func (Tape.pre_write / private copies), needs_grad at grad levels,
memory_budget planned on the recorded graph, kept handles and saved_residuals.

Every test compares remat with the plain function (or a documented expectation).
Strict xfails are bugs found by this review; each names its cause."""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, stack_module_state, vjp, vmap

from remat_fn import MutatedSavedTensorError, RematError, _budget, checkpoint_name, remat, saved_residuals
from remat_fn import policies as P
from remat_fn.memory import LiveBytes

F64 = torch.float64


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _close(a, b, tol=1e-10):
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol, equal_nan=True)


@contextlib.contextmanager
def _meter():
    """LiveBytes without its gc.collect() on every read (about 0.1 s each on this
    machine): the programs measured here make no reference cycles."""
    with mock.patch.object(gc, "collect", lambda *a: 0), LiveBytes() as m:
        yield m


def _grads(fn, *args):
    args = [a.detach().clone().requires_grad_() for a in args]
    return torch.autograd.grad(fn(*args), args)


def _live_after_forward(fn, *args):
    """Bytes of tensors made by ``fn(*args)`` still alive after it returns (its output
    excluded), and the gradients w.r.t. the floating arguments."""
    args = [a.detach().clone().requires_grad_() for a in args]
    with _meter() as m:
        y = fn(*args)
        live = m.live - y.untyped_storage().nbytes()
    return live, torch.autograd.grad(y, args)


# -- 1. in-place writes into a value the policy keeps ------------------------------


def _bias_in_place(x, w):
    h = x @ w  # kept by dots_saveable
    h.add_(1.0)  # `h += bias`: replayed in backward on the kept tensor itself
    return h.tanh().sum()


def _xw(seed=0):
    g = _gen(seed)
    return torch.randn(3, 3, generator=g, dtype=F64), torch.randn(3, 3, generator=g, dtype=F64)


def test_kept_value_written_in_place_first_backward_is_exact():
    x, w = _xw()
    _close(_grads(remat(_bias_in_place, policy=P.dots_saveable), x, w), _grads(_bias_in_place, x, w))


def test_kept_value_written_in_place_second_backward_retain_graph():
    x, w0 = _xw()
    w = w0.clone().requires_grad_()
    y = remat(_bias_in_place, policy=P.dots_saveable)(x, w)
    (g1,) = torch.autograd.grad(y, w, retain_graph=True)
    (g2,) = torch.autograd.grad(y, w)
    _close(g2, g1)


def test_kept_value_written_in_place_vjp_fn_called_twice():
    x, w = _xw()
    out, vf = vjp(lambda w: remat(_bias_in_place, policy=P.dots_saveable)(x, w), w)
    (g1,) = vf(torch.ones_like(out))
    (g2,) = vf(torch.ones_like(out))
    _close(g2, g1)


def test_kept_value_written_in_place_eager_hessian_vector_product():
    x, w0 = _xw()

    def hvp(fn):
        w = w0.clone().requires_grad_()
        (g,) = torch.autograd.grad(fn(x, w), w, create_graph=True)
        return torch.autograd.grad(g.sum(), w)[0]

    _close(hvp(remat(_bias_in_place, policy=P.dots_saveable)), hvp(_bias_in_place))


def test_kept_value_written_in_place_hvp_under_torch_func_is_exact():
    x, w = _xw()

    def hvp(fn):
        return grad(lambda w: grad(lambda w: fn(x, w))(w).sum())(w)

    _close(hvp(remat(_bias_in_place, policy=P.dots_saveable)), hvp(_bias_in_place))


# -- 2. buffers written in place under torch.func ----------------------------------


def _bn_net(momentum=0.1, wrap=False):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8, momentum=momentum),
                            torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    if wrap:
        m[0].forward = remat(m[0].forward)
        m[1].forward = remat(m[1].forward)
    return m


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_called_twice_per_step_under_grad_equals_plain(momentum):
    """Two calls of the same remat'ed BatchNorm before one backward, three steps."""
    x = torch.randn(16, 6, generator=_gen(1), dtype=F64)
    results = []
    for wrap in (False, True):
        m = _bn_net(momentum, wrap)
        gs = []
        for step in range(3):
            p = {k: v.detach() for k, v in m.named_parameters()}

            def loss(p, b, step=step):
                return (functional_call(m, (p, b), (x * (step + 1),)).pow(2).mean()
                        + functional_call(m, (p, b), (x.flip(0),)).pow(2).mean())

            g = grad(loss)(p, dict(m.named_buffers()))
            with torch.no_grad():
                for k, q in m.named_parameters():
                    q.sub_(0.1 * g[k])
            gs.append(g)
        results.append((gs, {k: v.clone() for k, v in m.state_dict().items()}))
    (gp, sp), (gr, sr) = results
    _close(gr, gp, tol=0)
    for k in sp:
        assert torch.equal(sp[k], sr[k]), k


class _SharedBN(torch.nn.Module):
    """Two regions (and three calls) sharing one BatchNorm."""

    def __init__(self, wrap):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = torch.nn.Linear(6, 8).double(), torch.nn.Linear(6, 8).double()
        self.bn = torch.nn.BatchNorm1d(8).double()
        self.b1 = remat(self._b1) if wrap else self._b1
        self.b2 = remat(self._b2, policy=P.dots_saveable) if wrap else self._b2

    def _b1(self, h):
        return torch.tanh(self.bn(self.l1(h)))

    def _b2(self, h):
        return torch.sigmoid(self.bn(self.l2(h)))

    def forward(self, h):
        return (self.b1(h) * self.b2(h) + self.b1(h * 0.5)).pow(2).mean()


@pytest.mark.parametrize("how", ["eager", "grad"])
def test_two_regions_sharing_a_batchnorm(how):
    x = torch.randn(16, 6, generator=_gen(2), dtype=F64)
    out = []
    for wrap in (False, True):
        m = _SharedBN(wrap)
        if how == "eager":
            m(x).backward()
            g = [q.grad for q in m.parameters()]
        else:
            p = {k: v.detach() for k, v in m.named_parameters()}
            g = grad(lambda p, b: functional_call(m, (p, b), (x,)))(p, dict(m.named_buffers()))
        out.append((g, [b.clone() for b in m.buffers()]))
    _close(out[1][0], out[0][0], tol=0)
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))


def test_per_sample_grads_with_batchnorm_replaced_equal_plain():
    x = torch.randn(5, 4, 6, generator=_gen(3), dtype=F64)
    res = []
    for wrap in (False, True):
        m = _bn_net(wrap=wrap)
        torch.func.replace_all_batch_norm_modules_(m)
        p = {k: v.detach() for k, v in m.named_parameters()}
        b = dict(m.named_buffers())
        res.append(vmap(grad(lambda p, xi: functional_call(m, (p, b), (xi,)).pow(2).mean()),
                        in_dims=(None, 0))(p, x))
    _close(res[1], res[0], tol=0)


def test_instance_norm_tracking_stats_under_grad_equals_plain():
    x = torch.randn(3, 4, 5, generator=_gen(4), dtype=F64)
    res = []
    for wrap in (False, True):
        torch.manual_seed(0)
        m = torch.nn.InstanceNorm1d(4, track_running_stats=True, affine=True, momentum=None).double()
        if wrap:
            m.forward = remat(m.forward)
        p = {k: v.detach() for k, v in m.named_parameters()}
        gs = [grad(lambda p, b, s=s: functional_call(m, (p, b), (x * s,)).pow(3).sum())(p, dict(m.named_buffers()))
              for s in (1.0, 2.0)]
        res.append((gs, [b.clone() for b in m.buffers()]))
    _close(res[1][0], res[0][0], tol=0)
    assert all(torch.equal(a, b) for a, b in zip(res[0][1], res[1][1]))


class _BufferWrites(torch.nn.Module):
    """Buffer writes plain code can differentiate (no saved value is overwritten)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.register_buffer("buf", torch.ones(4, dtype=F64))

    def forward(self, x):
        buf, kind = self.buf, self.kind
        if kind == "view":  # write through a view, read after
            y = (x + buf).sin()
            buf[1:3] += x.detach()[:2]
            return (y.exp() + buf).pow(2).sum()
        if kind == "index":  # buf[0] += 1
            y = (x + buf).sin()
            buf[0] += 1
            return (y + buf).cos().sum()
        if kind == "read_after":  # write first, then read
            buf.mul_(x.detach().sum())
            return ((x + buf).sin().exp() + buf).pow(2).sum()
        if kind == "copy":  # write without a prior read
            buf.copy_(x.detach() * 3)
            return (x + buf).sin().sum()
        if kind == "saved_by_mul":  # the write precedes the op that saves it
            buf.add_(0.5)
            return (x * buf).sin().sum()
        raise AssertionError(kind)


_KINDS = ["view", "index", "read_after", "copy", "saved_by_mul"]


@pytest.mark.parametrize("how", ["eager", "grad", "jacrev", "vmap_grad"])
@pytest.mark.parametrize("kind", _KINDS)
def test_region_writing_a_buffer_equals_plain(kind, how):
    x = torch.linspace(0.1, 1, 4, dtype=F64)
    res = []
    for wrap in (False, True):
        m = _BufferWrites(kind)
        if wrap:
            m.forward = remat(m.forward)
        b = dict(m.named_buffers())
        f = lambda x, b: functional_call(m, b, (x,))  # noqa: E731
        if how == "eager":
            xx = x.clone().requires_grad_()
            m(xx).backward()
            g = xx.grad
        elif how == "grad":
            g = grad(f)(x, b)
        elif how == "jacrev":
            g = jacrev(f)(x, b)
        else:
            if kind in ("copy", "read_after", "view"):
                pytest.skip("plain code itself fails (a batched write into an unbatched buffer)")
            g = vmap(grad(f), in_dims=(0, None))(torch.stack([x, x * 0.5]), b)
        res.append((g, m.buf.clone()))
    _close(res[1][0], res[0][0])
    assert torch.equal(res[1][1], res[0][1])


def _writes_its_argument(x, buf):
    y = (x + buf).sin()
    buf.add_(1)  # an argument written in place (eager: the replay reads a copy)
    return (y * 2 + buf).exp().sum()


@pytest.mark.parametrize("policy", [None, P.dots_saveable])
def test_eager_region_writing_its_argument_backward_twice(policy):
    res = []
    for fn in (_writes_its_argument, remat(_writes_its_argument, policy=policy)):
        buf = torch.ones(4, dtype=F64)
        x = torch.linspace(0.1, 1, 4, dtype=F64).requires_grad_()
        y = fn(x, buf)
        (g1,) = torch.autograd.grad(y, x, retain_graph=True)
        (g2,) = torch.autograd.grad(y, x)
        res.append((g1, g2, buf))
    _close(res[1], res[0], tol=0)


class _TwoRegions(torch.nn.Module):
    """The same buffer written by two regions."""

    def __init__(self, wrap):
        super().__init__()
        self.register_buffer("buf", torch.ones(4, dtype=F64))
        self.f1 = remat(self._f1) if wrap else self._f1
        self.f2 = remat(self._f2, policy=P.dots_saveable) if wrap else self._f2

    def _f1(self, x):
        y = (x + self.buf).sin()
        self.buf.mul_(2)
        return y + self.buf

    def _f2(self, x):
        y = (x - self.buf).tanh()
        self.buf.add_(3)
        return y - self.buf

    def forward(self, x):
        return self.f2(self.f1(x)).exp().sum()


@pytest.mark.parametrize("how", ["eager", "grad"])
def test_same_buffer_written_by_two_regions(how):
    x = torch.linspace(0.1, 1, 4, dtype=F64)
    res = []
    for wrap in (False, True):
        m = _TwoRegions(wrap)
        if how == "eager":
            xx = x.clone().requires_grad_()
            m(xx).backward()
            g = xx.grad
        else:
            g = grad(lambda x, b: functional_call(m, b, (x,)))(x, dict(m.named_buffers()))
        res.append((g, m.buf.clone()))
    _close(res[1][0], res[0][0])
    assert torch.equal(res[1][1], res[0][1])


class _StackedWrite(torch.nn.Module):
    def __init__(self, i):
        super().__init__()
        self.register_buffer("s", torch.full((4,), float(i + 1), dtype=F64))

    def forward(self, x):
        y = (x * self.s.sum()).sin()  # reads this model's buffer
        self.s[0] = 5.0  # and writes it (a __setitem__: no traced output shape)
        return y.sum()


@pytest.mark.xfail(strict=True, raises=RuntimeError, reason="vmap over stacked buffers the region writes: "
                   "private_copies cannot rebuild a per-model slice, so the re-run writes the captured "
                   "buffer and functorch refuses it (a loud error; it was silently wrong before the fix)")
def test_model_ensemble_vmap_over_stacked_buffers_written_in_region():
    x = torch.linspace(0.1, 1, 4, dtype=F64)
    res = []
    for wrap in (False, True):
        ms = [_StackedWrite(i) for i in range(3)]
        _, bufs = stack_module_state(ms)
        base = copy.deepcopy(ms[0])
        if wrap:
            base.forward = remat(base.forward)
        g = vmap(grad(lambda x, b: functional_call(base, b, (x,))), in_dims=(None, 0))(x, bufs)
        res.append((g, bufs["s"]))
    assert torch.equal(res[1][1], res[0][1])
    _close(res[1][0], res[0][0])


@pytest.mark.xfail(strict=True, raises=RuntimeError, reason="same cause: an ensemble of BatchNorms under "
                   "vmap(grad) is refused by functorch in the re-run (num_batches_tracked.add_ on a captured "
                   "tensor)")
def test_model_ensemble_of_batchnorms_under_vmap_grad():
    torch.manual_seed(0)
    x = torch.randn(8, 3, dtype=F64)
    res = []
    for wrap in (False, True):
        ms = [torch.nn.BatchNorm1d(3).double() for _ in range(2)]
        for i, m in enumerate(ms):
            with torch.no_grad():
                m.weight.add_(i)
        params, bufs = stack_module_state(ms)
        base = copy.deepcopy(ms[0]).to("meta")
        if wrap:
            base.forward = remat(base.forward)
        g = vmap(grad(lambda p, b: functional_call(base, (p, b), (x,)).pow(3).sum()))(params, bufs)
        res.append((g, bufs))
    _close(res[1][0], res[0][0])
    for k in res[0][1]:
        assert torch.equal(res[0][1][k], res[1][1][k])


class _Aliased(torch.nn.Module):
    def __init__(self):
        super().__init__()
        flat = torch.ones(8, dtype=F64)
        self.register_buffer("a", flat[:4])
        self.register_buffer("b", flat[:4])  # the same memory as a (a flattened/tied buffer)

    def forward(self, x):
        self.a.add_(1)
        return (x * self.b).sin().sum()  # reads the written memory through the other buffer


@pytest.mark.parametrize("how", ["eager", "grad"])
def test_aliased_buffers_equal_plain(how):
    x = torch.linspace(0.1, 1, 4, dtype=F64)
    gs = []
    for wrap in (False, True):
        m = _Aliased()
        if wrap:
            m.forward = remat(m.forward)
        if how == "eager":
            xx = x.clone().requires_grad_()
            m(xx).backward()
            gs.append(xx.grad)
        else:
            gs.append(grad(lambda x, b: functional_call(m, b, (x,)))(x, dict(m.named_buffers())))
            assert torch.equal(m.a, torch.full((4,), 2.0, dtype=F64))
    _close(gs[1], gs[0])


class _ViewWriteThenRead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.ones(4, dtype=F64))

    def forward(self, x):
        self.buf[1:3].add_(x.detach()[:2])  # written through a view
        return (x + self.buf).sin()  # then read (add saves nothing: sin saves x + buf)


@pytest.mark.parametrize("how", ["eager", "grad"])
def test_buffer_written_through_view_then_read_module_called_twice(how):
    x = torch.linspace(0.1, 1, 4, dtype=F64)
    res = []
    for wrap in (False, True):
        m = _ViewWriteThenRead()
        if wrap:
            m.forward = remat(m.forward)
        if how == "eager":
            xx = x.clone().requires_grad_()
            (m(xx).sum() + m(xx * 2).sum()).backward()
            g = xx.grad
        else:
            g = grad(lambda x, b: functional_call(m, b, (x,)).sum() + functional_call(m, b, (x * 2,)).sum())(
                x, dict(m.named_buffers()))
        res.append((g, m.buf.clone()))
    _close(res[1][0], res[0][0])
    assert torch.equal(res[1][1], res[0][1])


def _bn_x():
    torch.manual_seed(0)
    return torch.randn(8, 3, dtype=F64), torch.randn(3, dtype=F64)


def _bn_plain_and_remat(transform):
    """``transform(bn)`` for a fresh BatchNorm, plain and remat'ed: results and running means."""
    res = []
    for wrap in (False, True):
        torch.manual_seed(0)
        bn = torch.nn.BatchNorm1d(3).double()
        if wrap:
            bn.forward = remat(bn.forward)
        res.append((transform(bn), bn.running_mean.clone(), bn.num_batches_tracked.clone()))
    _close(res[1][0], res[0][0])
    assert torch.equal(res[1][1], res[0][1])
    assert torch.equal(res[1][2], res[0][2])  # (a forward retried to thread a tensor counts once)


def test_batchnorm_grad_of_grad_under_functional_call():
    # fixed (was a strict xfail): the region's forward runs below both grad levels, where
    # functorch refused num_batches_tracked.add_ into the buffer wrapped at the inner one;
    # the write now goes to the plain tensor below (it carries no gradient), and the
    # forward's retries (to thread the running statistics) undo its writes first
    x, w = _bn_x()

    def hvp(bn):
        def loss(w, b):
            return functional_call(bn, b, (x * w,)).pow(3).sum()

        return grad(lambda w, b: grad(loss)(w, b).sum())(w, dict(bn.named_buffers()))

    _bn_plain_and_remat(hvp)


# fixed (was a strict xfail): the region's forward under forward mode runs the BatchNorm's running
# statistics (a tangent's carriers, not differentiated in reverse) outside its vjp level, where
# native_batch_norm refused a running_mean that requires grad
def test_batchnorm_jacfwd_under_functional_call():
    x, _ = _bn_x()
    _bn_plain_and_remat(
        lambda bn: jacfwd(lambda x, b: functional_call(bn, b, (x,)).pow(3).sum())(x, dict(bn.named_buffers())))


def test_batchnorm_in_nested_regions_under_functional_call_grad():
    # fixed (was a strict xfail): the buffers, wrapped at the outer levels set aside in the inner
    # region's forward, are read there as the plain tensors below (remat_fn._captures.CaptureMode)
    x, _ = _bn_x()
    res = []
    for wrap in (False, True):
        torch.manual_seed(0)
        bn = torch.nn.BatchNorm1d(3).double()

        def inner(h):
            return bn(h).tanh()

        i = remat(inner) if wrap else inner

        def outer(h):
            return i(h * 2).sin()

        o = remat(outer) if wrap else outer

        class Holder(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.bn = bn

            def forward(self, h):
                return o(h)

        holder = Holder()
        bufs = {"bn." + k: v for k, v in bn.named_buffers()}
        res.append((grad(lambda x, b: functional_call(holder, b, (x,)).sum())(x, bufs), bn.running_mean.clone()))
    _close(res[1][0], res[0][0])
    assert torch.equal(res[1][1], res[0][1])


def test_constant_made_inside_grad_and_mutated_after_the_call_is_refused_clearly():
    """needs_grad: a tensor made inside grad without requires_grad is a constant the
    region reads; changing it before backward must raise, never be read silently."""
    def loss(x, wrap):
        c = torch.ones_like(x)
        f = lambda x: (x + c).sin() * 2  # noqa: E731
        y = (remat(f) if wrap else f)(x)
        c.add_(1)
        return y.sum()

    x = torch.linspace(0.1, 1, 4, dtype=F64)
    grad(lambda x: loss(x, False))(x)  # plain code: fine (add saves nothing)
    with pytest.raises(MutatedSavedTensorError):
        grad(lambda x: loss(x, True))(x)


def test_transform_mixes_with_constants_equal_plain():
    g = _gen(5)
    x0 = torch.randn(3, 4, generator=g, dtype=F64)
    w0 = torch.randn(4, 4, generator=g, dtype=F64)
    c0 = torch.linspace(0.5, 1.5, 4, dtype=F64)

    def f(x, w, c):
        return ((x @ w).tanh() * c).exp().sum()

    def cases(fn):
        w = w0.clone().requires_grad_()
        gx = grad(lambda x: fn(x, w, torch.ones(4, dtype=F64)))(x0)  # eager outer, closes over w
        out = [torch.autograd.grad(gx.pow(2).sum(), w)[0]]
        out.append(grad(lambda x, w: fn(x, w, (x.detach() * 0 + 2.0)[0]), argnums=(0, 1))(x0, w0))
        out.append(grad(lambda w: grad(lambda x, w2: fn(x, w2, w2[1]), argnums=0)(x0, w).sum())(w0))
        out.append(jvp(lambda w: grad(lambda x: fn(x, w, w[2]))(x0), (w0,), (torch.ones_like(w0),))[1])
        out.append(jvp(lambda x: fn(x, w0, c0), (x0,), (torch.ones_like(x0),))[1])
        out.append(jvp(lambda c: fn(x0, w0, c), (c0,), (torch.ones_like(c0),))[1])
        out.append(jacfwd(lambda x: fn(x, w0, torch.full((4,), 0.7, dtype=F64)))(x0))
        out.append(hessian(lambda x: fn(x, w0, c0))(x0[:1]))
        out.append(vmap(grad(lambda x: fn(x, w0, torch.ones(4, dtype=F64) * 3)))(torch.stack([x0, x0 * 0.5])))
        out.append(jacrev(lambda w: fn(x0, w, w.sum(0)))(w0))
        return out

    ref = cases(f)
    for pol in (None, P.dots_saveable, P.memory_budget(0.5)):
        _budget.clear_plans()
        r = remat(f, policy=pol)
        cases(r)  # (memory_budget plans on the first call)
        _close(cases(r), ref)


# -- 3. the torch.func re-run with placeholders -------------------------------------


_READERS = {
    "item": lambda h: h.sum().item(),
    "tolist": lambda h: sum(h.tolist()),
    "bool": lambda h: 1.0 if bool((h > 0).all()) else -1.0,
    "nonzero": lambda h: float(len(torch.nonzero(h > 0)) - 2),
}


@pytest.mark.parametrize("reader", sorted(_READERS))
@pytest.mark.parametrize("how", ["grad", "vjp", "eager"])
def test_python_control_flow_on_a_value_backward_does_not_need(reader, how):
    def f(x):
        h = x.exp() - 2.0  # backward never reads h: only Python does
        if _READERS[reader](h) > 0:
            return (x.sin() * 3).sum()
        return (x.cos() * 5).sum()

    x0 = torch.tensor([0.1, 0.2, 1.5, 1.6], dtype=F64)
    res = []
    for fn in (f, remat(f)):
        if how == "grad":
            res.append(grad(fn)(x0))
        elif how == "vjp":
            o, vf = vjp(fn, x0)
            res.append(vf(torch.ones_like(o))[0])
        else:
            x = x0.clone().requires_grad_()
            fn(x).backward()
            res.append(x.grad)
    assert torch.equal(res[0], res[1])


@pytest.mark.xfail(strict=True, reason="under jvp the region's forward runs under a vjp level plain code "
                   "does not have: an in-place op on an output of chunk/split is refused (plain jvp works); "
                   "running the forward under no vjp level there lost side outputs, open")
def test_jvp_of_region_writing_into_a_chunk_output():
    def f(x):
        p, q = (x * 1.0).chunk(2, -1)
        p.add_(q)
        return torch.cat([p, q], -1).sin().sum()

    x = torch.randn(4, 4, generator=_gen(6), dtype=F64)
    t = torch.ones_like(x)
    _close(jvp(remat(f), (x,), (t,))[1], jvp(f, (x,), (t,))[1])


def _idx_put(a):
    b = a * 1.5
    b[torch.tensor([0, 2])] = a[1:3].exp()
    return b


def _narrow_copy(a):
    b = a.cos() + 0
    b.narrow(-1, 1, 2).copy_(a.narrow(-1, 0, 2) * 2)
    return b


def _masked(a):
    b = a * 2
    b.masked_fill_(a > 0.5, 0.0)
    return b


def _drop_in_place(a):
    b = a.exp() * 0.5
    return b * torch.empty_like(b).bernoulli_(0.7)


def _view_in_place(a):
    b = a * 1
    v = b.view(-1)
    v.mul_(v.detach().abs() + 0.5)
    return b.tanh()


_OPS = [_idx_put, _narrow_copy, _masked, _drop_in_place, _view_in_place,
        lambda a: torch.randn_like(a) * a + a.sin(),
        lambda a: torch.stack([r.sin() * i for i, r in enumerate(a.unbind(0))]),
        lambda a: a.as_strided((2, 2), (1, 2)).exp().sum() * a,
        lambda a: a @ a.t() * 0.1, lambda a: torch.tanh(a), lambda a: (a * 0.3).exp()]
_POL = {"none": None, "dots": P.dots_saveable, "budget": P.memory_budget(0.5)}


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, len(_OPS) - 1), st.integers(0, 20)), min_size=1, max_size=6),
       policy=st.sampled_from(sorted(_POL)),
       how=st.sampled_from(["eager", "grad", "vjp", "vmap_grad", "grad_of_grad"]))
def test_hypothesis_in_place_views_random_first_and_second_call(steps, policy, how):
    """Single backward, first (planning) and second call: remat equals plain code,
    random ops included (their generator states are replayed)."""
    def f(x):
        vals = [x]
        for op, src in steps:
            vals.append(_OPS[op](vals[src % len(vals)]))
        return sum((v * (k + 1)).sum() for k, v in enumerate(vals[1:]))

    x0 = torch.randn(4, 4, generator=_gen(len(steps)), dtype=F64) * 0.5

    def run(fn):
        torch.manual_seed(7)
        if how == "eager":
            x = x0.clone().requires_grad_()
            fn(x).backward()
            return x.grad
        if how == "grad":
            return grad(fn)(x0)
        if how == "vjp":
            o, vf = vjp(fn, x0)
            return vf(torch.ones_like(o))[0]
        if how == "vmap_grad":
            return vmap(grad(fn), randomness="same")(torch.stack([x0, x0 * 0.5]))
        return grad(lambda x: (grad(fn)(x) ** 2).sum())(x0)

    _budget.clear_plans()
    ref = run(f)
    r = remat(f, policy=_POL[policy])
    _close(run(r), ref, tol=1e-9)
    _close(run(r), ref, tol=1e-9)


def test_grad_of_grad_budget_two_random_ops_and_index_put():
    """The example the property above found once in six full runs, kept as a fixed case:
    under grad of grad the function runs again in backward; memory_budget kept randn_like's
    output, which returned without drawing shifted the numbers bernoulli_ drew after it
    (off by 852).  A random op of that re-run now draws from its recorded state."""
    test_hypothesis_in_place_views_random_first_and_second_call.hypothesis.inner_test(
        steps=[(0, 0), (0, 0), (5, 0), (3, 0), (1, 4)], policy="budget", how="grad_of_grad")


def _write_through_set_alias(x):
    h = x.exp() * 1
    alias = torch.empty(0, dtype=h.dtype).set_(h.detach().untyped_storage(), 0, h.shape, h.stride())
    alias.mul_(2)  # writes h's memory through a tensor set_ onto h's storage
    return h.sin().sum()  # sin saves h as written


def test_write_through_a_set_alias_of_a_region_value_is_refused_clearly():
    """The tape cannot replay set_ onto a storage (it was silently wrong): refused, naming the fix."""
    x = torch.linspace(0.1, 1, 4, dtype=F64)
    with pytest.raises(RematError, match="Fix: make that alias outside the region"):
        _grads(remat(_write_through_set_alias), x)
    _grads(remat(lambda x: x.sin().sum()), x)  # (nothing left behind)


def test_write_through_a_set_alias_runs_under_debug():
    """debug=True runs the function again instead of replaying the tape: set_ is not refused
    there (the forward's record of its writes, kept to put them back if the function turns
    out to call torch.func, is never replayed)."""
    x = torch.linspace(0.1, 1, 4, dtype=F64)
    _close(_grads(remat(_write_through_set_alias, debug=True), x), _grads(_write_through_set_alias, x), tol=1e-12)


# -- 4. memory_budget on the recorded graph ------------------------------------------


def _sort_and_cheap(x, w, z):
    h = (x @ w).half()  # 64x64 f16: 8 KiB
    v, _ = torch.sort(h, -1)  # SortBackward saves the int64 indices: 32 KiB
    return v.float().sum() + (z * 3).sin().sum()  # sin saves z * 3: 16 KiB, cheap


def test_memory_budget_bytes_with_integer_outputs_of_kept_ops():
    g = _gen(7)
    args = [torch.randn(64, 64, generator=g) for _ in range(3)]
    plain, ref = _live_after_forward(_sort_and_cheap, *args)
    _budget.clear_plans()
    r = remat(_sort_and_cheap, policy=P.memory_budget(0.5))
    _live_after_forward(r, *args)  # plans
    got, grads = _live_after_forward(r, *args)
    _close(grads, ref)
    assert got <= 0.5 * plain, (got, plain)


def _dead_branch(x, w):
    h = x @ w
    dead = (h @ w).sin()  # computed, never used: plain autograd frees its graph at once
    del dead
    return h.sin().sum()


@pytest.mark.parametrize("policy", [
    pytest.param(P.dots_saveable, id="dots_saveable"),
    pytest.param(P.memory_budget(0.5), id="budget0.5"),
])
def test_values_of_dead_code_are_not_kept(policy):
    x, w = _xw(8)
    plain, ref = _live_after_forward(_dead_branch, x, w)
    _budget.clear_plans()
    r = remat(_dead_branch, policy=policy)
    _live_after_forward(r, x, w)
    got, grads = _live_after_forward(r, x, w)
    _close(grads, ref)
    limit = plain * (policy.fraction if isinstance(policy, P.memory_budget) else 1.0)
    assert got <= limit, (got, limit)


_FLOAT_OPS = {
    "sin": lambda a: a.sin(), "exp": lambda a: (a * 0.1).exp(), "tanh": torch.tanh, "relu": torch.relu,
    "sq": lambda a: a * a, "softmax": lambda a: a.softmax(-1), "ln": lambda a: torch.nn.functional.layer_norm(a, (6,)),
    "inplace": lambda a: a.clone().mul_(a), "t": lambda a: a.t().contiguous().t() * 2,
    "drop": lambda a: torch.nn.functional.dropout(a, 0.3, training=True),
    "where": lambda a: torch.where(a.argmax(-1, keepdim=True) == torch.arange(6), a, a.sin()),
    "split": lambda a: torch.cat([p.cos() for p in a.split(3, -1)], -1),
    "slice_write": lambda a: _slice_write(a),
}


def _slice_write(a):
    b = a * 2
    b[:, :2] = a[:, :2].sin()
    return b


_FLOAT_BIN = {"add": torch.add, "mul": torch.mul, "mm": lambda a, b: a @ b.t() @ a * 0.1}


@settings(max_examples=30, deadline=None)
@given(steps=st.lists(st.tuples(st.booleans(), st.integers(0, 30), st.integers(0, 30), st.integers(0, 30)),
                      min_size=1, max_size=7),
       fraction=st.sampled_from([0.0, 0.3, 0.7, 1.0]), how=st.sampled_from(["eager", "vjp"]))
def test_memory_budget_byte_guarantee_on_random_programs(steps, fraction, how):
    """kept bytes <= fraction x what plain autograd keeps (every value reaches the output,
    no integer outputs), and gradients equal plain's, on the measuring call and after."""
    un, bi = sorted(_FLOAT_OPS), sorted(_FLOAT_BIN)

    def f(x, w):
        vals = [x @ w]
        for unary, a, b, op in steps:
            if unary:
                vals.append(_FLOAT_OPS[un[op % len(un)]](vals[a % len(vals)]))
            else:
                vals.append(_FLOAT_BIN[bi[op % len(bi)]](vals[a % len(vals)], vals[b % len(vals)]))
        return sum(v.sum() for v in vals)

    g = _gen(len(steps))
    x, w = torch.randn(6, 6, generator=g, dtype=F64) * 0.5, torch.randn(6, 6, generator=g, dtype=F64) * 0.5

    def run(fn):
        torch.manual_seed(3)
        if how == "eager":
            ww = w.clone().requires_grad_()
            with _meter() as m:
                y = fn(x, ww)
                live = m.live - y.untyped_storage().nbytes()
            return live, torch.autograd.grad(y, ww)[0]
        with _meter() as m:
            y, vf = vjp(lambda w: fn(x, w), w)
            live = m.live - y.untyped_storage().nbytes()
        return live, vf(torch.ones_like(y))[0]

    _budget.clear_plans()
    plain, ref = run(f)
    r = remat(f, policy=P.memory_budget(fraction))
    _, g1 = run(r)
    got, g2 = run(r)
    _close(g1, ref, tol=1e-9)
    _close(g2, ref, tol=1e-9)
    assert got <= fraction * plain + 1e-9, (got, plain)


def test_memory_budget_knapsack_fallback_above_160_candidates(monkeypatch):
    def f(x, w):
        h = x @ w
        for i in range(70):
            h = (h * 0.9).sin() if i % 2 else torch.tanh(h @ w * 0.1)
        return h.sum()

    graph_plans = []
    real = _budget.plan_on_graph

    def spy(*a, **k):
        graph_plans.append(real(*a, **k))
        return graph_plans[-1]

    monkeypatch.setattr(_budget, "plan_on_graph", spy)
    x, w = torch.randn(8, 8, generator=_gen(9)), torch.randn(8, 8, generator=_gen(10))
    plain, ref = _live_after_forward(f, x, w)
    _budget.clear_plans()
    r = remat(f, policy=P.memory_budget(0.5))
    _live_after_forward(r, x, w)
    got, grads = _live_after_forward(r, x, w)
    assert graph_plans == [None]  # (more than GRAPH_CANDIDATES: the knapsack planned it)
    assert 0 < got <= 0.5 * plain
    _close(grads, ref, tol=0)


# -- 5. names on the tape path --------------------------------------------------------


def _named(x, w):
    a = checkpoint_name(x @ w, "a")
    b = a.sin() * a.cos()  # a used several times
    c = checkpoint_name(b @ w, "c")
    return (c.sin() + a.exp() + a.sigmoid()).sum()  # sin reads c


@pytest.mark.parametrize("policy,kept_names", [
    (P.save_only_these_names("a"), {"a"}),
    (P.save_only_these_names("c"), {"c"}),
    (P.save_only_these_names("a", "c"), {"a", "c"}),
    (P.save_anything_except_these_names("a"), {"c"}),
    (P.save_anything_except_these_names("a", "c"), set()),
])
def test_names_on_values_used_several_times(policy, kept_names):
    g = _gen(11)
    x, w = torch.randn(8, 8, generator=g, dtype=F64), torch.randn(8, 8, generator=g, dtype=F64)
    plain, ref = _live_after_forward(_named, x, w)
    r = remat(_named, policy=policy)
    got, grads = _live_after_forward(r, x, w)
    _close(grads, ref)
    out, vf = vjp(lambda w: r(x, w), w)
    _close(vf(torch.ones_like(out))[0], ref[1])
    _close(grad(lambda w: r(x, w))(w), ref[1])
    names = {res.name for res in saved_residuals(r, x, w) if res.kind == "saved" and res.name}
    assert names == kept_names
    if "a" not in kept_names:  # the excluded value is not held (a handle, not the tensor)
        a_bytes = 8 * 8 * 8
        kept = sum(res.nbytes for res in saved_residuals(r, x, w) if res.kind == "saved")
        assert got == kept and got <= plain - a_bytes


# -- 6. saved_residuals ---------------------------------------------------------------


def test_saved_residuals_names_the_matmul_of_a_batched_matmul():
    x, w = torch.randn(2, 3, 4), torch.randn(4, 5)
    res = [r for r in saved_residuals(lambda x, w: (x @ w).sin().sum(), x, w) if r.kind == "saved"]
    assert [r.op for r in res] == ["aten.mm"]


def _max_named(x, w):
    h = x @ w
    v, _ = h.max(-1)
    v = checkpoint_name(v, "v")  # names the values (output 0), not the indices
    return v.exp().sum() + h.sin().sum()


def test_saved_residuals_name_belongs_to_the_named_output_only():
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    r = remat(_max_named, policy=P.save_anything_except_these_names("unused"))
    for res in saved_residuals(r, x, w):
        if res.name == "v":
            assert res.dtype == torch.float32, str(res)


def test_saved_residuals_reused_storage_is_named_by_its_latest_producer():
    def f(x):
        a = (x @ x).sin()  # mm output freed once sin has it
        b = a.exp()  # may reuse the mm's memory
        return b.sum()

    x = torch.randn(16, 16)
    ops = sorted(r.op for r in saved_residuals(f, x) if r.kind == "saved")
    assert ops == ["aten.exp", "aten.mm"]  # sin saves mm's output, exp saves its own


# -- 7. nothing held after the graph is gone ----------------------------------------


@pytest.mark.parametrize("policy", [None, P.dots_saveable, P.memory_budget(0.5)])
def test_inputs_and_buffer_snapshots_are_freed_with_the_graph(policy):
    buf = torch.ones(16, 16)

    def f(x, w):
        h = checkpoint_name(x @ w, "h")
        y = (h + buf).sin()
        buf.mul_(1.0)  # written after being read: a snapshot for the replay
        return (y * buf).tanh()

    w = torch.randn(16, 16, requires_grad=True)
    _budget.clear_plans()
    r = remat(f, policy=policy)
    r(torch.randn(16, 16), w).sum().backward()  # (plans)
    gc.disable()
    try:
        for backward in (False, True):
            left = []
            for fn in (f, r):
                x = torch.randn(16, 16)
                ref = weakref.ref(x)
                w.grad = None
                with _meter() as m:
                    y = fn(x, w)
                    if backward:
                        y.sum().backward()
                    del x, y
                    left.append(m.live)
                assert ref() is None
            assert left[1] <= left[0], left
    finally:
        gc.enable()
