"""remat_fn._region: options validated once, one call normalised once."""

from __future__ import annotations

import pytest
import torch

from remat_fn import policies
from remat_fn._budget import BudgetPlanner
from remat_fn._region import Options, RegionCall, entered, region_depth


def test_options_normalise_and_validate():
    o = Options.create(policy=[torch.ops.aten.mm.default], static_argnums=1, static_argnames="mode")
    assert o.static_argnums == (1,) and o.static_argnames == frozenset({"mode"})
    assert callable(o.policy) and o.planner is None
    assert isinstance(Options.create(policy=policies.memory_budget(0.5)).planner, BudgetPlanner)
    with pytest.raises(TypeError, match="static_argnums must contain ints"):
        Options.create(static_argnums=("a",))
    with pytest.raises(TypeError, match="preserve_rng_state must be a bool"):
        Options.create(preserve_rng_state=1)
    assert Options.create(debug=True).public()["debug"] is True


def test_region_call_splits_statics_flattens_once_and_rebuilds():
    calls = []

    def fun(x, mode, *, y, scale):
        calls.append(mode)
        return {"out": x * y["w"] * scale, "mode": mode}

    opts = Options.create(static_argnums=1, static_argnames="scale")
    x, w = torch.ones(2), torch.full((2,), 3.0)
    call = RegionCall(fun, "fun", opts, (x, "fast"), {"y": {"w": w}, "scale": 2.0})
    assert call._leaves is None  # nothing flattened until a path asks
    assert [t is x or t is w for t in call.inputs] == [True, True]
    outs, rebuild = call.run([torch.zeros(2), w])
    assert calls == ["fast"] and len(outs) == 1
    out = rebuild(outs)
    assert out["mode"] == "fast" and torch.equal(out["out"], torch.zeros(2))
    assert call.reach_roots() is not fun  # statics and non-tensor leaves are walked too


def test_region_call_checks_static_argnums_against_the_call():
    call = RegionCall(lambda x: x, "f", Options.create(static_argnums=3), (torch.ones(1),), {})
    with pytest.raises(ValueError, match="static_argnums contains 3"):
        call.check_argnums()


def test_region_depth_counts_nested_regions():
    assert region_depth() == 0
    with entered():
        with entered():
            assert region_depth() == 2
    assert region_depth() == 0


def test_per_thread_state_starts_fresh_in_every_thread():
    """A region's thread-local state (nesting depth, mode stacks, profile, residual
    sink) has its defaults in a new thread, and threads running regions at the
    same time do not see each other's: gradients equal plain in each."""
    import threading

    from torch.func import grad

    import remat_fn

    def f(x, w):
        return (torch.tanh(x @ w) * 2).sin().sum()

    rf = remat_fn.remat(f)
    errors: list = []
    barrier = threading.Barrier(2)

    def work(seed: int) -> None:
        try:
            g = torch.Generator().manual_seed(seed)
            x, w = torch.randn(4, 5, generator=g), torch.randn(5, 5, generator=g)
            assert region_depth() == 0
            barrier.wait()
            for _ in range(20):
                a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
                rf(a, b).backward()
                pa, pb = x.clone().requires_grad_(), w.clone().requires_grad_()
                f(pa, pb).backward()
                torch.testing.assert_close(a.grad, pa.grad, rtol=0, atol=0)
                torch.testing.assert_close(b.grad, pb.grad, rtol=0, atol=0)
                torch.testing.assert_close(grad(rf, argnums=1)(x, w), grad(f, argnums=1)(x, w))
            with remat_fn.profile() as prof:
                rf(x.requires_grad_(), w).backward()
            assert [r.calls for r in prof.regions.values()] == [1], prof.regions
            assert region_depth() == 0
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert region_depth() == 0
