"""Structured helpers: ``remat_sequential`` and ``remat_scan``.

``remat_sequential`` is the ``torch.utils.checkpoint.checkpoint_sequential``
analogue; ``remat_scan`` is JAX's ``lax.scan`` with checkpointing *across*
iterations.  Both are built from :func:`remat_fn.remat`, so they work under
eager autograd and under every ``torch.func`` transform.

Checkpointing schedules of ``remat_scan`` for ``n`` steps
----------------------------------------------------------

``"all"``
    Every step is its own remat region: ``n`` carries are kept, each step is
    evaluated twice (``2n`` evaluations of ``f``).
``"sqrt"``
    Chen et al. (2016): ``k = ceil(sqrt(n))`` steps per segment, every
    segment but the last is a remat region.  Kept: ``ceil(n/k)`` carries plus,
    during backward, the activations of one segment, i.e. ``O(sqrt n)``;
    evaluations ``2n - (length of the last segment)``.
``c`` (an int >= 1)
    Binomial checkpointing (Griewank 1992; Griewank & Walther 2000, "Revolve"):
    at most ``c`` carries (counting ``init``) are held at any time, plus the
    activations of a single step.  With ``r`` the smallest integer such that
    ``binom(c + r, c) >= n`` the number of evaluations of ``f`` (forward
    sweep, recomputations and the final evaluation of each step whose
    activations backward consumes) is the proven minimum

        ``T(n, c) = (r + 1) * n - binom(c + r, r - 1)``      (``T(1, c) = 1``)

    e.g. ``c = 1`` gives ``n (n + 1) / 2`` (recompute from ``init`` each time),
    ``c >= n - 1`` gives ``2n - 1``.  :func:`revolve_evaluations` returns it.

    The schedule is the recursion ``R(l, c) = R(l - m, c - 1) o remat(R(m, c))``
    with the split ``m`` minimising ``m + T(l - m, c - 1) + T(m, c)``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import optree
import torch

from ._errors import RematError
from ._torch_internals import FakeTensorMode
from ._transform import remat

__all__ = ["remat_sequential", "remat_scan", "revolve_evaluations", "sequential_segments"]


# --------------------------------------------------------------------------- sequential
def _run_chain(functions, x):
    for fn in functions:
        x = fn(x)
    return x


def sequential_segments(functions, segments, input, *, policy, preserve_rng_state):
    """``checkpoint_sequential``'s segmentation with remat (shared by ``remat_sequential``
    and :func:`remat_fn.compat.checkpoint_sequential`)."""
    # (every entry, a module repeated included, as the Sequential itself runs them: torch's
    # checkpoint_sequential takes children(), which lists a repeated module once)
    functions = list(functions)
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(f"segments must be a positive int, got {segments!r}")
    n = len(functions)
    if n == 0:
        return input  # (as an empty nn.Sequential; torch's checkpoint_sequential raises a ValueError)
    segments = min(segments, n)
    size = n // segments
    end = -1
    # Same segmentation as torch.utils.checkpoint.checkpoint_sequential: all but
    # the last segment are rematerialised; the last one's activations are needed
    # right away by backward.
    for start in range(0, size * (segments - 1), size):
        end = start + size - 1
        seg = functools.partial(_run_chain, functions[start : end + 1])
        input = remat(seg, policy=policy, preserve_rng_state=preserve_rng_state)(input)
    return _run_chain(functions[end + 1 :], input)


def remat_sequential(functions, segments: int, input, *, policy=None):
    """Run ``functions`` in order, rematerialising all but the last of ``segments`` chunks.

    The ``checkpoint_sequential`` analogue: ``functions`` is an ``nn.Sequential``
    or a list of callables, each taking the previous one's output (any pytree).
    The segmentation is torch's: ``len(functions) // segments`` functions per
    segment, the last segment takes the rest and is not rematerialised.
    ``segments`` larger than the number of functions is clamped.

    >>> import torch, remat_fn
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
    >>> x = torch.randn(2, 4)
    >>> torch.allclose(remat_fn.remat_sequential(net, 2, x), net(x))
    True
    """
    return sequential_segments(functions, segments, input, policy=policy, preserve_rng_state=True)


# --------------------------------------------------------------------------- scan
def revolve_evaluations(n: int, c: int) -> int:
    """Minimal number of step evaluations to differentiate ``n`` steps with ``c`` checkpoints."""
    if n < 0 or c < 1:
        raise ValueError(f"need n >= 0 and c >= 1, got n={n}, c={c}")
    if n <= 1:
        return n
    r = 0
    while math.comb(c + r, c) < n:
        r += 1
    return (r + 1) * n - math.comb(c + r, r - 1)


def _split(n: int, c: int) -> int:
    """Length of the first (rematerialised) part of an ``n``-step schedule with ``c`` checkpoints."""
    if c == 1:
        return n - 1
    best, best_m = None, 1
    for m in range(1, n):
        cost = m + revolve_evaluations(n - m, c - 1) + revolve_evaluations(m, c)
        if best is None or cost < best:
            best, best_m = cost, m
    return best_m


def _index(xs, i):
    if xs is None:
        return None
    return optree.tree_map(lambda a: a[i], xs)


def _slice(xs, a, b):
    if xs is None:
        return None
    return optree.tree_map(lambda t: t[a:b], xs)


def _plain(f, carry, xs, n, ys):
    for i in range(n):
        carry, y = f(carry, _index(xs, i))
        ys.append(y)
    return carry


def _revolve_region(f, n, c, opts, carry, xs):
    ys: list = []
    carry = _revolve(f, carry, xs, n, c, opts, ys)
    return carry, ys


def _revolve(f, carry, xs, n, c, opts, ys):
    while n > 1:
        m = _split(n, c)
        region = functools.partial(_revolve_region, f, m, c, opts)
        carry, ys1 = remat(region, **opts)(carry, _slice(xs, 0, m))
        ys.extend(ys1)
        xs = _slice(xs, m, n)
        n, c = n - m, c - 1
    if n == 1:
        carry, y = f(carry, _index(xs, 0))
        ys.append(y)
    return carry


def _segment_region(f, n, carry, xs):
    ys: list = []
    carry = _plain(f, carry, xs, n, ys)
    return carry, ys


def _step_region(f, carry, x):
    return f(carry, x)


def _scan_length(xs, length):
    leaves = optree.tree_leaves(xs) if xs is not None else []
    for t in leaves:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"remat_scan: xs must be a pytree of tensors, got a leaf {type(t).__name__}")
    lengths = {int(t.shape[0]) if t.dim() > 0 else None for t in leaves}
    if None in lengths:
        raise ValueError("remat_scan: every leaf of xs needs a leading (scanned) dimension")
    if length is not None:
        length = int(length)
        if length < 0:
            raise ValueError(f"remat_scan: length must be >= 0, got {length}")
        if lengths and lengths != {length}:
            raise ValueError(
                f"remat_scan: length={length} but xs has leading dimensions {sorted(lengths)}"
            )
        return length
    if not lengths:
        raise ValueError("remat_scan: pass length= when xs is None or has no leaves")
    if len(lengths) > 1:
        raise ValueError(f"remat_scan: the leaves of xs have different leading dimensions {sorted(lengths)}")
    return lengths.pop()


def _stack(ys: list):
    if not ys:
        return None
    leaves0, treedef = optree.tree_flatten(ys[0])
    cols = [leaves0]
    for i, y in enumerate(ys[1:], 1):  # (as lax.scan: every step's y has the first one's structure)
        leaves, td = optree.tree_flatten(y)
        if td != treedef:
            raise RematError(
                f"remat_scan: the step function's per-step output y has the structure {td} at step {i} but "
                f"{treedef} at step 0. Fix: return the same pytree structure (the same keys, no None in place "
                "of a tensor) from every step, as jax.lax.scan requires."
            )
        cols.append(leaves)
    if not leaves0:
        return ys[0] if ys[0] is None else optree.tree_unflatten(treedef, [])  # (every y None: the structure says so)
    stacked = []
    for j, first in enumerate(leaves0):
        col = [c[j] for c in cols]
        if isinstance(first, torch.Tensor):
            stacked.append(torch.stack(col))
        else:
            stacked.append(torch.as_tensor(col))
    return optree.tree_unflatten(treedef, stacked)


def _empty_ys(f, init, xs):
    """The stacked outputs of a zero-length scan: like ``lax.scan``, ``f`` is traced
    once (here on fake tensors: no compute, no RNG draw) for the shape of ``y``."""
    def like(t, lead: int):  # (t's logical shape without its ``lead`` first dims: under vmap not the batched
        # tensor's below the wrappers, whose batch dims ended up in each y: 4x plain's gradient, a hostile pass)
        return torch.empty(t.shape[lead:], dtype=t.dtype, device=t.device) if isinstance(t, torch.Tensor) else t

    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            carry = optree.tree_map(lambda t: like(t, 0), init, none_is_leaf=True)
            x = None if xs is None else optree.tree_map(lambda t: like(t, 1), xs, none_is_leaf=True)
            _, y = f(carry, x)
            # shapes only: fake tensors must not outlive their mode
            meta = optree.tree_map(_EmptyLike, y, none_is_leaf=True)
    except Exception:  # f cannot run on fake tensors (data-dependent shapes, ...)
        return None
    return optree.tree_map(lambda m: m.empty(), meta)


class _EmptyLike:
    """A step output's shape, dtype and device; ``empty()`` stacks zero of them."""

    __slots__ = ("shape", "dtype", "device")

    def __init__(self, y):
        t = y if isinstance(y, torch.Tensor) else torch.as_tensor(y) if y is not None else None
        self.shape = None if t is None else tuple(t.shape)
        self.dtype = None if t is None else t.dtype
        self.device = None if t is None else t.device

    def empty(self):
        if self.shape is None:
            return None
        return torch.empty((0, *self.shape), dtype=self.dtype, device=self.device)


