"""Implementation of :mod:`remat_fn.random` (private; import the public module).

Sections, in the order data flows:

1. Threefry-2x32-20, written once over Python ints *and* int64 tensors.
2. Key words: reading a CPU key tensor into two Python ints, validated.
3. Seeding torch's native generators from a key (the fast path).
4. ``torch.library`` custom ops: one per primitive, each with a fake kernel
   (``torch.compile`` / fake tensors) and a vmap rule that loops over batched
   keys and stacks, so ``vmap`` gives per key exactly the unbatched bits.

Nothing here touches the global RNG: every sample is drawn with an explicit
``generator=``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ._ambient import AMBIENT
from ._functorch import is_wrapped, transforms_active
from ._torch_internals import dispatch_stack_len, function_mode_enabled, tree_leaves

__all__: list[str] = []  # private module: nothing is re-exported from here

# ---------------------------------------------------------------------------
# 1. Threefry-2x32 with 20 rounds (Salmon et al., SC'11; the variant JAX uses)
# ---------------------------------------------------------------------------

MASK32 = 0xFFFFFFFF
_PARITY = 0x1BD11BDA  # Skein key-schedule parity constant
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))

# The counter from which sampler seeds are derived. `fold_in` encrypts counters
# (0, data) and `split` counters (i >> 32, i & MASK32) with i < num, so no
# practical split/fold_in ever produces this counter: the seed of a key and the
# children of that key are separate outputs of the block cipher.
SEED_COUNTER = (MASK32, MASK32)


def threefry2x32(k0: Any, k1: Any, x0: Any, x1: Any) -> tuple[Any, Any]:
    """Encrypt the counter ``(x0, x1)`` under the key ``(k0, k1)``.

    Works unchanged for Python ints and for int64 tensors holding values in
    ``[0, 2**32)`` (shifts by at most 29 keep every intermediate below 2**61, so
    int64 never overflows); the results are bitwise identical either way.
    """
    k2 = k0 ^ k1 ^ _PARITY
    ks = (k0, k1, k2)
    x0 = (x0 + k0) & MASK32
    x1 = (x1 + k1) & MASK32
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = (x0 + x1) & MASK32
            x1 = (((x1 << r) | (x1 >> (32 - r))) & MASK32) ^ x0
        x0 = (x0 + ks[(i + 1) % 3]) & MASK32
        x1 = (x1 + ks[(i + 2) % 3] + (i + 1)) & MASK32
    return x0, x1


def _threefry_int(k0: int, k1: int, x0: int, x1: int) -> tuple[int, int]:
    # Unrolled Python-int version of `threefry2x32` (about 3x faster than the
    # generic loop for a single block; equality is tested).
    m = MASK32
    k2 = k0 ^ k1 ^ _PARITY
    x0 = (x0 + k0) & m
    x1 = (x1 + k1) & m
    for ka, kb, j, (r0, r1, r2, r3) in (
        (k1, k2, 1, (13, 15, 26, 6)),
        (k2, k0, 2, (17, 29, 16, 24)),
        (k0, k1, 3, (13, 15, 26, 6)),
        (k1, k2, 4, (17, 29, 16, 24)),
        (k2, k0, 5, (13, 15, 26, 6)),
    ):
        x0 = (x0 + x1) & m
        x1 = (((x1 << r0) & m) | (x1 >> (32 - r0))) ^ x0
        x0 = (x0 + x1) & m
        x1 = (((x1 << r1) & m) | (x1 >> (32 - r1))) ^ x0
        x0 = (x0 + x1) & m
        x1 = (((x1 << r2) & m) | (x1 >> (32 - r2))) ^ x0
        x0 = (x0 + x1) & m
        x1 = (((x1 << r3) & m) | (x1 >> (32 - r3))) ^ x0
        x0 = (x0 + ka) & m
        x1 = (x1 + kb + j) & m
    return x0, x1


# ---------------------------------------------------------------------------
# 2. Key words
# ---------------------------------------------------------------------------


def key_words(key: Tensor) -> tuple[int, int]:
    """The two uint32 words of an unbatched, already-validated CPU key."""
    k0, k1 = key.tolist()
    if not (0 <= k0 <= MASK32 and 0 <= k1 <= MASK32):
        raise ValueError(
            f"remat_fn.random: key words must lie in [0, 2**32), got [{k0}, {k1}]. "
            "Make keys with remat_fn.random.key(seed), split or fold_in; to import "
            "raw words, reduce them with `words & 0xFFFFFFFF` first."
        )
    return k0, k1


def words_to_key(w0: int, w1: int) -> Tensor:
    return torch.tensor([w0, w1], dtype=torch.int64, device="cpu")


def split_words(k0: int, k1: int, num: int) -> Tensor:
    """Children ``threefry(key, (i >> 32, i & MASK32))`` for ``i < num`` (JAX's
    partitionable split), as an int64 ``(num, 2)`` tensor."""
    if num <= 64:
        rows = [_threefry_int(k0, k1, i >> 32, i & MASK32) for i in range(num)]
        return torch.tensor(rows, dtype=torch.int64).reshape(num, 2)
    i = torch.arange(num, dtype=torch.int64)
    y0, y1 = threefry2x32(k0, k1, i >> 32, i & MASK32)
    return torch.stack([y0, y1], dim=-1)


def split_batched(keys: Tensor, num: int) -> Tensor:
    """Vectorised `split_words` for a ``(B, 2)`` key batch -> ``(B, num, 2)``."""
    _check_batch_range(keys)
    k0 = keys[:, 0:1]
    k1 = keys[:, 1:2]
    i = torch.arange(num, dtype=torch.int64).unsqueeze(0)
    y0, y1 = threefry2x32(k0, k1, i >> 32, i & MASK32)
    y0, y1 = torch.broadcast_tensors(y0, y1)
    return torch.stack([y0, y1], dim=-1)


def fold_in_batched(keys: Tensor, data: int) -> Tensor:
    """Vectorised fold_in for a ``(B, 2)`` key batch -> ``(B, 2)``."""
    _check_batch_range(keys)
    y0, y1 = threefry2x32(keys[:, 0], keys[:, 1], 0, data)
    return torch.stack([y0, y1], dim=-1)


def _check_batch_range(keys: Tensor) -> None:
    if keys.numel() and bool(((keys < 0) | (keys > MASK32)).any()):
        raise ValueError(
            "remat_fn.random: key words must lie in [0, 2**32); a key in this batch "
            "is out of range. Make keys with remat_fn.random.key / split / fold_in."
        )


# ---------------------------------------------------------------------------
# 3. Native generators seeded from a key
# ---------------------------------------------------------------------------

# torch's CPU generator is MT19937 and `manual_seed` keeps only the low 32 bits
# of the seed (`manual_seed(s)` and `manual_seed(s + 2**32)` give the same
# stream), which would leave 2**32 distinct streams: a birthday collision is
# expected after ~2**16 keys. So on CPU the whole 624-word MT state is built from
# the 64-bit seed and installed with `Generator.set_state` (~0.2 us). CUDA (and
# other Philox-based) generators use all 64 bits of `manual_seed`.
_MT_N = 624
_STATE_WORDS = slice(3, 3 + _MT_N)  # int64 view of CPUGeneratorImplState
_SECOND_HALF_TWEAK = 0x9E3779B9




@functools.lru_cache(maxsize=1)
def _cpu_state_template() -> Tensor:
    g = torch.Generator(device="cpu")
    g.manual_seed(0)
    state = g.get_state()
    words = state.view(torch.int64)
    # Layout check (torch's CPUGeneratorImplState): initial seed, then
    # left/seeded packed in one word, then `next`, then the MT words.
    if state.numel() % 8 or words[3].item() != 0 or words[1].item() != (1 << 32) + 1:
        raise RuntimeError(
            "remat_fn.random: unexpected layout of torch's CPU generator state; "
            "please report this with your torch version."
        )
    return state


def seed64(k0: int, k1: int) -> int:
    """The 64-bit sampler seed of a key: Threefry(key, SEED_COUNTER)."""
    s0, s1 = _threefry_int(k0, k1, *SEED_COUNTER)
    return (s0 << 32) | s1


@functools.lru_cache(maxsize=256)
def cpu_state(k0: int, k1: int) -> Tensor:
    """MT19937 state for a key (LRU-cached for 256 keys: under `remat` every key
    is used again in the recompute)."""
    return cpu_state_from_seed(seed64(k0, k1))


def cpu_state_from_seed(s: int) -> Tensor:
    """MT19937 state (a `Generator.set_state` byte tensor) from a 64-bit seed.

    The 624 state words are ``(A[i] + B[i]) mod 2**32`` where ``A`` and ``B`` are
    the first 624 outputs of MT19937 seeded with the two 32-bit halves
    ``s >> 32`` and ``(s & 0xFFFFFFFF) ^ 0x9E3779B9``. Every word depends on all
    64 seed bits, the sum is not GF(2)-linear (unlike MT itself), and seeds
    that share one half still get states that differ in every word.
    """
    tls = AMBIENT  # (this thread's scratch generator and buffer)
    scratch = tls.scratch
    if scratch is None:
        scratch = tls.scratch = torch.Generator(device="cpu")
        tls.rng_buffer = torch.empty(_MT_N, dtype=torch.int64)
    state = _cpu_state_template().clone()
    words = state.view(torch.int64)[_STATE_WORDS]
    scratch.manual_seed(s >> 32)
    words.random_(0, 1 << 32, generator=scratch)
    scratch.manual_seed((s & MASK32) ^ _SECOND_HALF_TWEAK)
    words.add_(tls.rng_buffer.random_(0, 1 << 32, generator=scratch)).bitwise_and_(MASK32)
    return state


def generator_for(key: Tensor, device: torch.device) -> torch.Generator | None:
    """A (thread-local, reused) generator on `device`, seeded from `key`."""
    k0, k1 = key_words(key)
    if device.type == "meta":
        return None  # shapes only: nothing is drawn
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    gens = AMBIENT.generators
    g = gens.get(device)
    if g is None:
        g = gens[device] = torch.Generator(device=device)
    if device.type == "cpu":
        g.set_state(cpu_state(k0, k1))
    else:
        # Philox-based device generators use all 64 bits; manual_seed also
        # resets the Philox offset, so the stream starts at the beginning.
        g.manual_seed(seed64(k0, k1))
    return g


# ---------------------------------------------------------------------------
# 4. Custom ops
# ---------------------------------------------------------------------------


def _loop_over_keys(op: Any, dtype_of_empty: Any) -> Any:
    """A vmap rule for an op whose first argument is the key: run the
    unbatched kernel once per key and stack (exact by construction)."""

    def rule(info: Any, in_dims: tuple[Any, ...], key: Tensor, *args: Any) -> Any:
        if any(d is not None for d in tree_leaves(in_dims[1:])):  # pragma: no cover
            raise ValueError("remat_fn.random: only the key may be batched here")
        kdim = in_dims[0]
        if kdim is None:
            return dispatch(op, key, *args), None
        keys = key.movedim(kdim, 0)
        outs = [dispatch(op, k, *args) for k in keys.unbind(0)]
        if not outs:
            proto = dtype_of_empty(key, *args)
            return proto.new_empty((0, *proto.shape)), 0
        return torch.stack(outs), 0

    return rule


def _empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def _vectorisable(keys: Tensor) -> bool:
    # The vectorised Threefry reads key values (range check), so it needs a
    # plain (B, 2) tensor, not one still wrapped by an outer transform level.
    return keys.dim() == 2 and not is_wrapped(keys)


def _stack_keys(keys: Tensor, rows: list[Tensor], row_shape: tuple[int, ...]) -> Tensor:
    if not rows:
        return keys.new_empty((0, *row_shape))
    return torch.stack(rows)


# -- split / fold_in ----------------------------------------------------------


@torch.library.custom_op("remat_fn::random_split", mutates_args=())
def split_op(key: Tensor, num: int) -> Tensor:
    k0, k1 = key_words(key)
    return split_words(k0, k1, num)


@split_op.register_fake
def _(key: Tensor, num: int) -> Tensor:
    return key.new_empty((num, 2))


@torch.library.register_vmap("remat_fn::random_split")
def _(info: Any, in_dims: tuple[Any, ...], key: Tensor, num: int) -> Any:
    kdim = in_dims[0]
    if kdim is None:
        return dispatch(split_op, key, num), None
    keys = key.movedim(kdim, 0)
    if not _vectorisable(keys):  # let outer levels batch the rest
        return _stack_keys(keys, [dispatch(split_op, k, num) for k in keys.unbind(0)], (num, 2)), 0
    return split_batched(keys, num), 0


@torch.library.custom_op("remat_fn::random_fold_in", mutates_args=())
def fold_in_op(key: Tensor, data: int) -> Tensor:
    k0, k1 = key_words(key)
    return words_to_key(*_threefry_int(k0, k1, 0, data))


@fold_in_op.register_fake
def _(key: Tensor, data: int) -> Tensor:
    return key.new_empty((2,))


@torch.library.register_vmap("remat_fn::random_fold_in")
def _(info: Any, in_dims: tuple[Any, ...], key: Tensor, data: int) -> Any:
    kdim = in_dims[0]
    if kdim is None:
        return dispatch(fold_in_op, key, data), None
    keys = key.movedim(kdim, 0)
    if not _vectorisable(keys):
        return _stack_keys(keys, [dispatch(fold_in_op, k, data) for k in keys.unbind(0)], (2,)), 0
    return fold_in_batched(keys, data), 0


# -- samplers -----------------------------------------------------------------
# Each sampler is a plain kernel (called directly on the eager fast path, see
# `dispatch`) wrapped as a custom op (used whenever a transform, compiler or
# mode is active, so that vmap/fake/compile see one opaque op).


def _uniform(key: Tensor, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
             low: float, high: float) -> Tensor:
    g = generator_for(key, device)
    out = _empty(shape, dtype, device)
    if g is not None and out.numel():
        out.uniform_(low, high, generator=g)
    return out


def _normal(key: Tensor, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
            mean: float, std: float) -> Tensor:
    g = generator_for(key, device)
    out = _empty(shape, dtype, device)
    if g is not None and out.numel():
        out.normal_(mean, std, generator=g)
    return out


def _randint(key: Tensor, shape: Sequence[int], low: int, high: int, dtype: torch.dtype,
             device: torch.device) -> Tensor:
    g = generator_for(key, device)
    out = _empty(shape, dtype, device)
    if g is not None and out.numel():
        out.random_(low, high, generator=g)
    return out


def _permutation(key: Tensor, n: int, device: torch.device) -> Tensor:
    g = generator_for(key, device)
    if g is None:
        return torch.empty(n, dtype=torch.int64, device=device)
    return torch.randperm(n, generator=g, device=device)


def _dropout_mask(key: Tensor, shape: Sequence[int], p: float, device: torch.device) -> Tensor:
    # Keep-mask ``u >= p`` with ``u ~ U[0, 1)`` drawn in float32 (24-bit
    # resolution): P(keep) = 1 - p up to 2**-24, for every input dtype.
    g = generator_for(key, device)
    if g is None:
        return _empty(shape, torch.bool, device)
    u = _empty(shape, torch.float32, device)
    if u.numel():
        u.uniform_(generator=g)
    return torch.ge(u, p)


# Seeding happens on the host at call time, so a CUDA-graph replay would
# repeat the captured draws: tell inductor's cudagraph trees to stay away.
_SAMPLER_TAGS = (torch.Tag.cudagraph_unsafe,)


def _sampler_op(name: str, kernel: Any) -> Any:
    return torch.library.custom_op(
        f"remat_fn::{name}", kernel, mutates_args=(), tags=_SAMPLER_TAGS
    )


uniform_op = _sampler_op("random_uniform", _uniform)
normal_op = _sampler_op("random_normal", _normal)
randint_op = _sampler_op("random_randint", _randint)
permutation_op = _sampler_op("random_permutation", _permutation)
dropout_mask_op = _sampler_op("random_dropout_mask", _dropout_mask)


def _fake_float(key: Tensor, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                a: float, b: float) -> Tensor:
    return _empty(shape, dtype, device)


def _fake_randint(key: Tensor, shape: Sequence[int], low: int, high: int, dtype: torch.dtype,
                  device: torch.device) -> Tensor:
    return _empty(shape, dtype, device)


def _fake_permutation(key: Tensor, n: int, device: torch.device) -> Tensor:
    return torch.empty(n, dtype=torch.int64, device=device)


def _fake_dropout_mask(key: Tensor, shape: Sequence[int], p: float, device: torch.device) -> Tensor:
    return _empty(shape, torch.bool, device)


for _op, _fake in (
    (uniform_op, _fake_float),
    (normal_op, _fake_float),
    (randint_op, _fake_randint),
    (permutation_op, _fake_permutation),
    (dropout_mask_op, _fake_dropout_mask),
):
    _op.register_fake(_fake)
    torch.library.register_vmap(_op, _loop_over_keys(_op, _fake))
del _op, _fake

_KERNELS = {
    uniform_op: _uniform,
    normal_op: _normal,
    randint_op: _randint,
    permutation_op: _permutation,
    dropout_mask_op: _dropout_mask,
    split_op: lambda key, num: split_words(*key_words(key), num),
    fold_in_op: lambda key, data: words_to_key(*_threefry_int(*key_words(key), 0, data)),
}
_OVERLOADS = {
    op: getattr(torch.ops.remat_fn, name).default
    for op, name in (
        (uniform_op, "random_uniform"),
        (normal_op, "random_normal"),
        (randint_op, "random_randint"),
        (permutation_op, "random_permutation"),
        (dropout_mask_op, "random_dropout_mask"),
        (split_op, "random_split"),
        (fold_in_op, "random_fold_in"),
    )
}


def dispatch(op: Any, key: Tensor, *args: Any) -> Tensor:
    """Run `op` on an unbatched key.

    With no torch.func transform, compiler, dispatch mode or function mode in
    play and a plain key tensor, the custom op would only forward to its
    kernel, so the kernel is called directly (saves ~10 us of dispatcher
    overhead per call). Otherwise the registered op runs, so that vmap rules,
    fake kernels and modes see one opaque op (inside transforms the kernel's
    seeded draws must not be mistaken for global randomness by vmap).
    """
    if (
        not torch.compiler.is_compiling()  # first: the checks below are not traceable
        and type(key) is torch.Tensor
        and not transforms_active()
        and dispatch_stack_len() == 0
        and not function_mode_enabled()
    ):
        return _KERNELS[op](key, *args)
    return _OVERLOADS[op](key, *args)
