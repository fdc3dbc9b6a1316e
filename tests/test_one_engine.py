"""Regions under every transform give plain's results and run the function's Python once.

One test per case of the review of the re-run mechanisms (issue 31), named after the
case, each comparing remat with the plain function (``ident``), and the test that runs
one region under every transform the spec lists."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

from remat_fn import remat

from ._util import STE, OpCount, recursive_checkpoint

D = torch.float64


def ident(f):
    return f


def _close(a, b, tol=1e-10):
    for x, y in zip(torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)


# -- 1. three nested regions with a closure ------------------------------------------
def _three_nested(x, w, wrap):
    mm = lambda h, w: h @ w
    inner = wrap(mm)  # w passed as an argument
    mid = wrap(lambda h: inner(h, w))  # w closed over
    return wrap(lambda x, w: mm(mid(x), w))(x, w).pow(2).sum()


@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev", "eager"])
def test_three_nested_regions_with_a_closure(transform):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, dtype=D, generator=g)
    w = torch.randn(6, 6, dtype=D, generator=g) / 3

    def run(wrap):
        f = functools.partial(_three_nested, x, wrap=wrap)
        if transform == "grad":
            return grad(f)(w)
        if transform == "vjp":
            return vjp(f, w)[1](torch.ones((), dtype=D))
        if transform == "jacrev":
            return jacrev(f)(w)
        wl = w.clone().requires_grad_()
        f(wl).backward()
        return wl.grad

    _close(run(remat), run(ident))


def test_an_argument_the_function_also_closes_over():
    """The outer region alone: its argument ``w`` is also read through a closure."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 4, dtype=D, generator=g), torch.randn(4, 4, dtype=D, generator=g)

    def f(w, wrap):
        mid = lambda h: h @ w
        return wrap(lambda x, w: mid(x) @ w)(x, w).sin().sum()

    _close(grad(f)(w, remat), grad(f)(w, ident))
    _close(vmap(grad(f), in_dims=(0, None))(torch.stack([w, 2 * w]), remat),
           vmap(grad(f), in_dims=(0, None))(torch.stack([w, 2 * w]), ident))


# -- 3. running statistics held in a list, tuple or functools.partial ----------------------
def _stats_region(wrap, holder, rm, rv):
    if holder == "partial":
        return wrap(functools.partial(F.batch_norm, running_mean=rm, running_var=rv, training=True, momentum=0.5))
    box = [rm, rv] if holder == "list" else (rm, rv)
    return wrap(lambda y: F.batch_norm(y, box[0], box[1], training=True, momentum=0.5))


_STAT_TRANSFORMS = {
    "grad_of_grad": lambda bn, x: grad(lambda x: grad(lambda y: bn(y).sin().sum())(x).sum())(x),
    "vjp": lambda bn, x: vjp(lambda y: bn(y).sin(), x.clone().requires_grad_())[1](torch.ones_like(x)),
    "jvp": lambda bn, x: jvp(lambda y: bn(y).sin(), (x,), (torch.ones_like(x),)),
    "jacfwd": lambda bn, x: jacfwd(lambda y: bn(y).sin().sum())(x),
    "hessian": lambda bn, x: hessian(lambda y: bn(y).sin().sum())(x),
    "grad": lambda bn, x: grad(lambda y: bn(y).sin().sum())(x),
}


@pytest.mark.parametrize("holder", ["partial", "list", "tuple"])
@pytest.mark.parametrize("transform", sorted(_STAT_TRANSFORMS))
def test_running_statistics_held_in_a_container(holder, transform):
    x = torch.randn(5, 3, dtype=D, generator=torch.Generator().manual_seed(1))
    out, stats = {}, {}
    for name, wrap in (("remat", remat), ("plain", ident)):
        rm, rv = torch.zeros(3, dtype=D), torch.ones(3, dtype=D)
        out[name] = _STAT_TRANSFORMS[transform](_stats_region(wrap, holder, rm, rv), x)
        stats[name] = (rm, rv)
    _close(stats["remat"], stats["plain"])
    _close(out["remat"], out["plain"])


