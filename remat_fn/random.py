"""Explicit, splittable random keys for PyTorch (``remat_fn.random``).

Randomness is a pure function of a *key*: the same key, shape, dtype and device
give the same bits every time, in any process, inside or outside ``remat``,
``torch.func`` transforms and ``torch.compile``. Nothing reads or advances the
global RNG, so recomputation under ``remat`` is exact without saving or
restoring any device RNG state.

Keys follow JAX's ``threefry2x32`` design:

* A key is an int64 CPU tensor of shape ``(2,)`` holding two uint32 words;
  ``key(seed)`` is ``[seed >> 32, seed & 0xFFFFFFFF]``. Keys are ordinary tensors:
  pytree leaves, stackable into batches, savable with ``torch.save``.
* ``split(key, num)[i]`` is ``Threefry-2x32-20(key, counter=(i >> 32, i & 0xFFFFFFFF))``
  and ``fold_in(key, d)`` is ``Threefry(key, (0, d))``, exactly as JAX with
  ``jax_threefry_partitionable`` (its default): so ``fold_in(key, i) ==
  split(key, n)[i]``. Use each key for one purpose only: either sample with it
  or derive children from it.
* A sampler derives a 64-bit seed ``Threefry(key, (2**32-1, 2**32-1))`` (a counter
  that ``split``/``fold_in`` never use), seeds a reusable, thread-local
  ``torch.Generator`` on the target device with it and calls torch's native
  kernel (``uniform_``, ``normal_``, ``random_``, ``randperm``) with
  ``generator=``: native speed. On CPU, where MT19937's ``manual_seed`` keeps only
  32 bits, the full 624-word state is built from all 64 seed bits.
* Keys live on the CPU and the seed is computed from CPU data, so sampling on
  CUDA never synchronises with the device; ``device=`` only chooses where the
  samples are produced.
* Under ``torch.func.vmap`` over a batch of keys, each sampler gives per key
  exactly the bits of the unbatched call (its vmap rule loops over keys).

Example:
    >>> import torch
    >>> from remat_fn import random as rnd
    >>> k = rnd.key(0)
    >>> k_init, k_drop = rnd.split(k)
    >>> w = rnd.normal(k_init, (4, 3))
    >>> torch.equal(w, rnd.normal(k_init, (4, 3)))
    True
    >>> x = torch.ones(2, 4)
    >>> y = rnd.dropout(k_drop, x @ w, p=0.1)
    >>> y.shape
    torch.Size([2, 3])

See ``docs/random.md`` for the algorithm, ``vmap`` usage and model-parallel
streams (``fold_in(key, rank)``).
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Sequence
from typing import Any, Union

import torch
from torch import Tensor

from remat_fn import _random_impl as _impl
from remat_fn._errors import explain_misuse

__all__ = [
    "key",
    "split",
    "fold_in",
    "uniform",
    "normal",
    "bernoulli",
    "randint",
    "permutation",
    "dropout",
    "Dropout",
]

Shape = Union[int, Sequence[int], torch.Size]  # noqa: UP007 (a runtime alias on Python 3.10)
DeviceLike = Union[torch.device, str, int, None]  # noqa: UP007

_MASK32 = _impl.MASK32
_CPU = torch.device("cpu")

# ---------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------


def key(seed: int) -> Tensor:
    """Make a key from an integer seed.

    Args:
        seed: Any integer in ``[-2**63, 2**64)``; it is taken modulo ``2**64`` and
            split into two 32-bit words ``[seed >> 32, seed & 0xFFFFFFFF]`` (the
            layout of ``jax.random.PRNGKey``).

    Returns:
        An int64 CPU tensor of shape ``(2,)``.

    Raises:
        TypeError: if ``seed`` is not an integer.
        ValueError: if ``seed`` is out of range.

    Example:
        >>> key(0)
        tensor([0, 0])
        >>> key(2**32 + 5)
        tensor([1, 5])
    """
    if isinstance(seed, bool) or isinstance(seed, float):
        raise TypeError(
            f"remat_fn.random.key: seed must be an int, got {type(seed).__name__} "
            f"{seed!r}; pass int(seed)."
        )
    try:
        s = operator.index(seed)
    except TypeError:
        raise TypeError(
            f"remat_fn.random.key: seed must be an int, got {type(seed).__name__}. "
            "To reuse an existing key, pass the key itself to split/fold_in/the samplers."
        ) from None
    if not -(1 << 63) <= s < (1 << 64):
        raise ValueError(
            f"remat_fn.random.key: seed {s} does not fit in 64 bits; use a seed in "
            "[-2**63, 2**64) or fold the extra bits in with fold_in."
        )
    s &= (1 << 64) - 1
    return _impl.words_to_key(s >> 32, s & _MASK32)


def split(key: Tensor, num: int = 2) -> Tensor:
    """Derive ``num`` new, independent keys from ``key``.

    Child ``i`` is ``Threefry-2x32(key, (i >> 32, i & 0xFFFFFFFF))``, bit-identical
    to ``jax.random.split`` with partitionable Threefry. The parent should not be
    used again for sampling.

    Args:
        key: A key of shape ``(2,)`` (under ``vmap``: a batch of keys).
        num: Number of children, ``>= 0``.

    Returns:
        An int64 tensor of shape ``(num, 2)``; unpack it (``k1, k2 = split(k)``) or
        index it.

    Example:
        >>> k1, k2 = split(key(0))
        >>> split(key(0), 3).shape
        torch.Size([3, 2])
        >>> torch.equal(split(key(0), 3)[1], k2)
        True
    """
    key = _check_key(key, "split")
    num = _check_int(num, "split", "num", low=0)
    return _impl.dispatch(_impl.split_op, key, num)


def fold_in(key: Tensor, data: int) -> Tensor:
    """Derive a new key from ``key`` and an integer, e.g. a step, layer or rank.

    ``fold_in(key, d)`` is ``Threefry-2x32(key, (0, d))`` (as in JAX). Distinct
    ``data`` give independent keys; model-parallel streams are
    ``fold_in(key, rank)``.

    Args:
        key: A key of shape ``(2,)``.
        data: An integer in ``[0, 2**32)``.

    Returns:
        A new key of shape ``(2,)``.

    Example:
        >>> k = key(0)
        >>> torch.equal(fold_in(k, 3), fold_in(k, 3))
        True
        >>> torch.equal(fold_in(k, 3), fold_in(k, 4))
        False
    """
    key = _check_key(key, "fold_in")
    data = _check_int(data, "fold_in", "data", low=0)
    if data > _MASK32:
        raise ValueError(
            f"remat_fn.random.fold_in: data must be in [0, 2**32), got {data}; fold a "
            "wider value in twice: fold_in(fold_in(key, data >> 32), data & 0xFFFFFFFF)."
        )
    return _impl.dispatch(_impl.fold_in_op, key, data)


# ---------------------------------------------------------------------------
# Samplers
# ---------------------------------------------------------------------------


def uniform(
    key: Tensor,
    shape: Shape = (),
    *,
    dtype: torch.dtype | None = None,
    device: DeviceLike = None,
    low: float = 0.0,
    high: float = 1.0,
) -> Tensor:
    """Uniform samples in ``[low, high)``.

    Args:
        key: A key of shape ``(2,)``.
        shape: Output shape (an int or a sequence of ints).
        dtype: A floating dtype; default ``torch.get_default_dtype()``.
        device: Where the samples are produced; default ``torch.get_default_device()``.
        low: Lower bound (inclusive).
        high: Upper bound (exclusive), ``high >= low``.

    Returns:
        A tensor of ``shape``.

    Example:
        >>> u = uniform(key(0), (2, 3), low=-1.0, high=1.0)
        >>> u.shape, bool(((u >= -1) & (u < 1)).all())
        (torch.Size([2, 3]), True)
    """
    key = _check_key(key, "uniform")
    shape = _check_shape(shape, "uniform")
    dtype = _float_dtype(dtype, "uniform")
    device = _device(device)
    low, high = _check_float(low, "uniform", "low"), _check_float(high, "uniform", "high")
    if not low <= high:
        raise ValueError(f"remat_fn.random.uniform: need low <= high, got low={low}, high={high}.")
    return _impl.dispatch(_impl.uniform_op, key, shape, dtype, device, low, high)


def normal(
    key: Tensor,
    shape: Shape = (),
    *,
    dtype: torch.dtype | None = None,
    device: DeviceLike = None,
    mean: float = 0.0,
    std: float = 1.0,
) -> Tensor:
    """Normal (Gaussian) samples with the given ``mean`` and ``std``.

    Args:
        key: A key of shape ``(2,)``.
        shape: Output shape.
        dtype: A floating dtype; default ``torch.get_default_dtype()``.
        device: Where the samples are produced; default ``torch.get_default_device()``.
        mean: Mean of the distribution.
        std: Standard deviation, ``>= 0``.

    Returns:
        A tensor of ``shape``.

    Example:
        >>> normal(key(1), (1000,), dtype=torch.float64).std().item() > 0.9
        True
    """
    key = _check_key(key, "normal")
    shape = _check_shape(shape, "normal")
    dtype = _float_dtype(dtype, "normal")
    device = _device(device)
    mean, std = _check_float(mean, "normal", "mean"), _check_float(std, "normal", "std")
    if std < 0:
        raise ValueError(f"remat_fn.random.normal: std must be >= 0, got {std}.")
    return _impl.dispatch(_impl.normal_op, key, shape, dtype, device, mean, std)


def bernoulli(
    key: Tensor,
    p: float | Tensor = 0.5,
    shape: Shape | None = None,
    *,
    device: DeviceLike = None,
) -> Tensor:
    """Boolean samples that are ``True`` with probability ``p``.

    Computed as ``uniform(key, shape, dtype=torch.float64) < p``, so ``p`` is
    honoured to 53 bits and ``p`` may be a tensor (broadcast against ``shape``,
    batched under ``vmap`` like any tensor). Tensor values outside ``[0, 1]`` act
    as clamped; they are not checked, which would need a device synchronisation.

    Args:
        key: A key of shape ``(2,)``.
        p: Probability of ``True``: a float in ``[0, 1]`` or a floating tensor.
        shape: Output shape; default ``p.shape`` (``()`` for a float ``p``). A tensor
            ``p`` must broadcast to it.
        device: Where the samples are produced; default ``p.device`` for a tensor
            ``p``, else ``torch.get_default_device()``.

    Returns:
        A bool tensor of ``shape``.

    Example:
        >>> b = bernoulli(key(0), 0.25, (10000,))
        >>> b.dtype, 0.2 < b.float().mean().item() < 0.3
        (torch.bool, True)
    """
    key = _check_key(key, "bernoulli")
    if isinstance(p, Tensor):
        if not (p.dtype.is_floating_point or p.dtype == torch.bool):
            raise TypeError(
                f"remat_fn.random.bernoulli: tensor p must be floating, got {p.dtype}; "
                "use p.float()."
            )
        if shape is None:
            shape = tuple(p.shape)
        shape = _check_shape(shape, "bernoulli")
        try:
            fits = torch.broadcast_shapes(tuple(p.shape), shape) == torch.Size(shape)
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(
                f"remat_fn.random.bernoulli: p of shape {tuple(p.shape)} does not "
                f"broadcast to shape {tuple(shape)}; pass a shape p broadcasts to."
            )
        device = p.device if device is None else _device(device)
    else:
        p = _check_float(p, "bernoulli", "p")
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"remat_fn.random.bernoulli: p must be in [0, 1], got {p}.")
        shape = _check_shape(() if shape is None else shape, "bernoulli")
        device = _device(device)
    u = _impl.dispatch(_impl.uniform_op, key, shape, torch.float64, device, 0.0, 1.0)
    return u < p


def randint(
    key: Tensor,
    shape: Shape,
    low: int,
    high: int,
    *,
    dtype: torch.dtype = torch.int64,
    device: DeviceLike = None,
) -> Tensor:
    """Integers drawn uniformly from ``[low, high)``.

    Args:
        key: A key of shape ``(2,)``.
        shape: Output shape.
        low: Lowest value (inclusive).
        high: One above the highest value; ``high > low``.
        dtype: An integer dtype (default ``torch.int64``) that can hold both bounds.
        device: Where the samples are produced; default ``torch.get_default_device()``.

    Returns:
        A tensor of ``shape`` and ``dtype``.

    Example:
        >>> r = randint(key(0), (100,), 3, 7)
        >>> sorted(set(r.tolist())) == [3, 4, 5, 6]
        True
    """
    key = _check_key(key, "randint")
    shape = _check_shape(shape, "randint")
    low = _check_int(low, "randint", "low")
    high = _check_int(high, "randint", "high")
    if not low < high:
        raise ValueError(f"remat_fn.random.randint: need low < high, got low={low}, high={high}.")
    if not isinstance(dtype, torch.dtype) or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(
            f"remat_fn.random.randint: dtype must be an integer dtype, got {dtype}; "
            "for floats use uniform, for booleans bernoulli."
        )
    info = torch.iinfo(dtype)
    if low < info.min or high - 1 > info.max:
        raise ValueError(
            f"remat_fn.random.randint: [{low}, {high}) does not fit in {dtype}; "
            "choose a wider dtype."
        )
    return _impl.dispatch(_impl.randint_op, key, shape, low, high, dtype, _device(device))


def permutation(key: Tensor, n: int | Tensor, *, device: DeviceLike = None) -> Tensor:
    """A random permutation of ``range(n)``, or of a tensor's first dimension.

    Args:
        key: A key of shape ``(2,)``.
        n: An int ``>= 0``, or a tensor whose rows (dim 0) are shuffled (as
            ``jax.random.permutation``; differentiable with respect to the tensor).
        device: Where the permutation is produced (int ``n`` only); default
            ``torch.get_default_device()``.

    Returns:
        An int64 tensor holding a permutation of ``0 .. n-1``, or the shuffled tensor.

    Example:
        >>> sorted(permutation(key(0), 5).tolist())
        [0, 1, 2, 3, 4]
    """
    key = _check_key(key, "permutation")
    if isinstance(n, Tensor):
        if n.dim() == 0:
            raise ValueError(
                "remat_fn.random.permutation: a tensor argument must have at least one "
                "dimension (its rows are shuffled); for range(n) pass an int."
            )
        if device is not None:
            raise ValueError(
                "remat_fn.random.permutation: device= applies to an int n only; a "
                "tensor is shuffled where it lives."
            )
        perm = _impl.dispatch(_impl.permutation_op, key, n.shape[0], n.device)
        return n[perm]
    n = _check_int(n, "permutation", "n", low=0)
    return _impl.dispatch(_impl.permutation_op, key, n, _device(device))


# ---------------------------------------------------------------------------
# Dropout
# ---------------------------------------------------------------------------


def _keyless_dropout(args: tuple, kwargs: dict) -> str:
    """The fix for calling ``dropout`` as torch's ``dropout(x, p)``, without a key."""
    return ("remat_fn.random.dropout takes an explicit key first: dropout(key, x, p), e.g. "
            "dropout(remat_fn.random.key(0), x, 0.1), with a new key for each call "
            "(k1, k2 = remat_fn.random.split(key)); for dropout from the global RNG, as torch's "
            "dropout(x, p), use torch.nn.functional.dropout.")


