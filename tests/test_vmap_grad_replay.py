"""Per-sample gradients (``vmap(grad)``) differentiate the forward level's graph, its saved
tensors replayed from the tape below the vmap levels and put back inside them: the
function's Python runs once per forward, as under ``grad``.  Where a vmap sits inside a
grad level (``grad(vmap(f))``) or a ``vjp_fn`` runs after its level exited, backward runs
the function again, with the same gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, vjp, vmap

from remat_fn import remat
from remat_fn.nn import remat_module

from ._util import assert_tree_close, plain_and_remat

D = torch.float64


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=D)
        self.lin2 = torch.nn.Linear(4, 4, dtype=D)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin2(torch.tanh(self.lin(x))) * x


def test_per_sample_gradients_of_a_module_run_it_once():
    torch.manual_seed(0)
    plain = _Block()
    params = {k: v.detach() for k, v in plain.named_parameters()}
    xs = torch.randn(5, 6, 4, dtype=D)

    def per_sample(model):
        return vmap(grad(lambda p, x: functional_call(model, p, (x,)).pow(2).sum()), in_dims=(None, 0))(params, xs)

    want = per_sample(plain)
    block = copy.deepcopy(plain)
    block.calls = 0
    got = per_sample(remat_module(block))
    assert_tree_close(got, want)
    assert plain.calls == 1 and block.calls == 1


@pytest.mark.parametrize("eager_weight", [False, True])
def test_per_sample_gradients_of_a_region_wrapping_functional_call(eager_weight):
    """The region calls functional_call itself: it closes over the module, whose own
    parameters (requiring grad) it never reads.  They neither make backward run the function
    again nor change what eager autograd differentiates around the per-sample gradients (a
    loss weight outside the region that requires grad reaches them through the cotangents)."""
    torch.manual_seed(0)
    block = _Block()
    params = {k: v.detach() for k, v in block.named_parameters()}
    xs = torch.randn(3, 6, 4, dtype=D)
    scale = torch.randn(4, dtype=D, requires_grad=eager_weight)

    def run(wrap):
        block.calls = 0
        scale.grad = None
        call = lambda p, x: wrap(lambda x: functional_call(block, p, (x,)))(x)
        g = vmap(grad(lambda p, x: (call(p, x) * scale).pow(2).sum()), in_dims=(None, 0))(params, xs)
        out = [g, block.calls]
        if eager_weight:
            (g["lin.weight"].pow(2).sum() + g["lin2.bias"].sin().sum()).backward()
            out.append(scale.grad)
        return out

    want, got = run(lambda f: f), run(remat)
    assert got[1] == want[1] == 1
    assert_tree_close(got[0], want[0])
    if eager_weight:
        assert_tree_close(got[2], want[2])


def _reads_in_backward(how):
    """A region that reaches ``w`` but reads it only in backward code of its own: a hook, a
    custom Function's backward (stored on ctx), a global its backward reads; or returns it."""
    w = torch.tensor([1.5, 2.0, -0.5], dtype=D, requires_grad=True)

    class G(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            return x.sin()

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])
            ctx.w = w

        @staticmethod
        def backward(ctx, g):
            return g * ctx.saved_tensors[0].cos() * ctx.w

    def hook(x):
        h = x.sin()
        h.register_hook(lambda g: g * w)
        return h

    fns = {"hook": hook, "function_backward": lambda x: G.apply(x) if w is not None else x,
           "returned": lambda x: (x.sin(), w)}
    return w, fns[how]


def _total(r):
    return (r[0] * r[1]).sum() if isinstance(r, tuple) else r.sum()


