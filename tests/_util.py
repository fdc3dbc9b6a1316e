"""Shared helpers for the test-suite: compare a transform of f and of remat(f)."""

from __future__ import annotations

import optree
import torch
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.utils._python_dispatch import TorchDispatchMode


def ident(f):
    """The plain function: what ``remat`` is compared with (``wrap=ident``)."""
    return f


def plain_and_remat(make, run, seed: int | None = None) -> tuple:
    """``run(g)`` for ``g`` the plain function ``make(calls)`` and for its ``remat``, each with the
    number of times its Python ran (``calls``' length): ``((plain, runs), (remat, runs))``.
    ``seed``: torch's global seed before each, so that their draws are alike."""
    from remat_fn import remat

    out = []
    for wrap in (ident, remat):
        calls: list = []
        if seed is not None:
            torch.manual_seed(seed)
        out.append((run(wrap(make(calls))), len(calls)))
    return tuple(out)


def assert_tree_close(a, b, *, exact: bool = False, rtol=1e-6, atol=1e-7):
    la, ta = optree.tree_flatten(a, none_is_leaf=True)
    lb, tb = optree.tree_flatten(b, none_is_leaf=True)
    assert ta == tb, f"tree structure differs: {ta} vs {tb}"
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor), (x, y)
            assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape, x.dtype, y.dtype)
            if exact:
                assert torch.equal(x, y), (x - y).abs().max()
            else:
                torch.testing.assert_close(x, y, rtol=rtol, atol=atol)
        else:
            assert x == y, (x, y)


def one_argument_transforms(x: torch.Tensor) -> dict:
    """``name -> run(f)``: ``f(x)`` (a scalar) differentiated by each transform, and by eager
    autograd around ``torch.func.grad`` (the meta-learning outer loop)."""
    def eager(f):
        xl = x.clone().requires_grad_()
        return torch.autograd.grad(f(xl), xl)

    def eager_around_grad(f):
        xl = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(grad(f)(xl).pow(2).sum(), xl)
        return g

    return {
        "eager": eager,
        "grad": lambda f: grad(f)(x),
        "vjp": lambda f: vjp(f, x)[1](torch.ones((), dtype=x.dtype)),
        "jvp": lambda f: jvp(f, (x,), (torch.ones_like(x),)),
        "jacrev": lambda f: jacrev(f)(x),
        "jacfwd": lambda f: jacfwd(f)(x),
        "hessian": lambda f: hessian(f)(x),
        "grad_of_grad": lambda f: grad(lambda y: grad(f)(y).pow(2).sum())(x),
        "vmap_grad": lambda f: vmap(grad(f))(torch.stack([x, 2 * x])),
        "eager_around_grad": eager_around_grad,
    }


def two_argument_transforms(x: torch.Tensor, w: torch.Tensor) -> dict:
    """``name -> run(f)``: ``f(x, w)`` (a scalar) differentiated by each transform."""
    def eager(f):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        return torch.autograd.grad(f(xl, wl), (xl, wl))

    return {
        "eager": eager,
        "grad": lambda f: grad(f, argnums=(0, 1))(x, w),
        "vjp": lambda f: vjp(f, x, w)[1](torch.ones((), dtype=x.dtype)),
        "jvp": lambda f: jvp(f, (x, w), (x, w)),
        "jacfwd": lambda f: jacfwd(f, argnums=(0, 1))(x, w),
        "hessian": lambda f: hessian(f)(x, w),
        "grad_of_grad": lambda f: grad(lambda y: grad(f)(y, w).pow(2).sum())(x),
        "vmap_grad": lambda f: vmap(grad(f), in_dims=(0, None))(torch.stack([x, 2 * x]), w),
    }


def grads_of(loss_fn, leaves):
    """Eager gradients of ``loss_fn(*leaves)`` w.r.t. fresh leaf copies."""
    xs = [x.detach().clone().requires_grad_(True) for x in leaves]
    loss = loss_fn(*xs)
    return torch.autograd.grad(loss, xs, allow_unused=True)


def draw_steps(draw, st, n_vals: int, max_steps: int, unary, binary):
    """Hypothesis helper: a straight-line program over ``n_vals`` starting values;
    each step applies a unary or binary op (by name) to earlier values and adds
    one value.  Returns ``(steps, n_vals)``."""
    steps = []
    for _ in range(draw(st.integers(1, max_steps))):
        if draw(st.booleans()):
            steps.append(("u", draw(st.sampled_from(sorted(unary))), draw(st.integers(0, n_vals - 1))))
        else:
            steps.append(("b", draw(st.sampled_from(sorted(binary))),
                          draw(st.integers(0, n_vals - 1)), draw(st.integers(0, n_vals - 1))))
        n_vals += 1
    return steps, n_vals


class OpCount(TorchDispatchMode):
    """Counts the aten ops run while it is active, by op name (``n["mm"]``)."""

    def __init__(self):
        super().__init__()
        self.n: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        k = func.overloadpacket.__name__
        self.n[k] = self.n.get(k, 0) + 1
        return func(*args, **(kwargs or {}))


def recursive_checkpoint(funs, wrap):
    """JAX's ``recursive_checkpoint`` (``RematTest``): the composition of ``funs``, its second
    half of each level wrapped by ``wrap`` (a remat)."""
    if len(funs) == 1:
        return funs[0]
    if len(funs) == 2:
        f1, f2 = funs
        return lambda x: f1(f2(x))
    f1 = recursive_checkpoint(funs[: len(funs) // 2], wrap)
    f2 = recursive_checkpoint(funs[len(funs) // 2:], wrap)
    return lambda x: f1(wrap(f2)(x))


class STE(torch.autograd.Function):
    """A straight-through estimator: its backward and jvp are not its forward's derivative."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x.round()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g

    @staticmethod
    def jvp(ctx, t):
        return t


def square_function(name: str, k: float = 2.0):
    """``x * x`` as a custom ``autograd.Function`` (with a forward-mode rule and torch's generated
    vmap rule) whose backward and jvp say ``k * x`` (2: its derivative; another ``k`` shows which
    rule ran)."""
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    return type(name, (torch.autograd.Function,), {
        "generate_vmap_rule": True,
        "forward": staticmethod(lambda x: x * x),
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(lambda ctx, g: k * ctx.saved_tensors[0] * g),
        "jvp": staticmethod(lambda ctx, t: k * ctx.saved_tensors[0] * t),
    })


# inside a region, a replay through the transforms applies it as one step (its backward, not its
# forward's ops, is what autograd differentiates)
Square = square_function("Square")