@explain_misuse(_keyless_dropout)
def dropout(key: Tensor, x: Tensor, p: float, *, training: bool = True) -> Tensor:
    """Zero each element of ``x`` with probability ``p``; scale the rest by ``1/(1-p)``.

    The keep-mask is ``u >= p`` for ``u ~ U[0, 1)`` drawn (in float32) from
    ``key`` on ``x.device``; the output is ``x * mask * (1/(1-p))`` built from
    ordinary differentiable ops, so gradients (``.backward()``, ``torch.func``)
    are ``mask / (1-p)``. Under ``vmap`` with a batch of keys each example gets
    the mask its key gives unbatched.

    Args:
        key: A key of shape ``(2,)``.
        x: A floating tensor.
        p: Drop probability in ``[0, 1]``.
        training: If False, return ``x`` unchanged.

    Returns:
        A tensor like ``x``. ``p == 0`` or ``training=False`` return ``x`` itself;
        ``p == 1`` returns ``x * 0`` (zeros, still connected to ``x``).

    Example:
        >>> x = torch.ones(8)
        >>> y = dropout(key(0), x, 0.5)
        >>> sorted(set(y.tolist())) <= [0.0, 2.0]
        True
        >>> dropout(key(0), x, 0.5, training=False) is x
        True
    """
    key = _check_key(key, "dropout")
    if not isinstance(x, Tensor):
        raise TypeError(
            f"remat_fn.random.dropout: x must be a tensor, got {type(x).__name__}; "
            "the signature is dropout(key, x, p)."
        )
    if not x.dtype.is_floating_point:
        raise TypeError(f"remat_fn.random.dropout: x must be floating, got {x.dtype}.")
    p = _check_float(p, "dropout", "p")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"remat_fn.random.dropout: p must be in [0, 1], got {p}.")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    mask = _impl.dispatch(_impl.dropout_mask_op, key, tuple(x.shape), p, x.device)
    return (x * mask).mul_(1.0 / (1.0 - p))