@pytest.mark.parametrize("transform", ["grad", "vjp", "vmap_grad"])
@pytest.mark.parametrize("how", ["hook", "function_backward", "returned"])
def test_a_closed_over_tensor_read_only_in_backward_keeps_eager_autograd_through_it(how, transform):
    """The tensors no op of the forward reads (see unread_inputs) leave backward's graph alone
    only where the backward runs no code of the user's: a tensor a hook or a custom Function's
    backward reads, or one the function returns, still ties eager autograd to the gradient
    (found by a hostile pass over a first version: w's gradient None or a RuntimeError)."""
    x0 = torch.tensor([0.3, -0.7, 1.1], dtype=D)
    xs = torch.stack([x0, x0.cos()])
    c = torch.tensor([0.2, 0.1, 0.4], dtype=D)

    def run(wrap):
        w, f = _reads_in_backward(how)
        loss = lambda x: _total(wrap(f)(x)) + (x * c).sum()
        if transform == "grad":
            g = grad(loss)(x0)
        elif transform == "vjp":
            out, fn = vjp(loss, x0)
            g = fn(torch.ones_like(out))[0]
        else:
            g = vmap(grad(loss))(xs)
        return g, torch.autograd.grad((g ** 2).sum(), w, allow_unused=True)[0]

    assert_tree_close(run(remat), run(lambda f: f))


@pytest.mark.parametrize("loss", ["sum", "square"])
def test_vmap_grad_of_a_module_whose_parameters_require_grad_runs_it_once(loss):
    """Per-sample input gradients of a module with ordinary parameters (they require grad): eager
    autograd may differentiate them (a gradient penalty), so backward replays the batched ops
    below the vmap, recorded by eager autograd as plain code's are; the function runs once."""
    torch.manual_seed(0)
    plain = _Block()
    block = copy.deepcopy(plain)
    xs = torch.randn(3, 6, 4, dtype=D)

    def run(m, f):
        m.calls = 0
        # (square: the cotangent depends on the output, so the penalty's backward goes through the
        # region's own eager node too, under the rule's vmap, summing the weight's examples)
        g = vmap(grad(lambda x: f(x).sum() if loss == "sum" else f(x).pow(2).sum()))(xs)
        return g, torch.autograd.grad(g.pow(2).sum(), m.lin.weight)[0], m.calls

    want, got = run(plain, plain), run(block, remat(block))
    assert got[2] == want[2] == 1
    assert_tree_close(got[:2], want[:2])


_G = torch.Generator().manual_seed(4)
_W = torch.randn(4, 4, dtype=D, generator=_G) / 2
_XB = torch.randn(3, 2, 4, dtype=D, generator=_G)


def _f(calls):
    def f(x, w):
        calls.append(1)
        h = torch.tanh(x @ w)
        return (h * h.exp()).sin() + x
    return f


# name -> (run(wrap), how many times remat's function runs for one forward)
_CASES = {
    "grad_of_w": (lambda wrap, f: vmap(grad(lambda w, x: wrap(f)(x, w).pow(2).sum()), in_dims=(None, 0))(_W, _XB), 1),
    "grad_of_x": (lambda wrap, f: vmap(grad(lambda x, w: wrap(f)(x, w).pow(2).sum()), in_dims=(0, None))(_XB, _W), 1),
    "batch_dim_1": (lambda wrap, f: vmap(grad(lambda x, w: wrap(f)(x, w).pow(2).sum()), in_dims=(1, None))(
        _XB.movedim(0, 1).contiguous(), _W), 1),
    "both_batched": (lambda wrap, f: vmap(grad(lambda w, x: wrap(f)(x, w).pow(2).sum()))(
        torch.stack([_W, 2 * _W, -_W]), _XB), 1),
    "vmap_of_vmap": (lambda wrap, f: vmap(vmap(grad(lambda w, x: wrap(f)(x, w).pow(2).sum()), in_dims=(None, 0)),
                                          in_dims=(None, 0))(_W, torch.stack([_XB, -_XB])), 1),
    # (the vjp_fn called after its grad level exited, under the vmap: the forward's torch calls replay,
    # remat_fn._logical; the function ran again until this)
    "vjp_fn_after_its_level": (lambda wrap, f: vmap(lambda x: vjp(lambda w: wrap(f)(x, w), _W)[1](
        torch.ones(2, 4, dtype=D))[0])(_XB), 1),
    # (backward replays the batched ops below the vmap: it ran the function again until this)
    "grad_of_vmap": (lambda wrap, f: grad(lambda w: vmap(lambda x: wrap(f)(x, w).pow(2).sum())(_XB).sum())(_W), 1),
}


