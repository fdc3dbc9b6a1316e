"""Recompute from the recorded forward (remat_fn._tape): JAX's policy semantics, only
the ops backward needs, no side effect twice, random ops replayed, mutations caught.

Op counts come from a dispatch-mode counter around the backward only; every
gradient is compared with the plain function's."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import grad, vjp, vmap

from remat_fn import MutatedSavedTensorError, checkpoint_name, policies, remat, saved_residuals

from ._util import OpCount, assert_tree_close

HOWS = ["eager", "grad", "vjp"]


def bwd(fn, args, how):
    """(gradients, op counts of the backward alone) of ``fn(*args).sum()``."""
    if how == "eager":
        xs = [a.detach().clone().requires_grad_() for a in args]
        out = fn(*xs).sum()
        with OpCount() as c:
            gs = torch.autograd.grad(out, xs)
        return gs, c.n
    out, f = vjp(lambda *a: fn(*a).sum(), *args)
    with OpCount() as c:
        gs = f(torch.ones_like(out))
    return gs, c.n


def plain_bwd(fn, args):
    xs = [a.detach().clone().requires_grad_() for a in args]
    out = fn(*xs).sum()
    with OpCount() as c:
        gs = torch.autograd.grad(out, xs)
    return gs, c.n


def _tanh_layers(x, w1, w2, w3):
    for w in (w1, w2, w3):
        x = torch.tanh(x @ w)
    return x


def _args(n=4, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, n, generator=g, dtype=torch.float64) for _ in range(k)]


# -- JAX's policy semantics ---------------------------------------------------


@pytest.mark.parametrize("how", HOWS)
def test_dots_saveable_keeps_matmuls_that_feed_tanh(how):
    """tanh saves its output, not its input: autograd never saves the matmuls, yet
    JAX's dots_saveable keeps them because recomputing tanh's output reads them."""
    args = _args(k=4)
    plain, pc = plain_bwd(_tanh_layers, args)
    got, c = bwd(remat(_tanh_layers, policy=policies.dots_saveable), args, how)
    assert_tree_close(got, plain)
    assert c.get("mm", 0) == pc["mm"] == 6  # no matmul recomputed
    assert c.get("tanh", 0) == 3  # the tanh outputs are recomputed from the kept matmuls
    _, c0 = bwd(remat(_tanh_layers), args, how)
    assert c0["mm"] == 9  # nothing_saveable: the three matmuls again


def test_dots_saveable_residuals_list_the_matmuls():
    rs = saved_residuals(remat(_tanh_layers, policy=policies.dots_saveable), *_args(k=4))
    assert [r.kind for r in rs].count("saved") == 3
    assert all(r.op == "aten.mm" for r in rs if r.kind == "saved")


@pytest.mark.parametrize("how", HOWS)
def test_save_only_these_names_keeps_a_value_autograd_does_not_save(how):
    def f(x, w):
        h = checkpoint_name(x @ w, "mm1")
        return torch.tanh(h).sin()

    args = _args(k=2)
    r = remat(f, policy=policies.save_only_these_names("mm1"))
    got, c = bwd(r, args, how)
    assert_tree_close(got, plain_bwd(f, args)[0])
    assert c.get("mm", 0) == 2  # backward's own two, no recompute of mm1
    assert c.get("tanh", 0) == 1
    assert [r.name for r in saved_residuals(r, *args) if r.kind == "saved"] == ["mm1"]


@pytest.mark.parametrize("how", HOWS)
def test_everything_saveable_recomputes_nothing(how):
    def f(x, w1, w2):
        h = torch.nn.functional.gelu(x @ w1)
        return torch.softmax(h @ w2, -1).exp()

    args = _args(k=3)
    plain, pc = plain_bwd(f, args)
    got, c = bwd(remat(f, policy=policies.everything_saveable), args, how)
    assert_tree_close(got, plain)
    assert {k: v for k, v in c.items() if k not in ("detach", "ones_like", "expand", "empty_strided")} == \
        {k: v for k, v in pc.items() if k not in ("detach", "ones_like", "expand")}


def test_saveable_value_nothing_needs_is_not_kept():
    """No dead copies: the matmul feeding only an add is saveable but nothing reads it."""
    def f(x, w):
        return torch.sin(x) + x @ w

    rs = saved_residuals(remat(f, policy=policies.dots_saveable), *_args(k=2))
    assert [r.kind for r in rs if r.kind == "saved"] == []


_K = torch.linspace(0.1, 1.6, 16, dtype=torch.float64).reshape(4, 4)  # a constant the programs read


# -- only what backward needs -----------------------------------------------


@pytest.mark.parametrize("how", HOWS)
def test_sin_times_two_plus_sin_recomputes_nothing(how):
    def f(x):
        return torch.sin(x) * 2 + torch.sin(x)

    args = _args(k=1)
    got, c = bwd(remat(f), args, how)
    assert_tree_close(got, plain_bwd(f, args)[0])
    assert c.get("sin", 0) == 0


@pytest.mark.parametrize("how", HOWS)
def test_last_matmul_feeding_residual_add_is_not_recomputed(how):
    def block(x, w1, w2):
        return x + torch.relu(x @ w1) @ w2

    args = _args(k=3)
    plain, pc = plain_bwd(block, args)
    got, c = bwd(remat(block), args, how)
    assert_tree_close(got, plain)
    assert pc["mm"] == 4
    assert c["mm"] == 5  # backward's 4 and the first matmul (relu's output is needed)
    assert c.get("relu", 0) == 1


def test_partial_backward_replays_only_what_it_needs():
    """Two outputs, the second dropped before backward: its branch is not recomputed.
    (While an output is alive its branch may still be differentiated, so its
    saved values count as needed, as in plain autograd.)"""
    def f(x, w):
        return torch.sin(x @ w), torch.exp(x).cos()

    args = _args(k=2)
    xs = [a.clone().requires_grad_() for a in args]
    a, b = remat(f)(*xs)
    del b
    with OpCount() as c:
        g = torch.autograd.grad(a.sum(), xs)
    ref = torch.autograd.grad(f(*xs)[0].sum(), xs)
    assert_tree_close(g, ref)
    assert c.n.get("exp", 0) == 0 and c.n.get("cos", 0) == 1  # (sin's backward)


# -- no side effect twice ---------------------------------------------------


def _bn_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh())


def test_batchnorm_training_equals_plain():
    plain = _bn_model()
    rem = copy.deepcopy(plain)
    body = remat(lambda x: rem(x))
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(rem.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(16, 6, generator=g)
        for o, fn in ((opt_p, plain), (opt_r, body)):
            o.zero_grad()
            fn(x).pow(2).mean().backward()
            o.step()
    for a, b in zip(plain.state_dict().values(), rem.state_dict().values()):
        assert torch.equal(a, b)
    assert int(rem[1].num_batches_tracked) == 3


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_under_torch_func_equals_plain(momentum):
    """A functional training loop (functional_call + grad, buffers passed in): the
    recomputation writes into private copies of the buffers, so the running statistics
    are updated once and the gradients are plain's, bit for bit."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8, momentum=momentum),
                                   torch.nn.Tanh(), torch.nn.Linear(8, 3))

    plain, rem = model(), model()
    rem[1].forward = remat(rem[1].forward)
    rem[0].forward = remat(rem[0].forward)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(16, 6, generator=g)
        for m in (plain, rem):
            params = {k: v.detach() for k, v in m.named_parameters()}
            bufs = dict(m.named_buffers())
            grads = grad(lambda p, b: torch.func.functional_call(m, (p, b), (x,)).pow(2).mean())(params, bufs)
            with torch.no_grad():
                for k, p in m.named_parameters():
                    p.sub_(0.1 * grads[k])
    for a, b in zip(plain.state_dict().values(), rem.state_dict().values()):
        assert torch.equal(a, b)
    assert int(rem[1].num_batches_tracked) == 3


