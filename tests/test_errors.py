"""Every error names the fix and leaves no hook, mode or RNG state behind."""

from __future__ import annotations

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