# -- 4. outputs that are views of each other --------------------------------------------
@pytest.mark.parametrize("transform", ["grad", "jacrev", "vjp", "eager"])
@pytest.mark.parametrize("order", ["base_first", "view_first"])
def test_outputs_that_are_views_of_each_other(transform, order):
    def g(x):
        h = x * 3
        return (h, h[1:3]) if order == "base_first" else (h[1:3], h)

    def loss(x, wrap):
        a, b = wrap(g)(x)
        if order == "view_first":
            a, b = b, a
        a.mul_(2)
        return (b * b).sum()

    x = torch.arange(5.0, dtype=D)

    def run(wrap):
        if transform == "grad":
            return grad(loss)(x, wrap)
        if transform == "jacrev":
            return jacrev(loss)(x, wrap)
        if transform == "vjp":
            return vjp(lambda x: loss(x, wrap), x)[1](torch.ones((), dtype=D))
        xl = x.clone().requires_grad_()
        loss(xl, wrap).backward()
        return xl.grad

    _close(run(remat), run(ident))


# -- 5. a view output of an input whose memory overlaps ---------------------------------------
@pytest.mark.parametrize("transform", ["jacrev", "vjp", "grad"])
@pytest.mark.parametrize("view", ["select", "as_strided"])
def test_view_output_of_an_input_whose_memory_overlaps(transform, view):
    fn = (lambda x: x[1]) if view == "select" else (lambda x: x.as_strided((2,), (0,)))

    def run(wrap):
        x = torch.tensor(3.0, dtype=D).expand(3)
        if transform == "jacrev":
            return jacrev(wrap(fn))(x)
        if transform == "vjp":
            out, f = vjp(wrap(fn), x)
            return f(torch.ones_like(out))
        return grad(lambda x: wrap(fn)(x).sum())(x)

    _close(run(remat), run(ident))


# -- 6. jvp/jacfwd run the Python function again ------------------------------------------
@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "hessian", "grad_of_grad", "jvp_of_grad"])
def test_forward_mode_runs_the_python_function_once(transform):
    def run(wrap):
        calls = []
        h = wrap(lambda x: (calls.append(1), x.sin() * len(calls))[1])
        x = torch.linspace(-1, 1, 3, dtype=D)
        if transform == "jvp":
            out = jvp(h, (x,), (torch.ones_like(x),))
        elif transform == "jacfwd":
            out = jacfwd(h)(x)
        elif transform == "hessian":
            out = hessian(lambda x: h(x).sum())(x)
        elif transform == "grad_of_grad":
            out = grad(lambda x: grad(lambda y: h(y).sum())(x).pow(2).sum())(x)
        else:
            out = jvp(grad(lambda y: h(y).sum()), (x,), (torch.ones_like(x),))
        return out, len(calls)

    (got, n), (want, m) = run(remat), run(ident)
    assert n == m == 1
    _close(got, want)


# -- one region under every transform the spec lists ------------------------------------------
class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=D)
        self.bn = torch.nn.BatchNorm1d(4, dtype=D, momentum=0.3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.bn(self.lin(x))) * x


