"""Outputs that are views of each other, written in place after the region, under ``vmap``.

A region returning ``(t, t[0])`` hands the caller two tensors on one memory; plain code's
``t[0]`` is a view of ``t``, so ``a.mul_(3)`` after the region changes ``b`` *and its
gradient*.  The Function's outputs are rebuilt as views of each other after it
(``remat_fn/_func_graph.py``), but under ``vmap`` (wrapped tensors) they were not: ``b``
kept the value written through ``a`` and lost the write's gradient (``d b / d x[0]`` was 1
where plain gives 3; the loss below was 5.5 off under ``vmap(grad)``).  Each case is
compared with the plain function (the region replaced by the identity) under every
transform.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

from remat_fn import remat

D = torch.float64
_G = torch.Generator().manual_seed(0)
X = torch.randn(3, 4, dtype=D, generator=_G) / 2
W = torch.randn(4, dtype=D, generator=_G) / 2


def ident(f):
    return f


def _close(a, b):
    for x, y in zip(torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


def test_minimal_view_output_sees_the_write_into_its_base_under_vmap_grad():
    """``b = t[0]`` beside ``t``; ``t`` tripled in place after the region: ``d b / d x[0]`` is 3."""
    x, w = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=D), torch.ones(4, dtype=D)

    def make(wrap):
        region = wrap(lambda h, w: (lambda t: (t, t[0]))(h * w + 0.0))

        def loss(x, w):
            a, b = region(x, w)
            a.mul_(3)
            return b

        return loss

    got = vmap(grad(make(remat)), in_dims=(0, None))(x, w)
    assert got.tolist() == [[3.0, 0.0, 0.0, 0.0]]
    _close(got, vmap(grad(make(ident)), in_dims=(0, None))(x, w))


def _tanh(h, w):
    return torch.tanh(h * w) + 0.0  # (+ 0: tanh saves its output, which the writes below change)


# Each region returns its outputs; the loss writes ``written`` (an index) in place.
_REGIONS = {
    "select": (lambda h, w: (lambda t: (t, t[0]))(_tanh(h, w)), 0),
    "select_first": (lambda h, w: (lambda t: (t[0], t))(_tanh(h, w)), 1),
    "view": (lambda h, w: (lambda t: (t, t.view(2, 2)))(_tanh(h, w)), 0),
    "slice": (lambda h, w: (lambda t: (t, t[1:3]))(_tanh(h, w)), 0),
    "transpose": (lambda h, w: (lambda t: (t, t.t()))(torch.tanh(h.unsqueeze(0) * w.unsqueeze(1)) + 0.0), 0),
    "write_into_the_view": (lambda h, w: (lambda t: (t, t[1:3]))(_tanh(h, w)), 1),
    "two_views": (lambda h, w: (lambda t: (t, t[0], t[1:3]))(_tanh(h, w)), 0),
    "view_of_a_view_output": (lambda h, w: (lambda t: (t[1:], t[2]))(_tanh(h, w)), 0),
}


def _make(wrap, case):
    fn, written = _REGIONS[case]
    region = wrap(fn)

    def loss(x, w):
        outs = region(x, w)
        outs[written].mul_(3)
        return sum(o.sin().sum() * (k + 1) for k, o in enumerate(outs))

    return loss


_V = torch.linspace(-1, 1, 4, dtype=D)
_TRANSFORMS = {
    "vmap_grad": lambda f: vmap(grad(f, argnums=(0, 1)), in_dims=(0, None))(X, W),
    "vmap_grad_batch_dim_1": lambda f: vmap(grad(f, argnums=(0, 1)), in_dims=(1, None))(X.t().contiguous(), W),
    "vmap_grad_both_batched": lambda f: vmap(grad(f, argnums=(0, 1)))(X, torch.stack([W, 2 * W, W / 2])),
    "vmap_vjp": lambda f: vmap(lambda x, w: vjp(f, x, w)[1](torch.ones((), dtype=D)), in_dims=(0, None))(X, W),
    "vmap_jacrev": lambda f: vmap(jacrev(f, argnums=(0, 1)), in_dims=(0, None))(X, W),
    "vmap_hessian": lambda f: vmap(hessian(f), in_dims=(0, None))(X, W),
    "vmap_vmap_grad": lambda f: vmap(vmap(grad(f, argnums=(0, 1)), in_dims=(0, None)), in_dims=(0, None))(torch.stack([X, 2 * X]), W),
    "grad_of_vmap": lambda f: grad(lambda x, w: vmap(f, in_dims=(0, None))(x, w).sum(), argnums=(0, 1))(X, W),
    "eager_around_vmap": lambda f: _eager(lambda x, w: vmap(f, in_dims=(0, None))(x, w).sum(), X, W),
    "vmap_jvp": lambda f: vmap(lambda x, w: jvp(f, (x, w), (_V, W.cos())), in_dims=(0, None))(X, W),
    "jvp_of_vmap": lambda f: jvp(lambda x, w: vmap(f, in_dims=(0, None))(x, w), (X, W), (torch.ones_like(X), W.cos())),
    "vmap_value": lambda f: vmap(f, in_dims=(0, None))(X, W),
    # (exact before: the outputs were rebuilt as views outside vmap)
    "grad": lambda f: grad(f, argnums=(0, 1))(X[0], W),
    "vjp": lambda f: vjp(f, X[0], W)[1](torch.ones((), dtype=D)),
    "jacrev": lambda f: jacrev(f, argnums=(0, 1))(X[0], W),
    "jvp": lambda f: jvp(f, (X[0], W), (_V, W.cos())),
    "jacfwd": lambda f: jacfwd(f, argnums=(0, 1))(X[0], W),
    "eager": lambda f: _eager(f, X[0], W),
}


def _eager(f, x, w):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    f(x, w).backward()
    return x.grad, w.grad


@pytest.mark.parametrize("transform", sorted(_TRANSFORMS))
@pytest.mark.parametrize("case", sorted(_REGIONS))
def test_outputs_that_are_views_of_each_other_written_in_place(case, transform):
    tr = _TRANSFORMS[transform]
    _close(tr(_make(remat, case)), tr(_make(ident, case)))


def test_view_output_written_in_place_under_eager_autograd_around_vmap():
    """One output, a view of a tensor made inside: autograd refused the write into a
    custom Function's view output ("Output 0 of Vmapped_RematFunction is a view and is
    being modified inplace"), which plain code makes."""

    def run(wrap):
        f = wrap(lambda x: (x * 2)[1:])

        def g(x):
            o = f(x)
            o.mul_(2)
            return o.sin().sum()

        return _eager(lambda x, w: vmap(g)(x * w).sum(), X, W)

    _close(run(remat), run(ident))