class _Doubling(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.ones(4, dtype=torch.float64))

    def forward(self, x):
        y = (x + self.buf).sin()  # (add saves nothing: backward recomputes x + buf)
        self.buf.mul_(2)  # the recomputation must read 1, not 2 (or 4)
        return y * self.buf


def test_torch_func_buffer_read_then_written_recomputes_from_the_value_read():
    x = _args(k=1)[0][0]
    grads = []
    for wrap in (False, True):
        m = _Doubling()
        if wrap:
            m.forward = remat(m.forward)
        grads.append(grad(lambda x, b: torch.func.functional_call(m, b, (x,)).sum())(x, dict(m.named_buffers())))
        assert torch.equal(m.buf, torch.full((4,), 2.0, dtype=torch.float64))
    assert_tree_close(grads[1], grads[0])


def test_spectral_norm_gradient_equals_plain():
    torch.manual_seed(0)
    lin = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(5, 5))
    lin2 = copy.deepcopy(lin)
    x = torch.randn(3, 5)
    lin(x).sum().backward()
    remat(lambda x: lin2(x))(x).sum().backward()
    for (n, a), b in zip(lin.named_parameters(), lin2.parameters()):
        assert torch.equal(a.grad, b.grad), n
    for a, b in zip(lin.buffers(), lin2.buffers()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("how", ["eager"])
def test_python_side_effects_run_once(how):
    calls, cache = [], []

    def f(x):
        calls.append(1)
        h = x.exp()
        cache.append(h.detach())
        return h.sin()

    args = _args(k=1)
    got, _ = bwd(remat(f), args, how)
    assert_tree_close(got, plain_bwd(lambda x: x.exp().sin(), args)[0])
    assert len(calls) == 1 and len(cache) == 1


@pytest.mark.parametrize("how", ["grad", "vjp"])
def test_torch_func_path_runs_python_once(how):
    """Under torch.func backward differentiates the forward level's graph, whose saved
    tensors the tape replays: the function's Python runs once, as in eager mode."""
    calls = []

    def f(x):
        calls.append(1)
        return x.exp().sin()

    args = _args(k=1)
    got, _ = bwd(remat(f), args, how)
    assert_tree_close(got, plain_bwd(lambda x: x.exp().sin(), args)[0])
    assert len(calls) == 1


@pytest.mark.parametrize("how,runs", [("vmap_grad", 1), ("grad_vmap", 1), ("grad_grad", 1), ("vmap_grad_vmap", 1),
                                      ("vmap_grad_vmap_unbatched_weight", 1)])
def test_torch_func_path_runs_python_again_where_the_replay_cannot(how, runs):
    """What the aten replay does not cover: a vmap inside a grad level inside another vmap
    (``vmap(grad(vmap))``) where the grad level differentiates an input the outer vmap does not
    batch (a replay on the tensors below both vmaps would sum its gradient over the outer
    examples): the forward's torch calls replay there (remat_fn._logical; the function ran again,
    its Python side effects repeated, until this); where the outer vmap
    batches every differentiated input the replay keeps each example's gradient apart as plain
    code does, and runs it once (twice until this).  Under ``vmap(grad)`` backward differentiates the forward level's graph
    under the same vmap levels, under ``grad(vmap)`` it replays the batched ops below the
    vmap (it ran the function again until this), and where an outer level differentiates the
    backward (grad of grad) the recorded forward is replayed through it
    (remat_fn._replay_live): the function runs once."""
    calls = []

    def f(x):
        calls.append(1)
        return x.exp().sin()

    x = _args(k=1)[0]
    if how == "vmap_grad":
        got = vmap(grad(lambda r: remat(f)(r).sum()))(x)
        want = vmap(grad(lambda r: r.exp().sin().sum()))(x)
    elif how == "grad_vmap":
        got = grad(lambda r: vmap(remat(f))(r).sum())(x)
        want = grad(lambda r: vmap(lambda s: s.exp().sin())(r).sum())(x)
    elif how == "vmap_grad_vmap":
        got = vmap(grad(lambda r: vmap(remat(f))(r).sum()))(x[None].expand(2, *x.shape))
        want = vmap(grad(lambda r: vmap(lambda s: s.exp().sin())(r).sum()))(x[None].expand(2, *x.shape))
    elif how == "vmap_grad_vmap_unbatched_weight":
        w = x[0].clone()

        def g(s, v):
            calls.append(1)
            return (s * v).exp().sin()

        def per(c, fn):
            return grad(lambda v: (vmap(fn, in_dims=(0, None))(x * c, v) ** 2).sum())(w)
        cs = torch.tensor([0.5, -1.5], dtype=x.dtype)
        want = vmap(lambda c: per(c, g))(cs)
        assert len(calls) == 1
        calls.clear()
        got = vmap(lambda c: per(c, remat(g)))(cs)
    else:
        got = grad(lambda r: grad(lambda s: remat(f)(s).sum())(r).sum())(x)
        want = grad(lambda r: grad(lambda s: s.exp().sin().sum())(r).sum())(x)
    assert_tree_close(got, want)
    assert len(calls) == runs


def test_user_try_except_cannot_derail_backward():
    def f(x):
        try:
            return torch.sin(x).exp()
        except Exception:  # noqa: BLE001 - the user's own handler
            return x * 0

    x = _args(k=1)[0].requires_grad_()
    (g,) = torch.autograd.grad(remat(f)(x).sum(), x)
    (ref,) = torch.autograd.grad(f(x).sum(), x)
    assert torch.equal(g, ref)


def test_buffer_updated_in_place_inside_region_is_read_as_the_forward_read_it():
    """The region reads a buffer, then updates it in place; backward recomputes from the
    value the forward read (a copy taken before the write), and the buffer is
    updated once."""
    buf = torch.ones(4, dtype=torch.float64)

    def f(x):
        y = (x + buf).sin()  # add saves nothing: backward recomputes x + buf
        buf.add_(1)
        return y * buf

    x = _args(k=1)[0][0].requires_grad_()
    b0 = buf.clone()
    (g,) = torch.autograd.grad(remat(f)(x).sum(), x)
    assert torch.equal(buf, b0 + 1)
    ref_buf = b0.clone()
    ref = (x + ref_buf).sin() * (ref_buf + 1)
    (gr,) = torch.autograd.grad(ref.sum(), x)
    assert torch.equal(g, gr)


# -- random ops replay the same bits ----------------------------------------


def _dropout_global(x):
    return torch.nn.functional.dropout(x, 0.5, training=True).exp()


_GEN = torch.Generator()


def _explicit_generator(x):
    return (torch.rand(x.shape, generator=_GEN, dtype=x.dtype) * x).exp()


def _fork_rng(x):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        y = torch.rand_like(x) * x
    return (y + torch.rand_like(x)).exp()


@pytest.mark.parametrize("how", ["eager", "grad", "vmap_grad"])
@pytest.mark.parametrize("fn", [_dropout_global, _explicit_generator, _fork_rng])
def test_random_ops_replay_the_same_bits(fn, how):
    x = _args(k=1)[0]

    def run(f):
        torch.manual_seed(3)
        _GEN.manual_seed(5)
        if how == "eager":
            xs = x.clone().requires_grad_()
            (g,) = torch.autograd.grad(f(xs).sum(), xs)
        elif how == "grad":
            g = grad(lambda a: f(a).sum())(x)
        else:
            g = vmap(grad(lambda a: f(a).sum()), randomness="different")(x)
        return g, torch.rand(1), _GEN.get_state()

    g, after, gen = run(remat(fn))
    gp, afterp, genp = run(fn)
    assert torch.equal(g, gp)
    assert torch.equal(after, afterp)  # the generators end where plain code leaves them
    assert torch.equal(gen, genp)


# -- mutation safety ----------------------------------------------------------


class _Cfg:
    def __init__(self, t):
        self.scale = t


class _Holder:
    const = None


def _reach(kind, t):
    if kind == "private_list":
        class M:
            def __init__(self):
                self._consts = [t]

            def get(self):
                return self._consts[0]
        m = M()
        return m.get
    if kind == "config":
        cfg = _Cfg(t)
        return lambda: cfg.scale
    if kind == "class_attr":
        _Holder.const = t
        return lambda: _Holder.const
    if kind == "deque":
        d = collections.deque([t])
        return lambda: d[0]
    nested = t
    for _ in range(8):
        nested = [nested]

    def deep():
        v = nested
        for _ in range(8):
            v = v[0]
        return v
    return deep


@pytest.mark.parametrize("how", ["eager", "vjp"])
@pytest.mark.parametrize("kind", ["private_list", "config", "class_attr", "deque", "nested8"])
def test_mutated_constant_reached_anywhere_raises(kind, how):
    c = torch.full((4,), 2.0, dtype=torch.float64)
    get = _reach(kind, c)

    def f(x):
        return torch.sin(x * get())

    x = _args(k=1)[0][0]
    if how == "eager":
        xs = x.clone().requires_grad_()
        y = remat(f)(xs).sum()
        c.mul_(3)
        with pytest.raises(MutatedSavedTensorError):
            y.backward()
    else:
        y, fn = vjp(lambda a: remat(f)(a).sum(), x)
        c.mul_(3)
        with pytest.raises(MutatedSavedTensorError):
            fn(torch.ones_like(y))


# -- properties ---------------------------------------------------------------

_UNARY = {"sin": torch.sin, "tanh": torch.tanh, "exp": lambda t: t.clamp(-3, 3).exp(), "relu": torch.relu,
          "sq": lambda t: t * t}
_BINARY = {"mm": lambda a, b: a @ b / 4, "add": torch.add, "mul": torch.mul}
_POLICIES = {"none": None, "dots": policies.dots_saveable, "all": policies.everything_saveable,
             "names": policies.save_only_these_names("v1", "v3")}


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.tuples(st.booleans(), st.integers(0, 50), st.integers(0, 50), st.integers(0, 50)),
                      min_size=1, max_size=8),
       policy=st.sampled_from(sorted(_POLICIES)), how=st.sampled_from(HOWS + ["vmap_grad"]),
       inplace=st.booleans())
