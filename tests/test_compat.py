"""remat_fn.compat: the behaviours of torch.utils.checkpoint (TestCheckpoint, the
non-reentrant checkpoint tests, selective checkpointing), plus torch.func."""

from __future__ import annotations

import contextlib
import functools
import warnings

import pytest
import torch
import torch.utils.checkpoint as tc
from torch.func import functional_call, grad, jacrev, vmap

import remat_fn
from remat_fn.compat import checkpoint, checkpoint_sequential

from ._util import assert_tree_close

REENTRANT = [None, True, False]


def _leaves(*xs):
    return [x.detach().clone().requires_grad_(True) for x in xs]


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_matches_plain_and_no_warning(use_reentrant):
    w = torch.randn(4, 4, requires_grad=True)

    def f(x, y):
        return torch.tanh(x @ w) * y.sin()

    x, y = _leaves(torch.randn(3, 4), torch.randn(3, 4))
    ref = torch.autograd.grad(f(x, y).pow(2).sum(), (x, y, w))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = checkpoint(f, x, y, use_reentrant=use_reentrant)
    torch.testing.assert_close(out, f(x, y))
    assert_tree_close(torch.autograd.grad(out.pow(2).sum(), (x, y, w)), ref)


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_kwargs_and_non_tensor_args_and_outputs(use_reentrant):
    def f(x, n, *, scale, mode="sin", extra=None):
        y = (torch.sin(x) if mode == "sin" else torch.cos(x)) * scale
        for _ in range(n):
            y = y * x
        return {"y": y, "n": n, "name": mode, "extra": extra, "ints": torch.arange(3)}

    x = torch.randn(5, requires_grad=True)
    out = checkpoint(f, x, 2, scale=3.0, mode="cos", extra=[1, "a"], use_reentrant=use_reentrant)
    ref = f(x, 2, scale=3.0, mode="cos", extra=[1, "a"])
    assert out["n"] == 2 and out["name"] == "cos" and out["extra"] == [1, "a"]
    assert torch.equal(out["ints"], ref["ints"]) and not out["ints"].requires_grad
    torch.testing.assert_close(torch.autograd.grad(out["y"].sum(), x)[0],
                               torch.autograd.grad(ref["y"].sum(), x)[0])


def test_inputs_not_requiring_grad_module_parameters_get_grads():
    # torch: non-reentrant checkpoint gives parameter grads even when no input requires grad
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)  # requires_grad=False
    out = checkpoint(lambda t: torch.relu(lin(t)).sum(), x, use_reentrant=True)
    out.backward()
    g = [p.grad.clone() for p in lin.parameters()]
    for p in lin.parameters():
        p.grad = None
    torch.relu(lin(x)).sum().backward()
    assert_tree_close(g, [p.grad for p in lin.parameters()])


def test_nested_structures_input():
    def f(d):
        return d["a"][0] * d["a"][1].exp() + d["b"].sin()

    a0, a1, b = _leaves(torch.randn(3), torch.randn(3), torch.randn(3))
    out = checkpoint(f, {"a": [a0, a1], "b": b})
    assert_tree_close(torch.autograd.grad(out.sum(), (a0, a1, b)),
                      torch.autograd.grad(f({"a": [a0, a1], "b": b}).sum(), (a0, a1, b)))


def test_retain_graph_twice_and_autograd_grad():
    def f(x):
        return x.sin().exp().cos()

    x = torch.randn(5, requires_grad=True)
    out = checkpoint(f, x).sum()
    g1 = torch.autograd.grad(out, x, retain_graph=True)[0]
    g2 = torch.autograd.grad(out, x)[0]
    ref = torch.autograd.grad(f(x).sum(), x)[0]
    assert torch.equal(g1, g2)
    torch.testing.assert_close(g1, ref)
    y = checkpoint(f, x).sum()
    y.backward(retain_graph=True)
    y.backward()
    torch.testing.assert_close(x.grad, 2 * ref)