class Dropout(torch.nn.Module):
    """Module form of :func:`dropout`: ``Dropout(p)(x, key)``.

    Active in ``train()`` mode, the identity in ``eval()`` mode. The key is an
    argument of ``forward`` so that the module holds no RNG state.

    Args:
        p: Drop probability in ``[0, 1]``.

    Example:
        >>> drop = Dropout(0.5)
        >>> x = torch.ones(4)
        >>> drop(x, key(0)).shape
        torch.Size([4])
        >>> drop.eval()(x, key(0)) is x
        True
    """

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        p = _check_float(p, "Dropout", "p")
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"remat_fn.random.Dropout: p must be in [0, 1], got {p}.")
        self.p = p

    def forward(self, x: Tensor, key: Tensor) -> Tensor:
        return dropout(key, x, self.p, training=self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


# ---------------------------------------------------------------------------
# Argument checks (shared; each error names the fix)
# ---------------------------------------------------------------------------


def _check_key(key: object, fn: str) -> Tensor:
    if not isinstance(key, Tensor):
        hint = f" Make one with remat_fn.random.key({key!r})." if isinstance(key, int) else ""
        raise TypeError(
            f"remat_fn.random.{fn}: key must be a key tensor from remat_fn.random.key(seed), "
            f"got {type(key).__name__}.{hint}"
        )
    dtype = key.dtype
    if dtype in (torch.int32, torch.uint32):  # raw uint32 words, e.g. from JAX
        key = key.to(torch.int64) & _MASK32
    elif dtype != torch.int64:
        raise TypeError(
            f"remat_fn.random.{fn}: key must be an int64 tensor of two uint32 words (from "
            f"remat_fn.random.key/split/fold_in), got dtype {dtype}. The key is the first "
            f"argument, remat_fn.random.{fn}(key, ...): did you pass a data tensor in its place?"
        )
    if tuple(key.shape) != (2,):
        if key.dim() >= 2 and key.shape[-1] == 2:
            raise ValueError(
                f"remat_fn.random.{fn}: got a batch of keys of shape {tuple(key.shape)}; "
                "functions take one key of shape (2,). Map over the batch with "
                f"torch.func.vmap(lambda k: remat_fn.random.{fn}(k, ...))(keys), or pick "
                "one key with keys[i]."
            )
        raise ValueError(
            f"remat_fn.random.{fn}: a key has shape (2,), got {tuple(key.shape)}. Make "
            "keys with remat_fn.random.key(seed)."
        )
    if key.device.type != "cpu":
        raise ValueError(
            f"remat_fn.random.{fn}: keys must live on the CPU (got {key.device}) so that "
            "deriving seeds never waits for the device; keep keys from key()/split() "
            "where they are made and choose where samples go with device= (move this "
            "one once with key.cpu())."
        )
    return key


def _check_int(value: object, fn: str, name: str, *, low: int | None = None) -> int:
    if isinstance(value, bool) or not _is_int(value):
        raise TypeError(
            f"remat_fn.random.{fn}: {name} must be an int, got {type(value).__name__}."
        )
    if isinstance(value, torch.SymInt):
        return value  # type: ignore[return-value]
    v = operator.index(value)  # type: ignore[arg-type]
    if low is not None and v < low:
        raise ValueError(f"remat_fn.random.{fn}: {name} must be >= {low}, got {v}.")
    return v


def _is_int(value: object) -> bool:
    if isinstance(value, torch.SymInt):
        return True
    if isinstance(value, Tensor):
        return value.dim() == 0 and not value.dtype.is_floating_point and value.dtype != torch.bool
    if isinstance(value, (tuple, list)):  # torch.Size too; dynamo refuses operator.index on it
        return False
    try:
        operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def _check_float(value: object, fn: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"remat_fn.random.{fn}: {name} must be a Python float, got {type(value).__name__}"
            + (" (use .item() outside transforms)." if isinstance(value, Tensor) else ".")
        )
    v = float(value)
    if v != v:  # NaN (math.isnan is opaque to torch.compile)
        raise ValueError(f"remat_fn.random.{fn}: {name} is NaN.")
    return v


def _check_shape(shape: object, fn: str) -> tuple[int, ...]:
    dims: Any = (shape,) if _is_int(shape) and not isinstance(shape, Tensor) else shape
    try:
        dims = tuple(dims)
    except TypeError:
        raise TypeError(
            f"remat_fn.random.{fn}: shape must be an int or a sequence of ints, got "
            f"{type(shape).__name__}."
        ) from None
    out: list[Any] = []
    for d in dims:
        if isinstance(d, bool) or not _is_int(d) or isinstance(d, Tensor):
            raise TypeError(
                f"remat_fn.random.{fn}: shape must contain ints, got {shape!r}."
            )
        if isinstance(d, torch.SymInt):
            out.append(d)
            continue
        d = operator.index(d)
        if d < 0:
            raise ValueError(f"remat_fn.random.{fn}: negative dimension in shape {shape!r}.")
        out.append(d)
    return tuple(out)


def _float_dtype(dtype: torch.dtype | None, fn: str) -> torch.dtype:
    if dtype is None:
        return torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            f"remat_fn.random.{fn}: dtype must be a floating dtype, got {dtype}; for "
            "integers use randint."
        )
    return dtype


def _device(device: DeviceLike) -> torch.device:
    if device is None:
        if torch.compiler.is_compiling():  # get_default_device is not traceable
            return torch.empty(0).device
        if not _impl.function_mode_enabled():
            return _CPU  # no torch.set_default_device / device context in force
        return torch.get_default_device()
    return torch.device(device)