def _every(name, block, region):
    """``region(x)`` (the block, plain or remat'ed) under transform ``name``; returns what
    the step computes.  Under torch.func the buffers are arguments of the transformed
    function (functorch refuses writes into captured ones, plain code included); under
    vjp, forward mode and vmap, where plain BatchNorm refuses running statistics one way or
    another, in eval mode."""
    params = {k: v.detach() for k, v in block.named_parameters()}
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4, dtype=D, generator=g)
    xs = torch.randn(3, 6, 4, dtype=D, generator=g)
    if name in ("vjp", "jvp", "jacfwd", "hessian", "vmap", "vmap_grad", "remat_scan", "vmap_hessian", "grad_vmap_grad"):
        block.bn.eval()
    bufs = dict(block.named_buffers())  # (the very tensors: the region updates them)

    def fc(p, b, x):
        run = lambda x: torch.func.functional_call(block, (p, b), (x,))
        return (region(run) if region else run)(x)

    loss = lambda p, b, x: fc(p, b, x).pow(2).sum()
    if name in ("eager", "create_graph", "retain_graph_twice"):
        xl = x.clone().requires_grad_()
        out = (region(block) if region else block)(xl).pow(2).sum()
        if name == "create_graph":
            (gx,) = torch.autograd.grad(out, xl, create_graph=True)
            return torch.autograd.grad(gx.pow(2).sum(), [xl, *block.parameters()])
        if name == "retain_graph_twice":
            out.backward(retain_graph=True)
        out.backward()
        return [xl.grad, *(p.grad for p in block.parameters())]
    if name == "nested":  # (the block's region inside another, under grad)
        outer = (region or ident)(lambda p, b, x: fc(p, b, x) * 2)
        return grad(lambda p, b, x: outer(p, b, x).pow(2).sum())(params, bufs, x)
    if name == "remat_scan":  # (each step a region, under grad of the initial carry)
        from remat_fn import remat_scan

        step = lambda c, x: (fc(params, bufs, c + x), None)
        if region is None:
            def scan(c0):
                for xx in xs:
                    c0 = step(c0, xx)[0]
                return c0
        else:
            scan = lambda c0: remat_scan(step, c0, xs, checkpoints=len(xs))[0]
        return grad(lambda c0: scan(c0).pow(2).sum())(x)
    if name == "compile":  # (eager backward through torch.compile)
        xl = x.clone().requires_grad_()
        fn = torch.compile(region(block) if region else block, backend="aot_eager", fullgraph=False)
        fn(xl).pow(2).sum().backward()
        return [xl.grad, *(p.grad for p in block.parameters())]
    if name == "grad":
        return grad(loss)(params, bufs, x)
    if name == "vjp":  # (vjp differentiates every primal, buffers too: functorch refuses both ways)
        out, f = vjp(lambda p: fc(p, bufs, x), params)
        return f(torch.ones_like(out))
    if name == "jacrev":
        return jacrev(lambda x, b: fc(params, b, x).sum(0))(x, bufs)
    if name == "grad_of_grad":
        return grad(lambda x, b: grad(lambda x, b: loss(params, b, x))(x, b).pow(2).sum())(x, bufs)
    if name == "jvp":
        return jvp(lambda x: fc(params, bufs, x), (x,), (torch.ones_like(x),))
    if name == "jacfwd":
        return jacfwd(lambda x: fc(params, bufs, x).sum(0))(x)
    if name == "hessian":
        return hessian(lambda x: loss(params, bufs, x))(x)
    if name == "vmap":
        return vmap(lambda x: fc(params, bufs, x))(xs)
    if name == "vmap_grad":
        return vmap(grad(loss), in_dims=(None, None, 0))(params, bufs, xs)
    if name == "vmap_hessian":  # (per-example Hessians: the forward's torch calls replayed, see remat_fn._logical)
        return vmap(hessian(lambda x: loss(params, bufs, x)))(xs)
    if name == "grad_vmap_grad":  # (MAML: an inner step per task, the meta-gradient over the parameters)
        def task(p, x):
            g = grad(loss)(p, bufs, x)
            return loss({k: p[k] - 0.1 * g[k] for k in p}, bufs, x)
        return grad(lambda p: vmap(task, in_dims=(None, 0))(p, xs).sum())(params)
    raise AssertionError(name)


_EVERY = ["eager", "create_graph", "retain_graph_twice", "grad", "vjp", "jvp", "jacrev", "jacfwd", "hessian",
          "vmap", "vmap_grad", "grad_of_grad", "nested", "remat_scan", "compile", "vmap_hessian", "grad_vmap_grad"]
