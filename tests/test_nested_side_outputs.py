"""A tensor a nested region puts in a list (a side channel) and that is read after the
enclosing region returns, or by the enclosing region itself: remat gives plain's
derivatives under every transform, and runs each function's Python once in the forward.

The enclosing region did not know the nested call had made that tensor: its check for
tensors it must thread took it for one it closes over and ran its forward again (the list
then held two tensors, the first from the abandoned try), and it never returned the tensor
as a side output of its own: 13.2 off under ``grad`` and ``vjp``, 34.6 under ``jvp``, 8.9
under ``hessian``; eager was exact."""

from __future__ import annotations

import pytest
import torch
from torch.func import grad, hessian, jacfwd, jvp, vjp, vmap

from remat_fn import remat

from ._util import assert_tree_close

D = torch.float64
_g = torch.Generator().manual_seed(0)
X = torch.randn(3, dtype=D, generator=_g)
W = torch.randn(3, dtype=D, generator=_g)


def ident(f):
    return f


def read_after_outer(x, w, wrap, calls):
    side = []

    def inner(a):
        calls["inner"] += 1
        u = a * w
        side.append(u.sin())
        return u

    f0 = wrap(inner)

    def outer(h):
        calls["outer"] += 1
        return f0(h) * 2

    out = wrap(outer)(x)
    return (out * side[0]).sum()


def read_by_outer(x, w, wrap, calls):
    side = []

    def inner(a):
        calls["inner"] += 1
        u = a * w
        side.append(u.sin())
        return u

    f0 = wrap(inner)

    def outer(h):
        calls["outer"] += 1
        return f0(h) + side[0]

    return wrap(outer)(x).pow(2).sum()


def _eager(f):
    xl, wl = X.clone().requires_grad_(), W.clone().requires_grad_()
    return torch.autograd.grad(f(xl, wl), (xl, wl))


TRANSFORMS = {
    "eager": _eager,
    "grad": lambda f: grad(f, argnums=(0, 1))(X, W),
    "vjp": lambda f: vjp(f, X, W)[1](torch.ones((), dtype=D)),
    "jvp": lambda f: jvp(f, (X, W), (X, W)),
    "jacfwd": lambda f: jacfwd(f, argnums=(0, 1))(X, W),
    "hessian": lambda f: hessian(f)(X, W),
    "grad_of_grad": lambda f: grad(lambda x: grad(f)(x, W).pow(2).sum())(X),
    "vmap_grad": lambda f: vmap(grad(f), in_dims=(0, None))(torch.stack([X, 2 * X]), W),
}
ONCE = ("eager", "grad", "vjp", "jvp")  # one forward, its Python once (elsewhere: docs/design.md)


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("program", [read_after_outer, read_by_outer], ids=lambda p: p.__name__)
def test_nested_side_output_matches_plain(program, transform, request):
    if program is read_by_outer and transform == "vmap_grad":
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "vmap(grad) still runs the enclosing function again in backward (its tape holds batched "
            "ops), where side[0] is the forward's tensor, not the re-run's: open (docs/design.md)")))
    run = TRANSFORMS[transform]
    want_calls, got_calls = {"inner": 0, "outer": 0}, {"inner": 0, "outer": 0}
    want = run(lambda x, w: program(x, w, ident, want_calls))
    got = run(lambda x, w: program(x, w, remat, got_calls))
    assert_tree_close(got, want, rtol=1e-10, atol=1e-10)
    if transform in ONCE:
        assert got_calls == want_calls