def test_create_graph_double_backward():
    x = torch.randn(4, requires_grad=True)
    f = lambda t: t.sin() * t.pow(3)  # noqa: E731
    (g,) = torch.autograd.grad(checkpoint(f, x).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    (g0,) = torch.autograd.grad(f(x).sum(), x, create_graph=True)
    torch.testing.assert_close(gg, torch.autograd.grad(g0.sum(), x)[0])


def test_nested_checkpoint():
    def inner(x):
        return x.sin().cos()

    def outer(x):
        return checkpoint(inner, x).exp() * x

    x = torch.randn(4, requires_grad=True)
    torch.testing.assert_close(torch.autograd.grad(checkpoint(outer, x).sum(), x)[0],
                               torch.autograd.grad((inner(x).exp() * x).sum(), x)[0])


def _non_det(first, then):
    calls = [0]

    def fn(x):
        calls[0] += 1
        return first(x) if calls[0] == 1 else then(x)

    return fn


def test_determinism_check():
    def save2(x):
        return x.sin().exp()

    def save2_alt(x):  # same count, different shape
        return x.sin() * torch.tensor([1.0, 2.0])

    a = torch.randn(1, requires_grad=True)
    out = checkpoint(_non_det(save2, save2_alt), a, determinism_check="default")
    # Deviation from torch (which raises here): backward replays the recorded forward
    # instead of running the function again, so there is nothing to mismatch and the
    # gradient is the one of the forward that ran (docs/migration.md).
    torch.testing.assert_close(torch.autograd.grad(out.sum(), a)[0], torch.autograd.grad(save2(a).sum(), a)[0])
    # a re-run is still checked where one happens (early_stop=False re-runs the function)
    out = checkpoint(_non_det(save2, save2_alt), a, determinism_check="default", early_stop=False)
    with pytest.raises(RuntimeError, match="did not reproduce"):
        out.sum().backward()
    with pytest.raises(ValueError, match="determinism_check"):
        checkpoint(save2, a, determinism_check="strict")
    # "none" is accepted; a deterministic function is unaffected
    out = checkpoint(save2, a, determinism_check="none")
    torch.testing.assert_close(torch.autograd.grad(out.sum(), a)[0], torch.autograd.grad(save2(a).sum(), a)[0])


def test_debug_shows_op_traces():
    a = torch.randn(1, requires_grad=True)
    fn = _non_det(lambda x: x.sin().exp(), lambda x: x.sin() * torch.tensor([1.0, 2.0]))
    out = checkpoint(fn, a, debug=True)
    with pytest.raises(remat_fn.RecomputeMismatchError, match="forward ops"):
        out.sum().backward()
    # the global switch of torch.utils.checkpoint is honoured too
    fn = _non_det(lambda x: x.sin().exp(), lambda x: x.sin() * torch.tensor([1.0, 2.0]))
    with tc.set_checkpoint_debug_enabled(True):
        out = checkpoint(fn, a, debug=False)
    with pytest.raises(remat_fn.RecomputeMismatchError, match="forward ops"):
        out.sum().backward()


@pytest.mark.parametrize("early_stop", [True, False])
def test_early_stop_flag(early_stop):
    calls = []

    def f(x):
        y = x.sin().exp()  # exp saves its output: backward recomputes the region
        calls.append(1)
        return y + 1  # the add saves nothing

    x = torch.randn(3, requires_grad=True)
    out = checkpoint(f, x, early_stop=early_stop)
    assert calls == [1]
    (g,) = torch.autograd.grad(out.sum(), x)
    # with early stop the recomputation ends at exp's output, before the Python tail;
    # without it the whole function runs again
    assert calls == ([1] if early_stop else [1, 1])
    calls.clear()
    torch.testing.assert_close(g, torch.autograd.grad(f(x).sum(), x)[0])


@pytest.mark.parametrize("preserve", [True, False])
def test_rng_preservation_with_dropout(preserve):
    drop = torch.nn.Dropout(0.5)

    def f(x):
        return drop(x.sin()) * x

    x = torch.randn(64, requires_grad=True)
    torch.manual_seed(7)
    ref = torch.autograd.grad(f(x).sum(), x)[0]
    after_ref = torch.rand(3)
    torch.manual_seed(7)
    out = checkpoint(f, x, preserve_rng_state=preserve)
    g = torch.autograd.grad(out.sum(), x)[0]
    after = torch.rand(3)
    # Deviation from torch (whose recompute draws a different mask without
    # preserve_rng_state): random ops replay the state recorded with them, so the
    # gradient is exact either way (docs/migration.md).
    assert torch.equal(g, ref)
    assert torch.equal(after, after_ref)  # the caller's RNG stream is untouched


@pytest.mark.parametrize("segments", [1, 2, 3, 6, 9])
@pytest.mark.parametrize("as_list", [False, True])
def test_checkpoint_sequential(segments, as_list):
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[m for _ in range(3) for m in (torch.nn.Linear(5, 5), torch.nn.Dropout(0.2), torch.nn.Tanh())])
    x = torch.randn(4, 5, requires_grad=True)
    torch.manual_seed(1)
    ref = torch.autograd.grad(net(x).sum(), (x, *net.parameters()))
    torch.manual_seed(1)
    out = checkpoint_sequential(list(net) if as_list else net, segments, x, use_reentrant=False,
                                preserve_rng_state=True)
    assert_tree_close(torch.autograd.grad(out.sum(), (x, *net.parameters())), ref, exact=True)


