"""Every error names the fix and leaves no hook, mode or RNG state behind."""

from __future__ import annotations

import inspect
import pickle

import pytest
import torch
from torch.func import grad

import remat_fn
from remat_fn import MutatedSavedTensorError, RecomputeMismatchError, RematError, remat


def test_error_hierarchy():
    for cls in (RecomputeMismatchError, MutatedSavedTensorError, remat_fn.PolicyError):
        assert issubclass(cls, RematError)
    assert issubclass(RematError, RuntimeError)


def _flaky(counter):
    def f(x):
        counter[0] += 1
        n = 3 if counter[0] == 1 else 4  # shape differs on recompute
        return (x[:n].sin() * 2).sum() + x.sum()
    return f


def _rerun(f):
    """``f`` checkpointed so that eager backward really re-runs it (and checks the re-run)."""
    return lambda *a: remat_fn.compat.checkpoint(f, *a, use_reentrant=False, early_stop=False)


def test_recompute_shape_mismatch_eager_names_fix():
    # changed (issue 19): the default eager backward replays the recorded ops and does
    # not re-run the function, so it gets the forward's gradient and raises nothing
    x = torch.randn(5, requires_grad=True)
    remat(_flaky([0]))(x).backward()
    xp = x.detach().clone().requires_grad_()
    _flaky([0])(xp).backward()
    torch.testing.assert_close(x.grad, xp.grad)
    # a re-run (compat early_stop=False) is checked, and the error names the fix
    y = _rerun(_flaky([0]))(x)
    with pytest.raises(RecomputeMismatchError, match="debug=True"):
        y.backward()


def test_recompute_mismatch_debug_shows_both_traces_with_source_lines():
    x = torch.randn(5, requires_grad=True)
    y = remat(_flaky([0]), debug=True)(x)
    with pytest.raises(RecomputeMismatchError) as ei:
        y.backward()
    msg = str(ei.value)
    assert "forward ops:" in msg and "recompute ops:" in msg
    assert "aten.sin" in msg and "test_errors.py" in msg


def test_recompute_count_mismatch_eager():
    state = {"n": 0}

    def f(x):
        state["n"] += 1
        y = x.sin()
        if state["n"] == 1:
            y = y.exp()  # an extra saved tensor only in the forward
        return y.sum()

    # changed (issue 19): the default eager backward does not re-run f: forward's gradient
    x = torch.randn(4, requires_grad=True)
    remat(f)(x).backward()
    torch.testing.assert_close(x.grad, (x.sin().exp() * x.cos()).detach())
    # a re-run (compat early_stop=False) is checked against the forward
    state["n"] = 0
    y = _rerun(f)(x)
    with pytest.raises(RecomputeMismatchError, match="saved"):
        y.backward()


def test_recompute_mismatch_under_grad():
    counter = [0]

    def f(x):
        counter[0] += 1
        return x[: 3 if counter[0] == 1 else 4].sin()

    # changed (issue 19): the default backward replays the recorded forward, so only a
    # re-run (debug=True) can mismatch
    with pytest.raises(RecomputeMismatchError, match="static_argnums"):
        grad(lambda x: remat(f, debug=True)(x).sum())(torch.randn(5))


def test_mutated_input_eager():
    x = torch.randn(4)
    w = torch.randn(4, requires_grad=True)
    y = remat(lambda x, w: (x * w).sin().sum())(x, w)
    x.add_(1.0)
    with pytest.raises(MutatedSavedTensorError, match="clone"):
        y.backward()


def test_mutated_weight_eager():
    w = torch.randn(4, requires_grad=True)
    x = torch.randn(4)
    y = remat(lambda x: (x * w).sin().sum())(x)
    with torch.no_grad():
        w.mul_(2)
    with pytest.raises(MutatedSavedTensorError):
        y.backward()


def test_mutated_input_functorch_path():
    x = torch.randn(4)
    w = torch.randn(4)
    out, vjp_fn = torch.func.vjp(remat(lambda x, w: (x * w).sin().sum()), x, w)
    w.add_(1.0)
    with pytest.raises(MutatedSavedTensorError, match="clone"):
        vjp_fn(torch.tensor(1.0))


