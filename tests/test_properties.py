"""Hypothesis: random programs, pytrees and transform compositions vs the plain function."""

from __future__ import annotations

import functools
import os

import optree
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.func import grad, jacfwd, jacrev, vjp, vmap

from remat_fn import remat

from ._util import assert_tree_close, draw_steps

UNARY = {
    "sin": torch.sin, "tanh": torch.tanh, "exp_small": lambda t: torch.exp(0.1 * t),
    "square": lambda t: t * t, "softplus": torch.nn.functional.softplus, "sigmoid": torch.sigmoid,
}
BINARY = {"add": torch.add, "mul": torch.mul, "sub": torch.sub, "mix": lambda a, b: a * torch.cos(b)}

settings.register_profile("ci", max_examples=150, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("REMAT_HYPOTHESIS_PROFILE", "ci"))


@st.composite
def programs(draw):
    """A straight-line program over n inputs of one shape, with a closed-over weight."""
    n_in = draw(st.integers(1, 3))
    steps, n_vals = draw_steps(draw, st, n_in + 1, 6, UNARY, BINARY)  # inputs + closed-over weight
    n_out = draw(st.integers(1, min(3, n_vals)))
    outs = draw(st.lists(st.integers(0, n_vals - 1), min_size=n_out, max_size=n_out))
    return n_in, steps, outs


def build(program, w):
    n_in, steps, outs = program

    def fn(tree):
        vals = list(optree.tree_leaves(tree)) + [w]
        for s in steps:
            if s[0] == "u":
                vals.append(UNARY[s[1]](vals[s[2]]))
            else:
                vals.append(BINARY[s[1]](vals[s[2]], vals[s[3]]))
        return {"outs": [vals[i] for i in outs], "meta": len(steps)}

    return fn


@st.composite
def input_trees(draw, n, shape):
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    leaves = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(n)]
    kind = draw(st.sampled_from(["tuple", "dict", "nested"]))
    if kind == "tuple":
        return tuple(leaves)
    if kind == "dict":
        return {f"k{i}": t for i, t in enumerate(leaves)}
    return {"a": leaves[:1], "b": [tuple(leaves[1:])]}


def scalar(fn):
    return lambda tree, w=None: sum(o.sum() for o in fn(tree)["outs"])


@given(data=st.data(), program=programs(), shape=st.sampled_from([(3,), (2, 3)]))
def test_random_programs_grad_eager_vjp(data, program, shape):
    tree = data.draw(input_trees(program[0], shape))
    w0 = torch.randn(shape, dtype=torch.float64)

    def loss(use, tree, w):
        fn = build(program, w)
        return scalar(remat(fn) if use else fn)(tree)

    # torch.func.grad w.r.t. inputs and closed-over weight (to the last bit but one: backward
    # differentiates the forward level's graph with every output's cotangent at once, so a
    # tensor several outputs use sums its gradient's parts in another order than plain)
    assert_tree_close(grad(lambda t, w: loss(True, t, w), argnums=(0, 1))(tree, w0),
                      grad(lambda t, w: loss(False, t, w), argnums=(0, 1))(tree, w0), rtol=1e-14, atol=1e-15)
    # eager backward
    res = []
    for use in (True, False):
        leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
        xs = [x.clone().requires_grad_() for x in leaves]
        w = w0.clone().requires_grad_()
        loss(use, optree.tree_unflatten(spec, xs), w).backward()
        res.append([x.grad for x in xs] + [w.grad])
    assert_tree_close(res[0], res[1], exact=True)
    # vjp with non-scalar outputs and the pass-through non-tensor leaf
    fn_r, fn_p = remat(build(program, w0)), build(program, w0)
    assert fn_r(tree)["meta"] == fn_p(tree)["meta"]
    out_r, vr = vjp(lambda t: fn_r(t)["outs"], tree)
    out_p, vp = vjp(lambda t: fn_p(t)["outs"], tree)
    assert_tree_close(out_r, out_p, exact=True)
    ct = optree.tree_map(torch.ones_like, out_p)
    assert_tree_close(vr(ct), vp(ct), rtol=1e-14, atol=1e-15)  # (the order of a sum: see above)


COMPOSE = st.lists(st.sampled_from(["grad", "vmap", "jacrev", "jacfwd"]), min_size=1, max_size=3)


@given(data=st.data(), program=programs(), pol=st.sampled_from([None, "everything", "save_unary", "budget"]))
def test_random_programs_with_policies_eager(data, program, pol):
    tree = data.draw(input_trees(program[0], (3,)))
    w0 = torch.randn(3, dtype=torch.float64)
    res = []
    for use in (True, False):
        leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
        xs = [x.clone().requires_grad_() for x in leaves]
        w = w0.clone().requires_grad_()
        fn = build(program, w)
        f = remat(fn, policy=_policy(pol)) if use else fn
        out = scalar(f)(optree.tree_unflatten(spec, xs))
        gs = torch.autograd.grad(out, xs + [w], create_graph=True, allow_unused=True)
        second = [g for g in gs if g is not None and g.requires_grad]
        gg = torch.autograd.grad(sum(g.pow(2).sum() for g in second), xs + [w], allow_unused=True) if second else ()
        res.append((gs, gg))
    assert_tree_close(res[0], res[1], rtol=1e-10, atol=1e-12)


POLICIES = st.sampled_from([
    None,
    "everything",
    "save_unary",  # a torch SAC-style callable
    "budget",
])


