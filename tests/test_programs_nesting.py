"""Hypothesis: three levels of nested regions with closures at each level, statistics held
in containers, views among outputs, under reverse, forward-over-reverse and
reverse-over-reverse transforms, against the plain function (issue 31's programs).

Each level is ``remat`` or plain (chosen per level), closes over its own weight (a
tensor the transform differentiates or a constant) and, at the innermost level, may
update running statistics held in a list, a tuple or a ``functools.partial`` (as
BatchNorm's buffers are held outside a module).  A level may return a view of its
result beside it, written in place by its caller.  Compared: the value, the
derivatives, the statistics after the step, and how often each level's Python ran.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.func import grad, hessian, jacrev, jvp, vjp

from remat_fn import remat

D = torch.float64
TRANSFORMS = ["grad", "vjp", "jacrev", "grad_of_grad", "hessian", "jvp_of_grad", "jacrev_of_grad"]


def _ident(f):
    return f


def build(program, wrap_of, ws, stats, calls):
    """The program's function of ``x`` (a (4,) vector), with each level wrapped by
    ``wrap_of(level)``."""
    holder, views, closed = program["holder"], program["views"], program["closed"]
    rm, rv = stats

    if holder == "partial":
        bn = functools.partial(F.batch_norm, running_mean=rm, running_var=rv, training=True, momentum=0.3)
    elif holder == "list":
        box = [rm, rv]
        bn = lambda h: F.batch_norm(h, box[0], box[1], training=True, momentum=0.3)
    elif holder == "tuple":
        box = (rm, rv)
        bn = lambda h: F.batch_norm(h, *box, training=True, momentum=0.3)
    else:
        bn = None

    def level0(h, w0):
        calls[0] += 1
        h = torch.tanh(h * w0 + 0.1) + 0.0  # (a fresh tensor: its caller writes into it)
        if bn is not None:
            h = bn(h.reshape(2, 2)).reshape(4)
        return (h, h[1:3]) if views[0] else h

    f0 = wrap_of(0)(level0)

    def level1(h):
        calls[1] += 1
        w1 = ws[1]  # closed over
        out = f0(h * w1, ws[0] if closed[0] else ws[0].detach())
        if views[0]:
            a, b = out
            a.mul_(2)  # (written in place by its caller: b, a view of it, changes too)
            out = a + b.sum()
        return (out.sin(), out[:2]) if views[1] else out.sin()

    f1 = wrap_of(1)(level1)

    def level2(x):
        calls[2] += 1
        w2 = ws[2]
        out = f1(x + w2 if closed[2] else x)
        if views[1]:
            a, b = out
            out = a * b.sum()
        return out.exp()

    return wrap_of(2)(level2)


def run(program, transform, remat_levels):
    g = torch.Generator().manual_seed(program["seed"])
    x = torch.randn(4, dtype=D, generator=g) / 2
    ws = [torch.randn(4, dtype=D, generator=g) / 2 for _ in range(3)]
    stats = (torch.zeros(2, dtype=D), torch.ones(2, dtype=D))
    calls = [0, 0, 0]
    wrap_of = lambda level: remat if level in remat_levels else _ident

    def f(x, w):  # w: the weights the transform differentiates (closed over by the levels)
        fn = build(program, wrap_of, [w[0], w[1], w[2]], stats, calls)
        return fn(x).sum()

    w = torch.stack(ws)
    if transform == "grad":
        out = grad(f, argnums=(0, 1))(x, w)
    elif transform == "vjp":
        val, fn = vjp(f, x, w)
        out = (val, fn(torch.ones((), dtype=D)))
    elif transform == "jacrev":
        out = jacrev(lambda x, w: build(program, wrap_of, [w[0], w[1], w[2]], stats, calls)(x), argnums=(0, 1))(x, w)
    elif transform == "grad_of_grad":
        out = grad(lambda x, w: grad(f, argnums=(0, 1))(x, w)[0].pow(2).sum(), argnums=(0, 1))(x, w)
    elif transform == "hessian":
        out = hessian(lambda x: f(x, w))(x)
    elif transform == "jvp_of_grad":  # forward over reverse; the inputs require no grad
        out = jvp(lambda x: grad(f)(x, w), (x,), (torch.ones_like(x),))
    else:
        out = jacrev(lambda x: grad(f, argnums=1)(x, w))(x)
    return out, [s.clone() for s in stats], calls


@st.composite
def programs(draw):
    return {
        "seed": draw(st.integers(0, 2**16)),
        "holder": draw(st.sampled_from(["none", "list", "tuple", "partial"])),
        "views": [draw(st.booleans()), draw(st.booleans())],
        "closed": [draw(st.booleans()), None, draw(st.booleans())],
    }


def _known_silent(program, transform, remat_levels) -> bool:
    """The class of programs found wrong (see the strict xfail below): under vjp/jacrev, the
    innermost and the middle level both regions, the innermost given its weight (a view of
    the differentiated tensor the middle one's closed-over weight is a view of too)."""
    return transform in ("vjp", "jacrev") and program["closed"][0] and {0, 1} <= remat_levels


# (derandomized: a fixed example sequence, so CI is not at the mercy of a random draw)
@settings(max_examples=40, deadline=None, derandomize=True)
@given(program=programs(), transform=st.sampled_from(TRANSFORMS),
       remat_levels=st.sets(st.sampled_from([0, 1, 2]), min_size=1))
def test_nested_programs_with_closures_containers_and_views(program, transform, remat_levels):
    assume(not _known_silent(program, transform, remat_levels))  # (the strict xfail below)
    got, got_stats, got_calls = run(program, transform, remat_levels)
    want, want_stats, want_calls = run(program, transform, set())
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    for a, b in zip(got_stats, want_stats):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # the innermost level's Python: once per forward (a level with levels nested in it
    # may run again in plain backward, docs/design.md)
    if 0 in remat_levels and not ({1, 2} & remat_levels):
        assert got_calls[0] == want_calls[0], (got_calls, want_calls)


@pytest.mark.xfail(strict=True, reason="silent, on d95680a too (the re-run path, not the replay): under vjp and "
                   "jacrev, nested regions whose weights are views of one differentiated tensor, one passed to the "
                   "innermost region and one closed over by the region around it: the weight's gradient differs (0.37 "
                   "in the first case; under grad, or with either level plain, it is exact)")
@pytest.mark.parametrize("views,levels,transform", [
    ([False, False], {0, 1, 2}, "vjp"), ([False, True], {0, 1}, "vjp"), ([False, False], {0, 1, 2}, "jacrev")])
def test_nested_regions_over_views_of_one_weight(views, levels, transform):
    program = {"seed": 0, "holder": "none", "views": views, "closed": [True, None, False]}
    assert _known_silent(program, transform, levels)
    got, _, _ = run(program, transform, levels)
    want, _, _ = run(program, transform, set())
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