def test_hypothesis_replay_matches_plain(steps, policy, how, inplace):
    def f(x, w):
        vals = [x, w, _K]  # (a constant: what depends only on it is kept, not recomputed)
        for k, (unary, a, b, op) in enumerate(steps):
            if unary:
                v = _UNARY[sorted(_UNARY)[op % len(_UNARY)]](vals[a % len(vals)])
            else:
                v = _BINARY[sorted(_BINARY)[op % len(_BINARY)]](vals[a % len(vals)], vals[b % len(vals)])
            if inplace and k % 3 == 2:
                v = v.clone()
                v.mul_(0.5)
            vals.append(checkpoint_name(v, f"v{k}"))
        return vals[-1] + x + w

    args = _args(k=2, seed=len(steps))
    r = remat(f, policy=_POLICIES[policy])
    if how == "vmap_grad":
        xb = torch.stack([args[0], args[0] * 0.5])
        got = vmap(grad(lambda a, w: r(a, w).sum()), in_dims=(0, None))(xb, args[1])
        ref = vmap(grad(lambda a, w: f(a, w).sum()), in_dims=(0, None))(xb, args[1])
    else:
        got, _ = bwd(r, args, how)
        ref, _ = plain_bwd(f, args)
    assert_tree_close(got, ref, rtol=1e-9, atol=1e-10)
