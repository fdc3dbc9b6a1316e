"""Nested regions given tensors their enclosing region made: no false refusals.

Two ways the enclosing region's forward refused correct programs under ``torch.func``:

* its side-output check took the base of a view a nested region saved (``inner(h[1:])``)
  for a tensor that left the region by a side channel ("made inside the region left it by
  a side channel ... cannot be connected to the gradient");
* its check for tensors it must thread saw the nested region's own setup read
  ``requires_grad`` of plain tensors below the wrappers, took them for closed-over tensors
  and tried again 256 times (``remat_scan(checkpoints=1)`` with ``xs`` made from a
  differentiated weight, and ``jacrev`` of ``jacrev`` of any nested scan).
"""

from __future__ import annotations

import pytest
import torch
from torch.func import grad, jacrev

from remat_fn import policies, remat, remat_scan

from ._util import assert_tree_close, ident, two_argument_transforms

D = torch.float64
_g = torch.Generator().manual_seed(0)
X = torch.randn(4, dtype=D, generator=_g)
W = torch.randn(4, dtype=D, generator=_g)


TRANSFORMS = {k: v for k, v in two_argument_transforms(X, W).items() if k != "vmap_grad"}

VIEWS = {
    "slice": lambda h: h[1:],
    "unsqueeze_index": lambda h: h.unsqueeze(0)[0],
    "strided": lambda h: h[::2],
}


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("view", VIEWS)
def test_nested_region_given_a_view_of_an_intermediate(view, transform):
    take = VIEWS[view]

    def loss(wrap):
        def f(x, w):
            inner = wrap(lambda a: a * w[: a.shape[0]])

            def outer(x):
                h = torch.sin(x)
                return inner(take(h)).sum() * h

            return wrap(outer)(x).pow(2).sum()

        return f

    run = TRANSFORMS[transform]
    assert_tree_close(run(loss(remat)), run(loss(ident)), rtol=1e-10, atol=1e-10)


def _scan_loss(use_scan, policy):
    def f(x, w):
        x = x[:3].reshape(1, 3)
        wm = torch.outer(w[:3], w[1:]) / 2
        xs = torch.stack([wm[0], wm[1], wm[2], wm[0] * 2, wm[1] * 0.5])  # xs made from the weight
        step = lambda c, xi: (torch.tanh(c @ wm + xi), c.sum(-1))  # noqa: E731
        if use_scan:
            c, ys = remat_scan(step, x, xs, checkpoints=1, policy=policy)
        else:
            c, yl = x, []
            for i in range(xs.shape[0]):
                c, y = step(c, xs[i])
                yl.append(y)
            ys = torch.stack(yl)
        return (c + ys.sum(0).unsqueeze(-1)).pow(2).sum()

    return f


@pytest.mark.parametrize("policy", [None, policies.dots_saveable], ids=["default", "dots_saveable"])
@pytest.mark.parametrize("transform", ["grad", "jacrev_of_jacrev", "eager"])
def test_scan_checkpoints_1_xs_from_a_differentiated_weight(transform, policy):
    run = {
        "grad": lambda f: grad(f, argnums=(0, 1))(X, W),
        "jacrev_of_jacrev": lambda f: jacrev(jacrev(f, argnums=(0, 1)), argnums=(0, 1))(X, W),
        "eager": TRANSFORMS["eager"],
    }[transform]
    assert_tree_close(run(_scan_loss(True, policy)), run(_scan_loss(False, policy)), rtol=1e-9, atol=1e-10)