@pytest.mark.parametrize("name", list(_CASES))
def test_vmap_grad_matches_plain_and_runs_the_function_once(name):
    run, runs = _CASES[name]
    plain_calls: list = []
    want = run(lambda f: f, _f(plain_calls))
    calls: list = []
    got = run(remat, _f(calls))
    assert_tree_close(got, want)
    assert len(calls) == runs * len(plain_calls)


def test_vmap_grad_random_draws_replay_the_same_bits():
    """A draw batched by ``randomness='different'`` leaves the graph for a run again, each
    draw from its recorded state (see draws_in_vmap)."""
    gen = torch.Generator()

    def f(x):
        return (torch.rand(x.shape, generator=gen, dtype=x.dtype) * x).exp()

    def run(fn):
        gen.manual_seed(5)
        return vmap(grad(lambda a: fn(a).sum()), randomness="different")(_XB)

    assert torch.equal(run(remat(f)), run(f))


_f2 = lambda x, w: (torch.tanh(x @ w) * x).sin()  # noqa: E731
_AROUND = {
    "vmap_jacrev": lambda F: vmap(jacrev(lambda w, x: F(x, w).sum(0)), in_dims=(None, 0))(_W, _XB),
    "vmap_hessian": lambda F: vmap(hessian(lambda w, x: F(x, w).sum()), in_dims=(None, 0))(_W, _XB),
    "vmap_grad_of_grad": lambda F: vmap(grad(lambda w, x: grad(lambda w: F(x, w).pow(2).sum())(w).pow(2).sum()),
                                        in_dims=(None, 0))(_W, _XB),
    "vmap_jacfwd": lambda F: vmap(jacfwd(lambda w, x: F(x, w).sum(0)), in_dims=(None, 0))(_W, _XB),
    "jacrev_of_vmap_grad": lambda F: jacrev(lambda w: vmap(grad(lambda w, x: F(x, w).pow(2).sum()),
                                                           in_dims=(None, 0))(w, _XB).sum(0))(_W),
}


@pytest.mark.parametrize("name", list(_AROUND))
def test_transforms_around_vmap_grad_match_plain(name):
    """Levels that differentiate the per-sample backward (an outer grad, forward mode, a
    vmap over cotangents) keep the exact result: there the function runs again."""
    assert_tree_close(_AROUND[name](remat(_f2)), _AROUND[name](_f2))


def test_eager_autograd_around_vmap_grad_matches_plain():
    w = _W.clone().requires_grad_()

    def run(F):
        g = vmap(grad(lambda x, w: F(x, w).pow(2).sum()), in_dims=(0, None))(_XB, w)
        return g, torch.autograd.grad(g.pow(2).sum(), w)[0]

    assert_tree_close(run(remat(_f2)), run(_f2))


@pytest.mark.parametrize("randomness", ["same", "different"])
def test_random_draws_under_vmap_match_plain_where_the_graph_serves_and_where_it_runs_again(randomness):
    def f(x, w):
        return torch.tanh(x @ w) * torch.rand(4, dtype=D) + torch.nn.functional.dropout(x @ w, 0.5)

    def run(F):
        torch.manual_seed(0)
        a = vmap(lambda x: vjp(lambda w: F(x, w), _W)[1](torch.ones(2, 4, dtype=D))[0], randomness=randomness)(_XB)
        b = vmap(grad(lambda w, x: F(x, w).pow(2).sum()), in_dims=(None, 0), randomness=randomness)(_W, _XB)
        c = grad(lambda w: vmap(lambda x: F(x, w).pow(2).sum(), randomness=randomness)(_XB).sum())(_W)
        return a, b, c

    assert_tree_close(run(remat(f)), run(f))