def test_mutated_unsaved_constant_functorch_path():
    x = torch.randn(4)
    c = torch.randn(4)  # closed over, needs no gradient, so not an input
    out, vjp_fn = torch.func.vjp(remat(lambda x: (x * c).sin().sum()), x)
    c.add_(1.0)
    with pytest.raises(MutatedSavedTensorError, match="clone"):
        vjp_fn(torch.tensor(1.0))


def test_failing_function_leaves_no_state_behind():
    def boom(x):
        torch.rand(3)  # advance the RNG inside the region
        raise ValueError("user error")

    x = torch.randn(3, requires_grad=True)
    state = torch.get_rng_state()
    for call in (lambda: remat(boom)(x), lambda: grad(lambda x: remat(boom)(x))(x.detach())):
        with pytest.raises(ValueError, match="user error"):
            call()
    # the region drew random numbers before failing; that is the user's RNG use,
    # but nothing of ours is left: hooks, modes (checked by the autouse fixture)
    assert torch.get_rng_state().shape == state.shape


def test_error_in_backward_leaves_no_hooks():
    x = torch.randn(5, requires_grad=True)
    # changed (issue 19): only a re-run of the function (here compat early_stop=False)
    # can fail in backward; the default eager backward replays the recorded ops
    y = _rerun(_flaky([0]))(x)
    with pytest.raises(RecomputeMismatchError):
        y.backward()
    # a later plain checkpoint still works (hooks are usable)
    z = torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=False)
    z.sum().backward()


def test_region_mutating_its_input_is_refused():
    def f(x, w):
        x.mul_(2)
        return (x * w).sin().sum()

    w = torch.randn(3, requires_grad=True)
    # changed (issue 19): eager replays from the copy taken before the write (exact);
    # the torch.func path, which re-runs the function, still refuses
    x = torch.randn(3)
    x1, x2 = x.clone(), x.clone()
    (g,) = torch.autograd.grad(remat(f)(x1, w), w)
    (ref,) = torch.autograd.grad(f(x2, w), w)
    torch.testing.assert_close(g, ref)
    torch.testing.assert_close(x1, x2)
    with pytest.raises(RematError, match="clone"):
        torch.func.grad(lambda w: remat(f)(torch.randn(3), w))(w.detach())


def test_decorator_called_without_a_function_names_the_fix():
    # remat(policy=...)(x, w1, w2): the function was forgotten
    x, w1, w2 = torch.randn(2, 4), torch.randn(4, 4), torch.randn(4, 4)
    deco = remat(policy=remat_fn.policies.dots_saveable)
    for call in (lambda: deco(x, w1, w2), lambda: deco(x), lambda: deco(x, policy=None), lambda: deco()):
        with pytest.raises(TypeError, match=r"returns a decorator: call it on a function first, "
                                            r"remat\(fn, policy=\.\.\.\)\(x, \.\.\.\)") as ei:
            call()
        assert "multiple values" not in str(ei.value)
    with pytest.raises(TypeError, match=r"with \(Tensor, Tensor, Tensor\)"):
        deco(x, w1, w2)
    # the decorator itself still works, on functions and modules
    f = deco(lambda x, w1, w2: torch.tanh(x @ w1) @ w2)
    torch.testing.assert_close(f(x, w1, w2), torch.tanh(x @ w1) @ w2)
    lin = torch.nn.Linear(4, 4)
    torch.testing.assert_close(remat(policy=None)(lin)(x), lin(x))


# -- torch habits: each error names the fix (or the habit simply works) --------------