# what still runs the function's Python again, and why (docs/design.md, "What still re-runs")
_RERUNS = {
    "compile": "torch.compile traces the region into torch's checkpoint operator; Dynamo runs the function's "
               "Python twice while tracing it (once more than the plain module)",
}
# where remat still refuses what plain code runs
_REFUSED: dict[str, str] = {}
# where the buffers differ from plain code's because torch's own operator differs
_TORCH = {
    "compile": "under torch.compile the region is traced into torch's checkpoint operator (with the policy as a "
               "selective-checkpoint context), whose recomputation updates BatchNorm's buffers a second time: "
               "torch.utils.checkpoint under torch.compile does the same (num_batches_tracked 2, plain 1)",
}


@pytest.mark.parametrize("name", _EVERY)
def test_every_transform_runs_the_function_once_and_updates_buffers_as_plain(name):
    results = {}
    for kind, region in (("plain", None), ("remat", remat)):
        torch.manual_seed(0)
        block = _Block()
        try:
            out = _every(name, block, region)
        except RuntimeError as e:  # (plain code itself refuses: remat must refuse too, see below)
            out = e
        n = block.bn.num_batches_tracked
        results[kind] = (out, block.calls, block.bn.running_mean.clone(), None if n is None else n.clone())
    (p_out, p_calls, p_mean, p_n), (r_out, r_calls, r_mean, r_n) = results["plain"], results["remat"]
    if isinstance(p_out, Exception):
        assert isinstance(r_out, Exception), f"plain raises {p_out!r}, remat does not"
        return
    if name in _REFUSED:
        assert isinstance(r_out, Exception)
        pytest.xfail(_REFUSED[name])
    assert not isinstance(r_out, Exception), r_out
    _close(r_out, p_out)
    if name in _TORCH:
        pytest.xfail(_TORCH[name])
    _close(r_mean, p_mean)
    assert (r_n is None and p_n is None) or torch.equal(r_n, p_n)
    if name in _RERUNS:
        pytest.xfail(_RERUNS[name])
    assert r_calls == p_calls, f"the function ran {r_calls} times, plain {p_calls}"


# -- 7. thirty nested regions under grad -------------------------------------------------------
def test_thirty_nested_regions_under_grad():
    def build(wrap, n=30):
        f = lambda x: x.sin()
        for _ in range(n):
            f = wrap(lambda x, prev=f: prev(x) * 1.01)
        return f

    x = torch.linspace(-1, 1, 3, dtype=D)
    _close(grad(lambda x: build(remat)(x).sum())(x), grad(lambda x: build(ident)(x).sum())(x))


@pytest.mark.parametrize("depth", [3, 5, 12, 30])
@pytest.mark.parametrize("transform", ["grad", "jvp", "vmap", "hessian", "grad_of_grad", "vmap_of_jvp", "vmap_of_grad",
                                       "vmap_of_jvp_of_grad"])