def _side_program(how):
    """``vmap(grad)`` of a loss over a region that appends a tensor to a list, read after it."""
    def run(wrap, calls):
        def loss(w, x):
            side: list = []

            def f(x, w):
                calls.append(1)
                h = torch.tanh(x @ w)
                side.append(h)
                if how == "stacked_inside":  # (the region reads the list it appends to)
                    return torch.stack(side).sum(0) * 2 + x
                return side[0] * 2 + h.sin()

            o = wrap(f)(x, w)
            s = side[0]
            if how == "replaced_after":  # (the caller replaces the entry after the region)
                side[0] = s * 1.0
            return o.pow(2).sum() + s.pow(3).sum() + side[0].sum()
        return vmap(grad(loss), in_dims=(None, 0))(_W, _XB)
    return run


@pytest.mark.parametrize("how", ["read_after", "replaced_after", "stacked_inside"])
def test_vmap_grad_with_a_side_output_differentiates_the_forward_level_graph(how):
    """A side output under ``vmap(grad)``: backward differentiates the forward level's graph,
    as without one.  The function ran again, reading the caller's list as it was then: the
    replacement (12.2 off before) or a list one entry longer (``stack``: a false
    ``RecomputeMismatchError``)."""
    run = _side_program(how)
    plain: list = []
    want = run(lambda f: f, plain)
    calls: list = []
    got = run(remat, calls)
    assert_tree_close(got, want)
    assert len(calls) == len(plain)


_VJP_FN_UNDER_VMAP = {
    "vmap_vjp": lambda g, x, w: vmap(lambda xx: (lambda o, fn: fn(o)[0])(*vjp(lambda v: g(v, w), xx)), randomness="different")(x),
    "vmap_vjp_twice": lambda g, x, w: vmap(lambda xx: (lambda o, fn: fn(o)[0] + fn(o.cos())[0])(*vjp(lambda v: g(v, w), xx)),
                                           randomness="different")(x),
    "vmap_jacrev": lambda g, x, w: vmap(lambda xx: jacrev(lambda v: g(v, w))(xx), randomness="different")(x),
}


@pytest.mark.parametrize("draw", [False, True])
@pytest.mark.parametrize("how", sorted(_VJP_FN_UNDER_VMAP))
def test_vjp_fn_called_under_vmap_after_its_level_exited(how, draw):
    # Under vmap(vjp) and vmap(jacrev) the backward runs after the grad level exited, under the vmap
    # alone (jacrev's own vmap over the cotangents too): where the differentiated input is batched,
    # the recorded forward replays below the vmaps as under grad(vmap), so the function runs once (it
    # ran again, once per vjp_fn call, until this; with a random draw under vmap(jacrev), whose vmap
    # forbids drawing, that run was refused with a RematError).
    x = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(8))
    w = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(9))

    def make(calls):
        def f(x, w):
            calls.append(1)
            out = (x * w).sin()
            return out * torch.rand(4, dtype=D) if draw else out
        return f
    (want, n_plain), (got, n_remat) = plain_and_remat(make, lambda f: _VJP_FN_UNDER_VMAP[how](f, x, w), seed=3)
    assert_tree_close(got, want, rtol=1e-10, atol=1e-10)
    assert n_remat == n_plain == 1


def test_a_parameter_the_module_never_uses_gets_no_gradient_through_per_sample_gradients():
    """A gradient penalty on per-sample gradients of a remat_module: a parameter its forward
    never reads gets None, as plain autograd leaves it (zeros until unread_inputs said so)."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4, dtype=D)
            self.unused = torch.nn.Parameter(torch.ones(4, dtype=D))

        def forward(self, x):
            return self.lin(x).tanh()

    torch.manual_seed(0)
    base, xs = M(), torch.randn(3, 4, dtype=D)

    def run(wrap):
        m = wrap(copy.deepcopy(base))
        p = {k: v.detach().requires_grad_() for k, v in m.named_parameters()}
        g = vmap(grad(lambda p, x: functional_call(m, p, (x,)).pow(2).sum()), in_dims=(None, 0))(p, xs)
        return torch.autograd.grad(sum(v.pow(2).sum() for v in g.values()), list(p.values()), allow_unused=True)

    got, want = run(remat_module), run(lambda m: m)
    assert [g is None for g in got] == [w is None for w in want] == [True, False, False]  # (unused, lin.weight, lin.bias)
    assert_tree_close([g for g in got if g is not None], [w for w in want if w is not None])