def test_checkpoint_sequential_runs_a_repeated_module_each_time():
    """A module held twice by an ``nn.Sequential`` runs twice, as ``seq(x)`` runs it (torch's
    checkpoint_sequential takes ``children()``, which lists it once: another network, silently)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3)
    seq = torch.nn.Sequential(lin, torch.nn.Tanh(), lin, torch.nn.Tanh())
    x = torch.randn(2, 3, requires_grad=True)
    ref = torch.autograd.grad(seq(x).sum(), (x, *seq.parameters()))
    for out in (checkpoint_sequential(seq, 2, x, use_reentrant=False), remat_fn.remat_sequential(seq, 2, x)):
        torch.testing.assert_close(out, seq(x))
        assert_tree_close(torch.autograd.grad(out.sum(), (x, *seq.parameters())), ref, exact=True)
    # an empty Sequential is the identity, as nn.Sequential()(x) (torch raises a ValueError)
    assert checkpoint_sequential(torch.nn.Sequential(), 1, x, use_reentrant=False) is x
    with pytest.raises(ValueError, match="segments must be a positive int"):
        checkpoint_sequential(seq, 0, x, use_reentrant=False)


def test_recompute_mismatch_is_torchs_checkpoint_error():
    """A recomputation checked and found different raises what torch's checkpoint raises there
    (``CheckpointError``), also a ``RematError``: code catching either catches it."""
    a = torch.randn(1, requires_grad=True)
    fn = _non_det(lambda x: x.sin().exp(), lambda x: x.sin() * torch.tensor([1.0, 2.0]))
    out = checkpoint(fn, a, early_stop=False)
    with pytest.raises(tc.CheckpointError, match="did not reproduce") as info:
        out.sum().backward()
    assert isinstance(info.value, remat_fn.RecomputeMismatchError) and isinstance(info.value, remat_fn.RematError)


def test_distributed_checkpoint_called_as_deepspeeds_names_the_fix():
    from remat_fn import distributed

    with pytest.raises(TypeError, match=r"remat_fn.compat.checkpoint\(fn, \*args\)"):
        distributed.checkpoint(torch.sin, torch.randn(2))
    torch.testing.assert_close(distributed.checkpoint(torch.sin)(torch.ones(2)), torch.ones(2).sin())


def test_checkpoint_sequential_unexpected_kwargs():
    with pytest.raises(ValueError, match="Unexpected keyword"):
        checkpoint_sequential([torch.sin], 1, torch.randn(2), foo=1)


def test_no_grad_runs_plainly():
    entered = []

    @contextlib.contextmanager
    def ctx(tag):
        entered.append(tag)
        yield

    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        out = checkpoint(torch.sin, x, context_fn=lambda: (ctx("f"), ctx("r")))
    assert not out.requires_grad and entered == []


def test_generic_context_fn_forward_and_recompute():
    entered = []

    class Tag:
        def __init__(self, tag):
            self.tag = tag

        def __enter__(self):
            entered.append(self.tag)

        def __exit__(self, *exc):
            return False

    x = torch.randn(3, requires_grad=True)
    out = checkpoint(lambda t: t.sin().exp(), x, context_fn=lambda: (Tag("fwd"), Tag("rec")))
    assert entered == ["fwd"]
    out.sum().backward(retain_graph=True)
    assert entered == ["fwd", "rec"]
    out.sum().backward()
    assert entered == ["fwd", "rec", "rec"]
    # and under torch.func
    entered.clear()
    g = grad(lambda t: checkpoint(lambda u: u.sin().exp(), t, context_fn=lambda: (Tag("fwd"), Tag("rec"))).sum())(x.detach())
    torch.testing.assert_close(g, (x.detach().sin().exp() * x.detach().cos()))
    assert entered[0] == "fwd" and set(entered[1:]) == {"rec"}


def _mm_fn(x, y):
    return torch.sigmoid(torch.matmul(torch.matmul(x, y), y)) * y


@pytest.mark.parametrize("as_list", [True, False])
def test_selective_checkpoint_context_fn(as_list):
    ops = [torch.ops.aten.mm.default]

    def policy_fn(ctx, op, *args, **kwargs):
        return tc.CheckpointPolicy.MUST_SAVE if op in ops else tc.CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(tc.create_selective_checkpoint_contexts, ops if as_list else policy_fn)
    x, y = _leaves(torch.randn(4, 4), torch.randn(4, 4))
    ref = torch.autograd.grad(_mm_fn(x, y).sum(), (x, y))
    mm_in_backward = []

    class CountMM(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mm.default:
                mm_in_backward.append(1)
            return func(*args, **(kwargs or {}))

    out = checkpoint(_mm_fn, x, y, context_fn=context_fn, use_reentrant=False)
    with CountMM():
        g = torch.autograd.grad(out.sum(), (x, y))
    assert_tree_close(g, ref)
    # the 4 gradient mm's only, as torch's SAC: the second forward mm's output feeds
    # sigmoid, whose saved output is recomputed from it, so it is kept (JAX's rule)
    assert len(mm_in_backward) == 4
    # and under torch.func, where torch's SAC fails
    gf = grad(lambda a, b: checkpoint(_mm_fn, a, b, context_fn=context_fn).sum(), argnums=(0, 1))(x.detach(), y.detach())
    assert_tree_close(gf, ref)


# ----------------------------------------------------------------------------- torch.func
def _block(x, w, *, p=0.0):
    return torch.tanh(x @ w).sin() * x


def test_torch_checkpoint_fails_under_grad_compat_works():
    x, w = torch.randn(3, 4), torch.randn(4, 4)

    def loss(ck, w, x):
        return ck(_block, x, w, use_reentrant=False).pow(2).sum()

    with pytest.raises(RuntimeError):
        grad(loss, argnums=1)(tc.checkpoint, w, x)
    ref = grad(lambda w, x: _block(x, w).pow(2).sum())(w, x)
    torch.testing.assert_close(grad(loss, argnums=1)(checkpoint, w, x), ref)


def test_vmap_grad_and_jacrev():
    x, w = torch.randn(5, 4), torch.randn(4, 4)

    def loss(w, x, ck):
        return ck(_block, x, w).pow(2).sum() if ck else _block(x, w).pow(2).sum()

    vg = vmap(grad(loss), in_dims=(None, 0, None))
    assert_tree_close(vg(w, x, checkpoint), vg(w, x, None), rtol=1e-5, atol=1e-6)
    jr = jacrev(lambda x: checkpoint(_block, x, w))(x[0])
    torch.testing.assert_close(jr, jacrev(lambda x: _block(x, w))(x[0]))


class _Net(torch.nn.Module):
    def __init__(self, use_checkpoint):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.drop = torch.nn.Dropout(0.3)
        self.use_checkpoint = use_checkpoint

    def body(self, x, *, scale):
        return self.drop(torch.relu(self.lin(x))) * scale

    def forward(self, x):
        if self.use_checkpoint:
            return checkpoint(self.body, x, scale=2.0, use_reentrant=False)
        return self.body(x, scale=2.0)


def test_functional_call_grad_with_dropout_and_kwargs():
    torch.manual_seed(0)
    net = _Net(True)
    params = {k: v.detach() for k, v in net.named_parameters()}

    def loss(p, x, use):
        net.use_checkpoint = use
        return torch.func.functional_call(net, p, (x,)).pow(2).sum()

    x = torch.randn(3, 4)
    torch.manual_seed(3)
    ref = grad(loss)(params, x, False)
    torch.manual_seed(3)
    got = grad(loss)(params, x, True)
    assert_tree_close(got, ref, exact=True)
    vg = vmap(grad(loss), in_dims=(None, 0, None), randomness="same")
    torch.manual_seed(4)
    ref = vg(params, x, False)
    torch.manual_seed(4)
    assert_tree_close(vg(params, x, True), ref, rtol=1e-5, atol=1e-6)


# -- torch's checkpoint_wrapper / apply_activation_checkpointing --------------------
class _Blk(torch.nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.lin1, self.lin2 = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.lin2(torch.tanh(self.lin1(x)))


class _Model(torch.nn.Module):
    def __init__(self, n=3, d=8):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(_Blk(d) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()


def _wrapped(mode):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    model, calls = _Model(), [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return checkpoint(*args, **kwargs)

    if mode == "apply":
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_fn=counted),
            check_fn=lambda m: isinstance(m, _Blk))
    else:
        for i, b in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(b, checkpoint_fn=counted)
    return model, calls


@pytest.mark.parametrize("mode", ["checkpoint_wrapper", "apply"])
def test_checkpoint_wrapper_eager_training_equals_no_checkpointing(mode):
    x = torch.randn(4, 8)
    ref = _Model()
    model, calls = _wrapped(mode)
    for m in (ref, model):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            m(x).backward()
            opt.step()
    assert calls[0] == 3 * 3
    assert_tree_close([p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()],
                      exact=True)


@pytest.mark.parametrize("mode", ["checkpoint_wrapper", "apply"])
def test_checkpoint_wrapper_under_functional_call_and_grad(mode):
    x = torch.randn(4, 8)
    ref = _Model()
    model, calls = _wrapped(mode)
    params = {k: v.detach() for k, v in model.named_parameters()}
    ref_params = {k: v.detach() for k, v in ref.named_parameters()}
    g = grad(lambda p: functional_call(model, p, (x,)))(params)
    g_ref = grad(lambda p: functional_call(ref, p, (x,)))(ref_params)
    assert calls[0] == 3
    strip = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in g.items()}
    assert_tree_close(strip, g_ref, exact=True)