def _policy(name):
    from torch.utils.checkpoint import CheckpointPolicy

    from remat_fn import policies as P

    if name == "everything":
        return P.everything_saveable
    if name == "save_unary":
        return lambda ctx, op, *a, **k: (CheckpointPolicy.MUST_SAVE if getattr(op, "overloadpacket", None)
                                         in (torch.ops.aten.sin, torch.ops.aten.tanh, torch.ops.aten.exp)
                                         else CheckpointPolicy.PREFER_RECOMPUTE)
    if name == "budget":
        return P.memory_budget(0.5)
    return None


@given(program=programs(), comp=COMPOSE, nest=st.booleans(), seed=st.integers(0, 1000), pol=POLICIES)
def test_random_compositions(program, comp, nest, seed, pol):
    """Compose transforms around a scalar function of one vector input."""
    g = torch.Generator().manual_seed(seed)
    n_in = program[0]
    w = torch.randn(3, generator=g, dtype=torch.float64)
    fn = build(program, w)

    def mk(use):
        f = remat(fn, policy=_policy(pol)) if use else fn
        if use and nest:
            f = remat(f)
        base = lambda x: scalar(f)(tuple(x * (i + 1) for i in range(n_in)))
        h = base
        for t in comp:
            if t == "grad":
                prev = h
                h = (lambda p: lambda x: grad(lambda y: p(y).sum())(x))(prev)
            elif t == "vmap":
                prev = h
                h = (lambda p: lambda x: vmap(p)(x.expand(2, *x.shape)).sum(0))(prev)
            elif t == "jacrev":
                prev = h
                h = (lambda p: lambda x: jacrev(lambda y: p(y).sum())(x))(prev)
            else:
                prev = h
                h = (lambda p: lambda x: jacfwd(lambda y: p(y).sum())(x))(prev)
        return h

    x = torch.randn(3, generator=g, dtype=torch.float64)
    assert_tree_close(mk(True)(x), mk(False)(x), rtol=1e-9, atol=1e-10)


ACTS = [torch.nn.Tanh, torch.nn.GELU, torch.nn.Sigmoid, torch.nn.SiLU]


@settings(max_examples=40, deadline=None)
@given(widths=st.lists(st.integers(2, 6), min_size=2, max_size=4), acts=st.lists(st.integers(0, 3), min_size=3, max_size=3),
       pol=st.sampled_from([None, "dots", "names", "budget"]), transform=st.sampled_from(["grad", "vmap_grad", "jacrev", "eager"]),
       seed=st.integers(0, 10_000))
def test_random_modules_functional_call(widths, acts, pol, transform, seed):
    """Random MLPs; every Linear+activation block rematerialised, its pre-activation
    named inside the region; parameters swapped in by functional_call."""

    from remat_fn import policies as P

    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers += [torch.nn.Linear(a, b).double(), ACTS[acts[i % 3]]()]
    net = torch.nn.Sequential(*layers)
    policy = {None: None, "dots": P.dots_saveable, "names": P.save_only_these_names("act"),
              "budget": P.memory_budget(0.5)}[pol]
    pairs = [(net[i], net[i + 1]) for i in range(0, len(net), 2)]
    rblocks = [remat(functools.partial(_named_block, lin, act), policy=policy) for lin, act in pairs]

    def forward(use, x):
        for (lin, act), rb in zip(pairs, rblocks):
            x = rb(x) if use else _named_block(lin, act, x)
        return x

    def loss(use):
        def f(p, x):
            from torch.nn.utils.stateless import _reparametrize_module

            with _reparametrize_module(net, p):
                return forward(use, x).pow(2).sum()
        return f

    params = {k: v.detach() * 1.1 for k, v in net.named_parameters()}
    x = torch.randn(3, widths[0], dtype=torch.float64)
    if transform == "grad":
        a, b = grad(loss(True))(params, x), grad(loss(False))(params, x)
    elif transform == "vmap_grad":
        a = vmap(grad(loss(True)), in_dims=(None, 0))(params, x)
        b = vmap(grad(loss(False)), in_dims=(None, 0))(params, x)
    elif transform == "jacrev":
        a, b = jacrev(loss(True), argnums=1)(params, x), jacrev(loss(False), argnums=1)(params, x)
    else:
        res = []
        for use in (True, False):
            ps = {k: v.clone().requires_grad_() for k, v in params.items()}
            res.append(torch.autograd.grad(loss(use)(ps, x), list(ps.values())))
        a, b = res
    assert_tree_close(a, b, rtol=1e-10, atol=1e-12)


def _named_block(lin, act, x):
    from remat_fn import checkpoint_name

    return act(checkpoint_name(lin(x), "act"))


def test_names_policy_keeps_the_named_value_inside_the_region():
    """The "names" policy of the random-module test does act: the named
    pre-activation is kept where the activation's backward needs it."""
    from remat_fn import policies as P
    from remat_fn import saved_residuals

    lin, act = torch.nn.Linear(4, 5).double(), torch.nn.GELU()  # GELU saves its input
    x = torch.randn(3, 4, dtype=torch.float64)
    block = functools.partial(_named_block, lin, act)
    kept = [(r.kind, r.name) for r in saved_residuals(remat(block, policy=P.save_only_these_names("act")), x)
            if r.kind == "saved"]
    assert kept == [("saved", "act")]
    assert [r for r in saved_residuals(remat(block), x) if r.kind == "saved"] == []
