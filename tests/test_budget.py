"""memory_budget: saved bytes within the budget, recompute cost near the optimum."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import grad

from remat_fn import policies as P
from remat_fn import remat
from remat_fn._budget import solve
from remat_fn._transform import _Budgeted
from remat_fn.memory import LiveBytes

from ._util import assert_tree_close

D = 64


def block(x, w1, w2, g):
    h = torch.nn.functional.layer_norm(x, (x.shape[-1],), g)
    a = h @ w1
    b = torch.tanh(a) * torch.sigmoid(a)
    c = torch.nn.functional.gelu(b @ w2)
    return (c.exp() * 0.1 + h).sin()


@pytest.fixture(scope="module")
def data():
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(128, D, generator=gen), torch.randn(D, 4 * D, generator=gen) / 8,
            torch.randn(4 * D, D, generator=gen) / 16, torch.randn(D, generator=gen))


def _live_after_forward(fn, x, ws):
    ws = [w.clone().requires_grad_() for w in ws]
    with LiveBytes() as m:
        y = fn(x, *ws)
        live = m.live - y.untyped_storage().nbytes()
    return live, y


def _brute_force(items, capacity):
    best = None
    for r in range(len(items) + 1):
        for combo in itertools.combinations(items, r):
            if sum(b for _, b, _ in combo) <= capacity:
                cost = sum(c for _, _, c in items) - sum(c for _, _, c in combo)
                best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5, 0.75])
def test_budget_bytes_and_optimality(data, fraction):
    x, *ws = data
    plain, _ = _live_after_forward(block, x, ws)
    rb = remat(block, policy=P.memory_budget(fraction))
    got, y = _live_after_forward(rb, x, ws)
    assert got <= fraction * plain, (got, fraction * plain)
    # the plan against exhaustive search over the same graph
    planner = _Budgeted(P.memory_budget(fraction))
    wsr = [w.clone().requires_grad_() for w in ws]
    plan = planner.plan_eager(block, (x, *wsr), {})
    assert plan.reference_bytes == plain
    assert len(plan.items) <= 16
    opt = _brute_force(plan.items, fraction * plan.reference_bytes)
    assert plan.recompute_cost <= 1.10 * opt + 1e-9, (plan.recompute_cost, opt)
    # gradients are exact
    ref = torch.autograd.grad(block(x, *wsr).sum(), wsr)
    assert_tree_close(torch.autograd.grad(rb(x, *wsr).sum(), wsr), ref, exact=True)


@pytest.mark.parametrize("fraction", [0.1, 0.5])
def test_budget_under_grad(data, fraction):
    x, *ws = data

    def f(blk):
        def loss(ws):
            h = x
            for _ in range(4):  # a stack: the transient of one region is small
                h = blk(h, *ws)
            return h.sum()
        return loss

    ref = grad(f(block))(ws)
    with LiveBytes() as m_plain:
        grad(f(block))(ws)
    rb = remat(block, policy=P.memory_budget(fraction))
    got = grad(f(rb))(ws)  # first call plans
    with LiveBytes() as m:
        got = grad(f(rb))(ws)
    assert_tree_close(got, ref, exact=True)
    assert m.peak < m_plain.peak


def test_plan_is_cached_per_signature(data, monkeypatch):
    from remat_fn import _budget

    calls = []
    orig = _budget.measure
    monkeypatch.setattr(_budget, "measure", lambda run: calls.append(1) or orig(run))
    x, *ws = data
    rb = remat(block, policy=P.memory_budget(0.5))
    wsr = [w.clone().requires_grad_() for w in ws]
    for _ in range(3):
        rb(x, *wsr).sum().backward()
    rb(x[:64], *wsr).sum().backward()
    assert len(calls) == 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 1000), st.floats(0.1, 1000)), min_size=1, max_size=10),
       st.floats(0.0, 1.0))
def test_knapsack_near_optimal(pairs, frac):
    items = [(i, b, c) for i, (b, c) in enumerate(pairs)]
    capacity = frac * sum(b for _, b, _ in items)
    keys = set(solve(items, capacity))
    assert sum(b for k, b, _ in items if k in keys) <= capacity + 1e-9
    cost = sum(c for k, _, c in items if k not in keys)
    opt = _brute_force(items, capacity)
    assert cost <= 1.10 * opt + 1e-6