def remat_scan(
    f: Callable[[Any, Any], tuple[Any, Any]],
    init: Any,
    xs: Any,
    *,
    length: int | None = None,
    policy: Any = None,
    checkpoints: str | int = "sqrt",
):
    """``lax.scan`` with rematerialisation across iterations.

    Computes ``carry, y_i = f(carry, x_i)`` for ``i`` in ``range(length)`` and
    returns ``(carry, ys)`` with the ``y_i`` stacked along a new leading
    dimension (pytrees stacked leaf by leaf; ``ys`` is ``None`` if every
    ``y_i`` is ``None``; every ``y_i`` has the first one's structure, as in
    ``jax.lax.scan``, else a ``RematError``).

    **Arguments:**

    - `f`: the step, ``f(carry, x) -> (carry, y)``; the carry keeps its
      structure, shapes and dtypes.
    - `init`: the initial carry (any pytree).
    - `xs`: a pytree of tensors sharing a leading dimension ``length``, or
      ``None`` (then ``length`` is required and ``f`` gets ``x=None``).
    - `length`: number of steps (checked against ``xs``).
    - `policy`: the remat policy of every region (see :func:`remat_fn.remat`).
    - `checkpoints`: ``"all"``, ``"sqrt"`` or an int ``c >= 1`` (binomial
      schedule, see the module docstring for costs: evaluations of ``f`` are
      exactly :func:`revolve_evaluations` ``(length, c)``).

    Gradients (eager, ``torch.func.grad``, ``vmap(grad)``, ...) equal those
    of the plain Python loop.

    >>> import torch, remat_fn
    >>> f = lambda c, x: (torch.tanh(c * x), c.sum())
    >>> c, ys = remat_fn.remat_scan(f, torch.ones(3), torch.rand(10, 3), checkpoints=2)
    >>> ys.shape
    torch.Size([10])
    """
    n = _scan_length(xs, length)
    opts = dict(policy=policy)
    ys: list = []
    if n == 0:
        return init, _empty_ys(f, init, xs)
    if checkpoints == "all":
        step = remat(functools.partial(_step_region, f), **opts)
        carry = init
        for i in range(n):
            carry, y = step(carry, _index(xs, i))
            ys.append(y)
    elif checkpoints == "sqrt":
        k = math.isqrt(n - 1) + 1 if n > 1 else 1  # ceil(sqrt(n))
        carry = init
        starts = list(range(0, n, k))
        for j, a in enumerate(starts):
            b = min(a + k, n)
            if j == len(starts) - 1:
                carry = _plain(f, carry, _slice(xs, a, b), b - a, ys)
            else:
                region = remat(functools.partial(_segment_region, f, b - a), **opts)
                carry, ys_seg = region(carry, _slice(xs, a, b))
                ys.extend(ys_seg)
    elif isinstance(checkpoints, int) and not isinstance(checkpoints, bool):
        if checkpoints < 1:
            raise ValueError(f"remat_scan: checkpoints must be >= 1, got {checkpoints}")
        carry = _revolve(f, init, xs, n, checkpoints, opts, ys)
    else:
        raise ValueError(
            f"remat_scan: checkpoints must be 'all', 'sqrt' or a positive int, got {checkpoints!r}"
        )
    return carry, _stack(ys)
