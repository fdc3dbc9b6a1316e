"""Hypothesis: random programs over a wide op set, through every transform with every
built-in policy, against the plain function.

Programs work on ``(4, 6)`` float64 values: views, ``cat``/``split``, ``where``,
``cumsum``, ``sort``/``topk``, ``einsum``, gather/scatter, ``layer_norm``,
``softmax``, ``conv1d``, matmuls with closed-over weights (some constant, some
differentiated), named values.  Outputs are pytrees that include an
unregistered dataclass, an integer and a boolean tensor.
"""

from __future__ import annotations

import dataclasses

import optree
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import grad, jacrev, jvp, vjp, vmap

from remat_fn import checkpoint_name, policies, remat

from ._util import assert_tree_close, draw_steps

SHAPE = (4, 6)
_g = torch.Generator().manual_seed(1234)
W = torch.randn(6, 6, generator=_g, dtype=torch.float64) / 3
# the weights the programs close over, differentiated by every transform: ``run``
# swaps a differentiated tensor in, as torch.func.functional_call does
PARAMS = {"W": W}
K = torch.randn(1, 1, 3, generator=_g, dtype=torch.float64)  # constant closure
IDX = torch.stack([torch.randperm(6, generator=_g) for _ in range(4)])  # constant index

UNARY = {
    "sin": torch.sin,
    "tanh": torch.tanh,
    "softmax": lambda t: torch.softmax(t, dim=-1),
    "layer_norm": lambda t: F.layer_norm(t, (6,)),
    "cumsum": lambda t: torch.cumsum(t, dim=-1),
    "views": lambda t: t.reshape(24).view(6, 4).t().unsqueeze(0).squeeze(0).t().reshape(4, 6),
    "cat_split": lambda t: torch.cat(t.split([2, 4], dim=1)[::-1], dim=1),
    "sort": lambda t: torch.sort(t, dim=-1).values,
    "topk": lambda t: torch.cat([torch.topk(t, 3).values, -torch.topk(-t, 3).values], dim=-1),
    "gather": lambda t: t.gather(1, IDX),
    "scatter": lambda t: torch.zeros_like(t).scatter(1, IDX, t),
    "conv1d": lambda t: F.conv1d(t.unsqueeze(1), K, padding=1).squeeze(1),
    "einsum_w": lambda t: torch.einsum("ij,jk->ik", t, PARAMS["W"]),
    "matmul_w": lambda t: t @ PARAMS["W"],
    "named": lambda t: checkpoint_name(torch.sin(t) * 2, "h"),
}
BINARY = {
    "add": torch.add,
    "mul": torch.mul,
    "where": lambda a, b: torch.where(a > 0, a, b),
    "bmm": lambda a, b: torch.bmm(a.unsqueeze(0), b.t().unsqueeze(0)).squeeze(0) @ PARAMS["W"][:4, :],
}

POLICIES = {
    "none": None,
    "everything": policies.everything_saveable,
    "dots": policies.dots_saveable,
    "dots_no_batch": policies.dots_with_no_batch_dims_saveable,
    "only_h": policies.save_only_these_names("h"),
    "except_h": policies.save_anything_except_these_names("h"),
    "offload_h": policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=("h",),
        offload_src="cpu", offload_dst="cpu"),
    "budget": policies.memory_budget(0.5),
}
TRANSFORMS = ["eager", "grad", "vjp", "vmap_grad", "jacrev", "jvp", "grad_grad"]


@dataclasses.dataclass
class Extra:  # deliberately not registered with optree
    h: torch.Tensor


@st.composite
def programs(draw):
    n_in = draw(st.integers(1, 3))
    steps, n_vals = draw_steps(draw, st, n_in, 5, UNARY, BINARY)
    outs = draw(st.lists(st.integers(0, n_vals - 1), min_size=1, max_size=3))
    extra = draw(st.integers(0, n_vals - 1))
    return n_in, steps, outs, extra


def build(program):
    n_in, steps, outs, extra = program

    def fn(xs):
        vals = list(xs)
        for s in steps:
            if s[0] == "u":
                vals.append(UNARY[s[1]](vals[s[2]]))
            else:
                vals.append(BINARY[s[1]](vals[s[2]], vals[s[3]]))
        last = vals[-1]
        return {"outs": [vals[i] for i in outs], "extra": Extra(vals[extra]),
                "argmax": last.argmax(dim=-1), "pos": last > 0, "n": len(steps)}

    return fn