def test_deeply_nested_regions_closing_over_a_weight(transform, depth):
    """The innermost region closes over a weight that needs a gradient, each enclosing region over the
    region inside it.  The search for the tensors a region reaches stopped at six steps, two per level of
    nesting (the closure cell, the remat wrapper's function), so from five levels the outermost region
    missed the weight: a false RematError ("could not be threaded") under every transform.  Under
    ``vmap(grad)`` and ``vmap(jvp(grad))`` it was missed from three levels: in the outermost region's
    backward run again its CaptureMode answered the middle region's read of ``w.requires_grad`` with its
    replacement's (a level's wrapper that requires no grad), and then re-replaced the middle region's own
    replacement of the weight (the same object) by that wrapper."""
    g = torch.Generator().manual_seed(31)
    x, v, w0 = (torch.randn(3, dtype=D, generator=g) for _ in range(3))

    def build(wrap):
        w = w0.clone().requires_grad_()
        fn = wrap(lambda a: (a * w).sin())
        for _ in range(depth - 1):
            fn = (lambda inner: wrap(lambda b: inner(b * 1.0) * 1.01))(fn)
        return lambda x: fn(x).sum()

    runs = {"grad": lambda L: grad(L)(x), "jvp": lambda L: jvp(L, (x,), (v,))[1],
            "vmap": lambda L: vmap(L)(torch.stack([x, v])), "hessian": lambda L: hessian(L)(x),
            "grad_of_grad": lambda L: grad(lambda x: grad(L)(x).sum())(x),
            "vmap_of_jvp": lambda L: vmap(lambda x: jvp(L, (x,), (v,))[1])(torch.stack([x, v])),
            "vmap_of_grad": lambda L: vmap(grad(L))(torch.stack([x, v])),
            "vmap_of_jvp_of_grad": lambda L: vmap(lambda x: jvp(grad(L), (x,), (v,))[1])(torch.stack([x, v]))}
    if depth == 30 and transform in ("hessian", "grad_of_grad", "vmap_of_jvp_of_grad"):
        pytest.skip("second order through thirty regions takes 18-19 s on a 2-core CPU; depth 12 runs the same code")
    _close(runs[transform](build(remat)), runs[transform](build(ident)))


# -- 8. a region closing over a vmapped tensor, under vmap(grad) -------------------------------------
def test_region_closing_over_a_vmapped_tensor_under_vmap_grad(recwarn):
    g = torch.Generator().manual_seed(2)
    W, xb = torch.randn(4, 4, dtype=D, generator=g), torch.randn(3, 2, 4, dtype=D, generator=g)

    def run(wrap):
        return vmap(lambda x: grad(lambda w: wrap(lambda w: torch.tanh(x @ w).sin())(w).sum())(W))(xb)

    _close(run(remat), run(ident))
    assert not [w for w in recwarn if "performance drop" in str(w.message)]


# -- 9. remat_scan with one checkpoint under grad of both arguments -------------------------------
def test_remat_scan_one_checkpoint_under_grad_of_carry_and_xs():
    from remat_fn import remat_scan

    f = lambda c, x: (torch.tanh(c * x + 0.1), (c * x).sum())

    def plain_scan(f, c, xs):
        ys = []
        for x in xs:
            c, y = f(c, x)
            ys.append(y)
        return c, torch.stack(ys)

    def loss(scan):
        def run(c0, xs):
            carry, ys = scan(f, c0, xs)
            return carry.sum() + (ys ** 2).sum()
        return run

    g = torch.Generator().manual_seed(0)
    c0, xs = torch.randn(3, dtype=D, generator=g), torch.randn(5, 3, dtype=D, generator=g)
    for k in (1, 2):
        got = grad(loss(lambda f, c, xs: remat_scan(f, c, xs, checkpoints=k)), argnums=(0, 1))(c0, xs)
        _close(got, grad(loss(plain_scan), argnums=(0, 1))(c0, xs))


# -- 10. nested regions: the function's Python under torch.func ------------------------------------
@pytest.mark.parametrize("transform", ["eager", "grad", "vjp", "grad_of_grad", "jvp"])
def test_nested_regions_run_each_function_as_plain_does(transform):
    """A nested region's backward replays its recorded forward; one with regions nested in
    it runs again (so they save their inputs only): the leaves' Python runs as in plain code."""
    W = torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(4)) / 2

    def run(wrap):
        calls = {"leaf": 0}

        def leaf(x):
            calls["leaf"] += 1
            return torch.tanh(x @ W)

        fi = wrap(leaf)
        fo = wrap(lambda x: fi(fi(x)).sin())
        x = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(5))
        if transform == "eager":
            xl = x.clone().requires_grad_()
            fo(xl).sum().backward()
            out = xl.grad
        elif transform == "grad":
            out = grad(lambda x: fo(x).sum())(x)
        elif transform == "vjp":
            o, f = vjp(fo, x)
            out = f(torch.ones_like(o))
        elif transform == "grad_of_grad":
            out = grad(lambda x: grad(lambda y: fo(y).sum())(x).pow(2).sum())(x)
        else:
            out = jvp(fo, (x,), (torch.ones_like(x),))
        return out, calls["leaf"]

    (got, n), (want, m) = run(remat), run(ident)
    _close(got, want)
    assert n == m