def test_checkpoint_called_with_arguments_as_torch_names_remat_fn_and_compat():
    # remat_fn.checkpoint is JAX's alias of remat: it takes the function only
    x, w = torch.randn(2, 4), torch.randn(4, 4)

    def block(x, w):
        return torch.tanh(x @ w)

    for call in (lambda: remat_fn.checkpoint(block, x, w), lambda: remat(block, x),
                 lambda: remat_fn.checkpoint(block, use_reentrant=False)):
        with pytest.raises(TypeError, match=r"remat\(fn\)\(\*args\).*remat_fn\.compat\.checkpoint\(fn, \*args\)"):
            call()
    # the two forms it points at give the plain result
    torch.testing.assert_close(remat_fn.checkpoint(block)(x, w), block(x, w))
    torch.testing.assert_close(remat_fn.compat.checkpoint(block, x, w), block(x, w))
    # other misuses keep their own message
    with pytest.raises(TypeError, match="expects a callable"):
        remat(3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'polcy'") as ei:
        remat(block, polcy=None)
    assert "compat" not in str(ei.value)


def test_a_single_op_as_policy_means_a_list_of_one():
    # policy=torch.ops.aten.mm.default: save that op's outputs, as policy=[op] does
    x = torch.randn(4, 8, requires_grad=True)
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)

    def block(x):
        return torch.tanh(torch.tanh(x @ w1) @ w2)

    for op in (torch.ops.aten.mm.default, torch.ops.aten.mm):
        one, listed = remat(block, policy=op), remat(block, policy=[op])
        kept = [(r.op, r.shape) for r in remat_fn.saved_residuals(one, x) if r.kind == "saved"]
        assert kept == [(r.op, r.shape) for r in remat_fn.saved_residuals(listed, x) if r.kind == "saved"]
        assert kept and all("mm" in str(o) for o, _ in kept), kept
        torch.testing.assert_close(torch.autograd.grad(one(x).sum(), (x, w1, w2)),
                                   torch.autograd.grad(block(x).sum(), (x, w1, w2)))
        torch.testing.assert_close(grad(lambda x: one(x).sum())(x.detach()),
                                   grad(lambda x: block(x).sum())(x.detach()))
    # remat_module takes it too, and the module pickles with it
    lin = remat_fn.nn.remat_module(torch.nn.Linear(8, 8), policy=torch.ops.aten.addmm.default)
    twin = pickle.loads(pickle.dumps(lin))
    torch.testing.assert_close(torch.autograd.grad(twin(x).sum(), x), torch.autograd.grad(lin(x).sum(), x))


def test_apply_remat_takes_a_module_class_as_isinstance():
    # torch habit: apply_remat(model, nn.Linear) (FSDP wrap policies take classes)
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))

    is_remat = remat_fn.nn.is_remat_module
    for check in (torch.nn.Linear, (torch.nn.Linear,), lambda m: isinstance(m, torch.nn.Linear)):
        model = remat_fn.nn.apply_remat(net(), check)
        assert [is_remat(m) for m in model] == [True, False, True]
    model = remat_fn.nn.apply_remat(net(), (torch.nn.Linear, torch.nn.ReLU))
    assert [is_remat(m) for m in model] == [True, True, True]
    x = torch.randn(3, 2, requires_grad=True)
    torch.testing.assert_close(torch.autograd.grad(model(x).sum(), x), torch.autograd.grad(net()(x).sum(), x))
    # anything else names the forms it takes
    for bad in ("Linear", 3, ()):
        with pytest.raises(TypeError, match=r"check_fn must be a function.*Fix: e\.g\. apply_remat\(model"):
            remat_fn.nn.apply_remat(net(), bad)


def test_dropout_without_a_key_names_the_fix():
    x = torch.randn(4, 8)
    for call in (lambda: remat_fn.random.dropout(x, p=0.1), lambda: remat_fn.random.dropout(x, 0.1),
                 lambda: remat_fn.random.dropout(x)):
        with pytest.raises(TypeError, match=r"takes an explicit key first: dropout\(key, x, p\).*"
                                            r"remat_fn\.random\.key\(0\).*torch\.nn\.functional\.dropout"):
            call()
    # a data tensor passed as the key (three arguments: it binds) is named as such
    with pytest.raises(TypeError, match=r"key is the first argument, remat_fn\.random\.dropout\(key, \.\.\.\)"):
        remat_fn.random.dropout(x, 0.1, True)
    # the signature documented is the function's own
    assert list(inspect.signature(remat_fn.random.dropout).parameters) == ["key", "x", "p", "training"]
    assert remat_fn.random.dropout(remat_fn.random.key(0), x, 0.0) is x