def scalar(fn, n_in, wrt):
    """A scalar loss of the differentiated inputs ``wrt``; the others are constants."""

    def loss(*diff, consts):
        xs = list(consts)
        for i, d in zip(wrt, diff):
            xs[i] = d
        out = fn(xs[:n_in])
        total = sum((o * o).sum() for o in out["outs"]) + out["extra"].h.sin().sum()
        total = total + sum((x * x).sum() for x in diff) * 0.01  # every input is used
        return total + (out["pos"] * out["outs"][0]).sum() * 0.5

    return loss


def run(transform, fn, xs, wrt):
    """``transform`` of the loss of ``fn`` w.r.t. the inputs ``wrt`` and the closed-over
    weights ``PARAMS["W"]`` (swapped in for the call, as functional_call does)."""
    loss = scalar(fn, len(xs), wrt)
    diff = [xs[i] for i in wrt] + [W]

    def f(*d):
        *d, w = d
        PARAMS["W"] = w
        try:
            return loss(*d, consts=xs)
        finally:
            PARAMS["W"] = W

    n = len(diff)
    if transform == "eager":
        ds = [d.clone().requires_grad_(True) for d in diff]
        return torch.autograd.grad(f(*ds), ds, allow_unused=True, materialize_grads=True)
    if transform == "grad":
        return grad(f, argnums=tuple(range(n)))(*diff)
    if transform == "vjp":
        out, fn_ = vjp(f, *diff)
        return fn_(torch.ones_like(out))
    if transform == "vmap_grad":
        batched = [torch.stack([d, d * 0.5 + 0.1]) for d in diff[:-1]]
        return vmap(grad(f, argnums=tuple(range(n))), in_dims=(*([0] * (n - 1)), None))(*batched, W)
    if transform == "jacrev":
        return jacrev(lambda d0, w: f(d0, *diff[1:-1], w), argnums=(0, 1))(diff[0], W)
    if transform == "jvp":
        return jvp(f, tuple(diff), tuple(torch.ones_like(d) for d in diff))
    if transform == "grad_grad":  # a Hessian-vector product, w.r.t. the input and W
        g = lambda d0, w: grad(lambda y, v: f(y, *diff[1:-1], v), argnums=(0, 1))(d0, w)  # noqa: E731
        return jvp(g, (diff[0], W), (torch.ones_like(diff[0]), torch.ones_like(W)))[1]
    raise AssertionError(transform)


@settings(max_examples=120, deadline=None)
@given(program=programs(), policy=st.sampled_from(sorted(POLICIES)),
       transform=st.sampled_from(TRANSFORMS), seed=st.integers(0, 2**16), data=st.data())
def test_random_programs_every_transform_every_policy(program, policy, transform, seed, data):
    n_in = program[0]
    wrt = data.draw(st.lists(st.integers(0, n_in - 1), min_size=1, max_size=n_in, unique=True))
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(SHAPE, generator=g, dtype=torch.float64) for _ in range(n_in)]
    fn = build(program)
    rfn = remat(fn, policy=POLICIES[policy])
    # the forward: same values, the same pytree (non-tensor leaves, int/bool outputs)
    out_r, out_p = rfn(xs), fn(xs)
    assert_tree_close(optree.tree_map(lambda e: e.h if isinstance(e, Extra) else e, out_r,
                                      is_leaf=lambda e: isinstance(e, Extra)),
                      optree.tree_map(lambda e: e.h if isinstance(e, Extra) else e, out_p,
                                      is_leaf=lambda e: isinstance(e, Extra)), exact=True)
    got = run(transform, rfn, xs, sorted(wrt))
    want = run(transform, fn, xs, sorted(wrt))
    assert_tree_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_unary_op_under_grad_with_each_policy(policy):
    """Each op of the set on its own: a deterministic floor under the random search."""
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for name, op in UNARY.items():
        fn = lambda xs, op=op: {"outs": [op(xs[0])], "extra": Extra(xs[0]),  # noqa: E731
                                "argmax": xs[0].argmax(-1), "pos": xs[0] > 0, "n": 1}
        got = run("grad", remat(fn, policy=POLICIES[policy]), [x], [0])
        want = run("grad", fn, [x], [0])
        assert_tree_close(got, want, rtol=1e-10, atol=1e-12), name