def test_remat_scan_under_grad_runs_the_step_as_plain_does():
    from remat_fn import remat_scan

    calls = [0]
    W = torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(6)) / 2

    def step(c, x):
        calls[0] += 1
        return torch.tanh(c @ W + x), c.sum()

    c0 = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(7))
    xs = torch.randn(6, 4, dtype=D, generator=torch.Generator().manual_seed(8))
    loss = lambda c0, xs: (lambda c, ys: c.sum() + ys.pow(2).sum())(*remat_scan(step, c0, xs, checkpoints=6))
    grad(loss)(c0, xs)
    assert calls[0] == 6  # one region per step: each leaf's backward replays it


# -- 11. a region that calls torch.func itself ------------------------------------------------------
def test_region_calling_torch_func_itself():
    W = torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(9))

    def run(wrap):
        calls = []

        def f(x):
            calls.append(1)
            g = torch.func.grad(lambda y: (y @ W).sin().sum())(x)
            return (g * x).sum(-1)

        x = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(0)).requires_grad_()
        out = wrap(f)(x)
        n = len(calls)
        out.sum().backward()
        return x.grad, n

    (got, n), (want, _) = run(remat), run(ident)
    _close(got, want)
    # the eager try, which stops at the function's torch.func call, and the torch.func path's
    # forward (which no longer runs a third time to find tensors torch.func's autograd made)
    assert n == 2


@pytest.mark.parametrize("debug", [False, True])
def test_region_calling_torch_func_itself_updates_running_statistics_once(debug):
    """The eager try stops at the function's torch.func call (which refuses saved-tensor
    hooks): what it wrote into tensors from outside (BatchNorm's statistics, updated before
    that call) is put back before the torch.func path runs the function, so they are
    updated once, as in plain code (twice until this: num_batches_tracked 2, running_mean
    1.5x plain's).  The same function object then starts on the torch.func path: its
    Python runs once per forward from its second call on."""
    W = torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(9))

    def run(wrap):
        torch.manual_seed(0)
        bn = torch.nn.BatchNorm1d(4, dtype=D, momentum=0.5)
        calls = []

        def f(x):
            calls.append(1)
            h = bn(x)
            g = torch.func.grad(lambda y: (y @ W).sin().sum())(h)
            return (g * h).sum(-1)

        region = wrap(f)
        got = []
        for step in range(2):
            x = torch.randn(6, 4, dtype=D, generator=torch.Generator().manual_seed(step)).requires_grad_()
            out = region(x)
            n = len(calls)
            out.sum().backward()
            calls.clear()
            got.append((x.grad, bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone(), n))
        return got

    plain, got = run(ident), run(functools.partial(remat, debug=debug))
    for step, (p, r) in enumerate(zip(plain, got)):
        _close(r[:3], p[:3])
        assert torch.equal(r[3], p[3]), f"step {step}: num_batches_tracked {r[3]}, plain {p[3]}"
    # forward calls: the first call's eager try and its torch.func path; then the torch.func path alone
    assert [r[4] for r in got] == [2, 1]


