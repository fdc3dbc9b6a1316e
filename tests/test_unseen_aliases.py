"""Aliases no op makes (``Tensor.as_subclass``, ``.data``): the recorded forward and the
capture check see them as the views they are, under every transform.

``as_subclass`` is a function torch function modes never see, and under a functorch level
the plain tensor below its wrapper is made without dispatch: the tape took it for a tensor
from outside (a constant), so a region returning ``h.as_subclass(torch.Tensor)`` had a zero
gradient under ``grad``/``vjp``/``jvp`` wherever it closed over a parameter, and
``a.as_subclass(TF)`` on an argument ran the function 256 times and raised."""

from __future__ import annotations

import random

import pytest
import torch
from torch.func import grad, vjp

from remat_fn import remat

from ._util import assert_tree_close, ident, one_argument_transforms

D = torch.float64
X = torch.tensor([0.3, -1.2, 2.0, 0.7], dtype=D)
W = (torch.arange(16, dtype=D).reshape(4, 4) / 10 - 0.7).requires_grad_()


class TF(torch.Tensor):
    """A do-nothing ``__torch_function__`` subclass."""


_ALL = one_argument_transforms(X)
TRANSFORMS = {k: _ALL[k] for k in ("eager", "grad", "vjp", "jvp", "jacrev", "hessian", "grad_of_grad", "vmap_grad",
                                   "eager_around_grad")}


def _output_as_plain(a):  # closes over W, which requires grad
    return (a @ W).tanh().as_subclass(torch.Tensor)


def _argument_as_subclass(a):
    return (a.as_subclass(TF).sin() * a).exp().as_subclass(torch.Tensor)


def _closure_as_subclass(a):
    return (a * W[0].as_subclass(TF)).sin().as_subclass(torch.Tensor)


def _view_as_subclass(a):
    h = a.sin()
    return (h[1:].as_subclass(TF) * a[:3]).as_subclass(torch.Tensor)


FUNCTIONS = {f.__name__[1:]: f for f in (_output_as_plain, _argument_as_subclass, _closure_as_subclass, _view_as_subclass)}


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("fn", FUNCTIONS)
def test_as_subclass_inside_a_region_matches_plain(fn, transform):
    f = FUNCTIONS[fn]
    run = TRANSFORMS[transform]

    def loss(wrap):
        return lambda a: wrap(f)(a).pow(2).sum()

    assert_tree_close(run(loss(remat)), run(loss(ident)), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_as_subclass_output_vjp_matches_plain(fn):
    """The region's output itself made by ``as_subclass`` (no op reads it inside)."""
    f = FUNCTIONS[fn]
    ct = torch.linspace(-1, 1, f(X).numel(), dtype=D).reshape(f(X).shape)
    want = vjp(f, X)[1](ct)
    for _ in range(3):  # (ids of dead tensors reused: once made the output look like a constant)
        assert_tree_close(vjp(remat(f), X)[1](ct), want, rtol=1e-10, atol=1e-10)


def test_as_subclass_of_a_closed_over_parameter_gets_its_gradient():
    """``w.as_subclass(TF)`` where ``w`` is differentiated by ``grad`` and closed over."""
    def loss(wrap):
        return lambda w: wrap(lambda a: (a * w.as_subclass(TF)).sin().as_subclass(torch.Tensor))(X).sum()

    w = torch.tensor([1.5, -0.5, 0.25, 2.0], dtype=D)
    assert_tree_close(grad(loss(remat))(w), grad(loss(ident))(w), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("transform", ["grad", "vmap_grad", "grad_of_grad"])
def test_as_subclass_results_do_not_depend_on_object_ids(transform):
    """The check for tensors to thread knew tensors by ``id``: a subclass result made where the
    id of a tensor that died inside the region came back was taken for that tensor, and took
    another path (under ``vmap(grad)`` 7.8 off in about one call in 200).  Repeated, with the
    allocations between calls varied so that ids come back in other orders, every call matches
    plain."""
    run = TRANSFORMS[transform]
    want = run(lambda a: _view_as_subclass(a).pow(2).sum())
    rng = random.Random(0)
    for _ in range(400 if transform == "vmap_grad" else 12):
        junk = [torch.empty(rng.randint(1, 5)) for _ in range(rng.randint(0, 20))]
        assert_tree_close(run(lambda a: remat(_view_as_subclass)(a).pow(2).sum()), want, rtol=1e-10, atol=1e-10)
        del junk
