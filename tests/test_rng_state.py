"""preserve_rng_state: global-RNG code recomputes bitwise-identically, at no cost without RNG."""

from __future__ import annotations

import pytest
import torch
from torch.func import grad, vmap

from remat_fn import remat
from remat_fn._rng_state import RNGSnapshot

from ._util import assert_tree_close


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