def test_region_calling_torch_func_under_grad_keeps_its_graph_from_the_second_call():
    """Under grad, the forward's own vjp level refuses the function's torch.func call at
    first (its hooks): the forward runs again keeping its graph; the same function object
    then keeps the graph from its first try.  Backward replays the recorded forward, the
    transform's backward ops among its ops (it ran the function again until this)."""
    W = torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(9))

    def run(wrap):
        calls = []

        def f(w, x):
            calls.append(1)
            h = torch.tanh(x @ w)
            g = torch.func.grad(lambda y: (y @ W).sin().sum())(h)
            return (g * h).sum()

        region = wrap(f)
        got = []
        for step in range(2):
            x = torch.randn(6, 4, dtype=D, generator=torch.Generator().manual_seed(step))
            got.append((grad(region)(W.clone(), x), len(calls)))
            calls.clear()
        return got

    plain, got = run(ident), run(remat)
    for p, r in zip(plain, got):
        _close(r[0], p[0])
    assert [r[1] for r in plain] == [1, 1]
    # (the second call: its forward once; the first call's try adds one)
    assert [r[1] for r in got] == [2, 1]


# -- 13. jacrev of a random region returning a view of a tensor made inside ------------------------
def test_jacrev_of_random_region_with_a_view_output():
    def run(wrap):
        torch.manual_seed(5)
        return jacrev(wrap(lambda a: (a * torch.rand(3, 3, dtype=D)).exp().mT))(torch.ones(3, 3, dtype=D))

    _close(run(remat), run(ident))


# -- 10. JAX's recursive checkpoint recompute counts, under torch.func.vjp ---------------------------
def test_remat_recursive_checkpoint_recompute_counts_under_vjp():
    """JAX's ``test_remat_recursive_checkpoint_recompute_counts`` (tests/test_jax_parity.py runs
    it in eager mode: 0 Python evaluations in backward, the recorded ops are replayed).  Under
    ``vjp`` every region replays its recorded forward, a region nested in it as a region of its
    own (docs/design.md): 0 evaluations of ``add_one`` in backward (4 for 16 functions while a
    region with nested regions ran again).  Backward's ``add`` ops: at most JAX's 2, 8 and 24
    re-evaluations (0, 2 and 16: a vjp of a replay computes the outputs of what it replays, where
    eager backward replays only what autograd saved, none for ``add``)."""
    evals = [0]

    def add_one(x):
        evals[0] += 1
        return x + 1

    for n, jax_bwd_evals in [(4, 2), (8, 8), (16, 24)]:
        f = recursive_checkpoint([add_one] * n, remat)
        evals[0] = 0
        out, f_vjp = vjp(f, torch.ones((), dtype=D))
        assert evals[0] == n
        evals[0] = 0
        with OpCount() as func_adds:
            (g,) = f_vjp(torch.ones((), dtype=D))
        assert evals[0] == 0, (n, evals[0])
        assert g.item() == 1.0 and out.item() == 1.0 + n
        assert func_adds.n.get("add", 0) <= jax_bwd_evals, (n, func_adds.n)


# -- what the recorded forward cannot stand for: the function runs again, exact -------------------
def _data_read(x):
    return (x.data * x).sum()


def _data_write(x):
    y = x * x
    y.data.mul_(3)
    return y.sum()


@pytest.mark.parametrize("fn", [lambda x: (STE.apply(x * 3) * x).sum(), _data_read, _data_write],
                         ids=["custom_function", "data_read", "data_write"])
@pytest.mark.parametrize("transform", ["hessian", "jvp", "grad_of_grad", "eager_around_grad"])
def test_regions_the_replay_cannot_stand_for(fn, transform):
    """A custom autograd.Function inside the region (autograd differentiates its backward and
    jvp, not its forward's ops) and ``.data`` (an alias no op makes: the tape cannot tell it
    from the tensor) keep the function's re-run where an outer transform differentiates."""
    x, t = torch.tensor([0.4, 1.3], dtype=D), torch.ones(2, dtype=D)

    def run(wrap):
        f = wrap(fn)
        if transform == "hessian":
            return hessian(f)(x)
        if transform == "jvp":
            return jvp(f, (x,), (t,))
        if transform == "grad_of_grad":
            return grad(lambda x: grad(f)(x).pow(2).sum())(x)
        xl = x.clone().requires_grad_()
        grad(f)(xl).sum().backward()
        return xl.grad

    _close(run(remat), run(ident))


