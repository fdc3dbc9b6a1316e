"""A live-tensor-bytes meter that works on CPU and inside ``torch.func``.

CPU tensors have no allocator statistics, so :class:`LiveBytes` counts for
itself: a ``TorchDispatchMode`` sees the output of every op (below autograd
and below the functorch layers, so on the real, unwrapped tensors), adds the
bytes of each new storage once, and subtracts them when the last tensor
object referring to that storage is garbage collected.  ``live`` is the bytes
currently held by tensors created inside the meter; ``peak`` the maximum.
Tensors that existed before the meter was entered are not counted.

Values that remat regions offload (policies such as
``offload_dot_with_no_batch_dims`` or ``offload_inputs``) live in pooled buffers
on their destination; they are not op outputs and are not in ``live``.
``offloaded`` reports the bytes held offloaded, by destination, for values
offloaded while the meter was active (``offloaded_peak``: the maximum), and
:func:`offload_pool_stats` what the pool has allocated.

>>> import torch
>>> from remat_fn.memory import LiveBytes
>>> with LiveBytes() as m:
...     y = torch.ones(1024) * 2      # 4 KiB
...     z = y.view(32, 32)            # a view: no new storage
>>> m.live
4096
>>> del y, z
>>> m.live
0
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import weakref
from typing import Any

import torch

from . import _offload
from ._torch_internals import TorchDispatchMode, tree_leaves

__all__ = ["LiveBytes", "MiB", "return_freed_memory_to_os", "offload_pool_stats", "clear_offload_pool"]

MiB = 1 << 20


COUNTERS: weakref.WeakSet = weakref.WeakSet()  # every meter's counter still referenced (empty: nothing meters)


def storage_released(t: torch.Tensor) -> None:
    """``t`` (a tensor some meter counted) was re-pointed at a storage of its own by
    remat_fn (``set_``, which no dispatch mode sees): it no longer holds the storage it
    was counted with."""
    for c in list(COUNTERS):
        entry = c.fins.pop(id(t), None)
        if entry is not None:
            fin, key = entry
            fin.detach()
            c.drop(key)


class _Counter:
    __slots__ = ("live", "peak", "refs", "sizes", "fins", "__weakref__")

    def __init__(self):
        self.live = 0
        self.peak = 0
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.fins: dict[int, tuple] = {}  # id of a counted live tensor -> (its finalizer, storage)
        COUNTERS.add(self)

    def add(self, t: torch.Tensor, new: bool = True) -> None:
        try:
            st = t.untyped_storage()
            key = st.data_ptr()
            nbytes = st.nbytes()
        except (RuntimeError, NotImplementedError, TypeError):
            return
        if nbytes == 0 or t.device.type == "meta":
            return
        n = self.refs.get(key)
        if n is None:
            if not new:
                return  # a view of a storage made before the meter: not ours to count
            self.refs[key] = 1
            self.sizes[key] = nbytes
            self.live += nbytes
            if self.live > self.peak:
                self.peak = self.live
        else:
            self.refs[key] = n + 1
        self.fins[id(t)] = (weakref.finalize(t, self.gone, id(t), key), key)

    def gone(self, ident: int, key: int) -> None:
        self.fins.pop(ident, None)
        self.drop(key)

    def drop(self, key: int) -> None:
        n = self.refs.get(key)
        if n is None:
            return
        if n == 1:
            del self.refs[key]
            self.live -= self.sizes.pop(key)
        else:
            self.refs[key] = n - 1


class _Mode(TorchDispatchMode):
    def __init__(self, counter: _Counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        new = not func.is_view
        # (an in-place or ``out=`` op returns an argument's storage: new only if the meter counted it already; one it
        # reallocated, ``resize_``, ``out=`` into an empty tensor, is new: the keys are read before the op runs)
        given = {_storage_key(a) for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)} if new else ()
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.counter.add(t, new and _storage_key(t) not in given)
        return out


def _storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class LiveBytes:
    """Context manager measuring live and peak bytes of tensors created inside it.

    The counts stay readable (and keep decreasing as tensors die) after exit.
    """

    def __init__(self) -> None:
        self._c = _Counter()
        self._mode: _Mode | None = None
        self._off = _offload.Meter()

    @property
    def live(self) -> int:
        """Bytes currently held by tensors created while the meter was active."""
        gc.collect()
        return self._c.live

    @property
    def peak(self) -> int:
        """Highest ``live`` value seen so far."""
        return self._c.peak

    @property
    def offloaded(self) -> dict[str, int]:
        """Bytes held offloaded now, by destination device (``{"cpu": 24576}``), of
        values remat regions offloaded while the meter was active."""
        gc.collect()
        return {k: v for k, v in self._off.live.items() if v}

    @property
    def offloaded_peak(self) -> dict[str, int]:
        """Highest :attr:`offloaded` value seen so far, by destination."""
        return dict(self._off.peak)

    def reset_peak(self) -> None:
        gc.collect()
        self._c.peak = self._c.live
        self._off.peak = dict(self._off.live)

    def __enter__(self) -> LiveBytes:
        gc.collect()
        self._mode = _Mode(self._c)
        self._mode.__enter__()
        _offload.add_meter(self._off)
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._mode is not None
        _offload.remove_meter(self._off)
        self._mode.__exit__(*exc)
        self._mode = None


def offload_pool_stats() -> dict[str, int]:
    """What offloading has allocated in this process.

    ``allocations`` / ``allocated_bytes``: buffers made (the pool grows during
    the first step and then stays put: a later step reuses them); ``reuses``:
    buffers taken from the pool; ``reserved_bytes`` / ``in_use_bytes``: held by
    the pool / by live offloaded values; ``arena_allocations``: contiguous
    buffers (``contiguous=True``) made; ``to_dst`` / ``to_src`` /
    ``bytes_to_dst`` / ``prefetched``: copies made, fetched and prefetched.
    """
    pool = _offload.POOL
    return {**_offload.stats, "reserved_bytes": pool.reserved_bytes, "in_use_bytes": pool.in_use_bytes}


def clear_offload_pool() -> None:
    """Free the pooled offload buffers and contiguous arenas not in use (the next
    step allocates again)."""
    gc.collect()
    _offload.POOL.clear()
    _offload.Arena.clear_idle()


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def return_freed_memory_to_os(threshold: int = 128 * 1024) -> bool:
    """Make the C allocator give large freed tensors back to the OS (glibc only).

    CPU tensors come from ``malloc``.  glibc serves large blocks with ``mmap``
    and unmaps them when freed, but after the first such free it raises its
    threshold to that block's size (up to 32 MiB), so later blocks of that size
    come from the heap, whose freed memory stays resident.  A training step that
    recomputes activations during backward (any activation checkpointing)
    interleaves such allocations with gradients, and the process's peak RSS then
    exceeds the live tensor bytes by tens of MiB.  This fixes the threshold at
    ``threshold`` bytes (what ``MALLOC_MMAP_THRESHOLD_=<bytes>`` in the
    environment does at start-up), so the peak RSS follows the live bytes.

    It changes the allocator of the whole process, for every library in it, and
    costs an ``mmap``/``munmap`` per large allocation; call it once, at start-up,
    where peak RSS matters more than allocation speed.  Returns ``False`` (and
    changes nothing) where the C library is not glibc.  See
    ``docs/benchmarks.md`` for measurements.
    """
    if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold <= 0:
        raise ValueError(f"threshold must be a positive number of bytes, got {threshold!r}")
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))
