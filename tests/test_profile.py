"""remat_fn.profile(): per-region calls, times and bytes, on both autograd paths."""

from __future__ import annotations

import pytest
import torch
from torch.func import grad

import remat_fn
from remat_fn import policies, remat, saved_residuals
from remat_fn.memory import LiveBytes


def block(x, w1, w2):
    return x + torch.tanh(x @ w1) @ w2


def _args(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(64, 32, generator=g), torch.randn(32, 48, generator=g),
            torch.randn(48, 32, generator=g))


def _total(res):
    return sum(r.nbytes for r in res)


@pytest.mark.parametrize("policy", [None, policies.dots_saveable, policies.save_anything_except_these_names()])
def test_bytes_match_saved_residuals(policy):
    f = remat(block, policy=policy)
    x, w1, w2 = (t.requires_grad_() for t in _args())
    with remat_fn.profile() as prof:
        f(x, w1, w2).sum().backward()
    r = prof.regions["block"]
    assert r.calls == 1
    assert r.kept_bytes == _total(saved_residuals(f, *_args()))
    assert r.plain_bytes == _total(saved_residuals(block, *_args()))
    assert r.kept_bytes <= r.plain_bytes  # equal when the policy keeps everything autograd saves


def sin_block(x, w1, w2):
    return x + torch.sin(x @ w1) @ w2  # sin saves its input: the matmul output


def test_kept_intermediates_match_the_memory_meter():
    f = remat(sin_block, policy=policies.dots_saveable)
    x, w1, w2 = (t.requires_grad_() for t in _args())
    with remat_fn.profile() as prof, LiveBytes() as meter:
        out = f(x, w1, w2)
        live = meter.live  # what the region created and still holds, plus its output
    inputs = sum(t.untyped_storage().nbytes() for t in (x, w1, w2))
    held = live - out.untyped_storage().nbytes()
    assert prof.regions["sin_block"].kept_bytes - inputs == held > 0


@pytest.mark.parametrize("policy", [None, policies.dots_saveable])
def test_torch_func_path_reports_the_same_bytes_as_eager(policy):
    f = remat(block, policy=policy)
    with remat_fn.profile() as eager:
        x, w1, w2 = (t.requires_grad_() for t in _args())
        f(x, w1, w2).sum().backward()
    with remat_fn.profile() as func:
        grad(lambda a, b, c: f(a, b, c).sum(), argnums=(0, 1, 2))(*_args())
    e, fn = eager.regions["block"], func.regions["block"]
    assert (fn.calls, fn.recomputes) == (1, 1)
    assert fn.plain_bytes == e.plain_bytes
    assert fn.kept_bytes == e.kept_bytes


def test_recompute_is_recorded_when_backward_runs_after_the_block():
    f = remat(block)
    x, w1, w2 = (t.requires_grad_() for t in _args())
    with remat_fn.profile() as prof:
        out = f(x, w1, w2)
    out.sum().backward()  # outside: still attributed to the profile of the forward
    r = prof.regions["block"]
    assert (r.calls, r.recomputes) == (1, 1) and r.recompute_s > 0 and r.forward_s > 0
    text = str(prof)
    assert text.splitlines()[0].startswith("| region | calls") and "| block | 1 |" in text


def test_nothing_is_recorded_outside_a_profile():
    f = remat(block)
    with remat_fn.profile() as prof:
        pass
    f(*(t.requires_grad_() for t in _args())).sum().backward()
    assert prof.regions == {}


def test_wrappers_of_one_function_with_different_policies_are_separate_rows():
    plain, dots = remat(block), remat(block, policy=policies.dots_saveable)
    with remat_fn.profile() as prof:
        # (a wrapper built anew for a call joins the row of its function and policy)
        for f in (plain, dots, plain, remat(block)):
            x, w1, w2 = (t.requires_grad_() for t in _args())
            f(x, w1, w2).sum().backward()
        grad(lambda x: dots(x, *_args()[1:]).sum())(_args()[0])  # the torch.func path
    assert list(prof.regions) == ["block [nothing_saveable]", "block [dots_saveable]"]
    a, b = prof.regions["block [nothing_saveable]"], prof.regions["block [dots_saveable]"]
    assert (a.name, a.policy, a.calls, a.recomputes) == ("block", "nothing_saveable", 3, 3)
    assert (b.name, b.policy, b.calls, b.recomputes) == ("block", "dots_saveable", 2, 2)
    assert a.kept_bytes == 3 * _total(saved_residuals(plain, *_args()))
    assert b.kept_bytes == 2 * _total(saved_residuals(dots, *_args()))
    assert b.kept_bytes / 2 > a.kept_bytes / 3  # per call, dots_saveable keeps the mm output too
    text = str(prof)
    assert "| block [nothing_saveable] | 3 |" in text and "| block [dots_saveable] | 2 |" in text
    # modules of one class under two policies (remat_module: no wrapper, one call each)
    lin1 = remat_fn.nn.remat_module(torch.nn.Linear(32, 32), policy=[torch.ops.aten.addmm.default])
    lin2 = remat_fn.nn.remat_module(torch.nn.Linear(32, 32))
    with remat_fn.profile() as prof:
        x = _args()[0].requires_grad_()
        lin2(lin1(x).tanh()).tanh().sum().backward()
    assert sorted(prof.regions) == ["Linear.forward [nothing_saveable]", "Linear.forward [ops(['aten.addmm.default'])]"]
    # a function with one policy keeps its plain name
    with remat_fn.profile() as prof:
        dots(*_args()).sum()
    assert list(prof.regions) == ["block"] and prof.regions["block"].policy == "dots_saveable"