# -- a region that calls a torch.func transform itself -----------------------------------------
_IG = torch.Generator().manual_seed(21)
_IW = torch.randn(4, 4, dtype=D, generator=_IG) / 2
_IX = torch.randn(3, 4, dtype=D, generator=_IG)
_IXB = torch.randn(2, 3, 4, dtype=D, generator=_IG)
_INNER = {
    "grad": lambda x, w: grad(lambda x: torch.tanh(x @ w).sin().sum())(x),
    "vjp_fn": lambda x, w: vjp(lambda x: torch.tanh(x @ w), x)[1](x.cos())[0],
    "jvp": lambda x, w: jvp(lambda x: torch.tanh(x @ w), (x,), (x.sin(),))[1],
    "jacrev": lambda x, w: jacrev(lambda r: torch.tanh(r @ w).sum(0))(x).sum((-2, -1)),
    "hessian": lambda x, w: hessian(lambda r: torch.tanh(r @ w).pow(2).sum())(x[0]).sum(0) * x,
    "grad_of_closed_over": lambda x, w: grad(lambda w: torch.tanh(x @ w).sin().sum())(w)[:3] * x,
    "vmap_grad": lambda x, w: vmap(grad(lambda r: torch.tanh(r @ w).sum()))(x),
}
_OUTER = {
    "eager": lambda F: torch.autograd.grad(F(_IX.clone().requires_grad_(), w := _IW.clone().requires_grad_()).pow(2).sum(), w),
    "create_graph": lambda F: (lambda x, w: torch.autograd.grad(torch.autograd.grad(
        F(x, w).pow(2).sum(), x, create_graph=True)[0].pow(2).sum(), w))(_IX.clone().requires_grad_(), _IW.clone().requires_grad_()),
    "grad": lambda F: grad(lambda w: F(_IX, w).pow(2).sum())(_IW),
    "vjp": lambda F: vjp(lambda w: F(_IX, w), _IW)[1](_IX.cos())[0],
    "grad_of_grad": lambda F: grad(lambda w: grad(lambda w: F(_IX, w).pow(2).sum())(w).pow(2).sum())(_IW),
    "jvp": lambda F: jvp(lambda w: F(_IX, w), (_IW,), (_IW.cos(),))[1],
    "jacrev": lambda F: jacrev(lambda w: F(_IX, w).sum(0))(_IW),
    "vmap_grad": lambda F: vmap(grad(lambda x: F(x, _IW).pow(2).sum()))(_IXB),
    "vmap_grad_of_unbatched": lambda F: vmap(grad(lambda w, x: F(x, w).pow(2).sum()), in_dims=(None, 0))(_IW, _IXB),
}


@pytest.mark.parametrize("outer", list(_OUTER))
@pytest.mark.parametrize("inner", list(_INNER))
def test_region_calling_a_torch_func_transform_replays_its_recorded_forward(inner, outer):
    """The function calls a torch.func transform: the tape holds the transform's ops and those
    autograd's engine ran for its backward (create_graph=True: ops of the region level's graph),
    so backward replays them and the function runs once per forward from its second call (the
    first tries once more: the transform refuses the hooks of a forward that keeps nothing).
    Under vmap(grad) around it the batched ops replay below the vmap; differentiating an input
    the vmap does not batch (its examples' gradients kept apart) backward runs it again."""
    def run(wrap):
        calls = []

        def f(x, w):
            calls.append(1)
            return (_INNER[inner](x, w) * x).cos() + x * w.sum()

        region = wrap(f)
        _OUTER[outer](region)
        calls.clear()
        return _OUTER[outer](region), len(calls)

    (want, n), (got, m) = run(ident), run(remat)
    _close(got, want)
    forward_mode = inner == "jvp"  # (no reverse level inside: no hooks refused, no graph kept)
    assert n == 1 and m == (2 if outer == "vmap_grad_of_unbatched" and not forward_mode else 1)
