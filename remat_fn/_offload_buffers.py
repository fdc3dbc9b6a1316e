"""Destination buffers of offloaded values: pooled across steps, or carved out of one
contiguous arena per destination; and the meters that count what is offloaded.

Used by :mod:`remat_fn._offload`.  Buffers are made with every dispatch and
torch-function mode switched off, so memory meters do not count them as op
outputs; :class:`Meter` objects registered with :func:`add_meter` count the
bytes held offloaded by destination instead.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from ._torch_internals import DisableTorchFunction, disable_current_modes

__all__ = ["Block", "Pool", "Arena", "POOL", "Meter", "add_meter", "remove_meter", "meters", "stats", "reset_stats", "quiet",
           "lock"]

_ALIGN = 512  # bytes: buffer sizes are rounded up to this (reuse across small shape changes)
lock = threading.Lock()
_no_torch_function = DisableTorchFunction

#: process-wide counters (tests and benchmarks; not part of the API)
stats = {"to_dst": 0, "to_src": 0, "bytes_to_dst": 0, "prefetched": 0, "allocations": 0, "allocated_bytes": 0,
         "reuses": 0, "arena_allocations": 0}


def reset_stats() -> None:
    for k in stats:
        stats[k] = 0


def _round(n: int) -> int:
    return -(-max(n, 1) // _ALIGN) * _ALIGN


def quiet():
    """No dispatch mode and no torch-function mode sees the bookkeeping copies."""
    stack = contextlib.ExitStack()
    stack.enter_context(_no_torch_function())
    stack.enter_context(disable_current_modes())
    return stack


# ---------------------------------------------------------------------------
# Buffers
# ---------------------------------------------------------------------------


class Block:
    """One destination buffer (bytes) and the event after which it is free to reuse."""

    __slots__ = ("buf", "key", "event", "arena")

    def __init__(self, buf: torch.Tensor, key, arena=None):
        self.buf = buf
        self.key = key
        self.event = None  # CUDA event of the last copy that touched it
        self.arena = arena


def _new_buffer(nbytes: int, device: torch.device, pinned: bool) -> torch.Tensor:
    with quiet():
        return torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pinned)


class Pool:
    """Destination buffers reused across steps, by (device, pinned, rounded size).

    A buffer goes back to the pool when the value stored in it dies (its
    region's graph is freed); the next step takes it again, so after the first
    step offloading allocates nothing.  ``reserved_bytes`` stays allocated
    until :meth:`clear`.
    """

    def __init__(self) -> None:
        self.free: dict[tuple, list[Block]] = {}
        self.reserved_bytes = 0
        self.in_use_bytes = 0

    def acquire(self, nbytes: int, device: torch.device, pinned: bool) -> Block:
        size = _round(nbytes)
        key = (str(device), pinned, size)
        with lock:
            free = self.free.get(key)
            if free:
                block = free.pop()
                stats["reuses"] += 1
                self.in_use_bytes += size
                return block
        buf = _new_buffer(size, device, pinned)
        with lock:
            stats["allocations"] += 1
            stats["allocated_bytes"] += size
            self.reserved_bytes += size
            self.in_use_bytes += size
        return Block(buf, key)

    def release(self, block: Block) -> None:
        with lock:
            self.free.setdefault(block.key, []).append(block)
            self.in_use_bytes -= block.key[2]

    def clear(self) -> None:
        """Free every pooled buffer not in use."""
        with lock:
            for blocks in self.free.values():
                for b in blocks:
                    self.reserved_bytes -= b.key[2]
            self.free.clear()


POOL = Pool()


class Arena:
    """One contiguous buffer per destination for ``contiguous`` offloads.

    Copies are carved out of it in order; when every slice has been released
    (the step's backward is done) the next copy starts at offset 0 again, and
    if the last round asked for more than the arena holds it is reallocated
    once to that size.  The first step (and any overflow) takes pooled buffers.
    """

    _arenas: dict[tuple, Arena] = {}

    def __init__(self, device: torch.device, pinned: bool):
        self.device = device
        self.pinned = pinned
        self.buf: torch.Tensor | None = None
        self.offset = 0
        self.live = 0  # slices in use (arena slices and overflow blocks)
        self.demand = 0  # bytes asked for since the arena was last empty
        self.high = 0  # the most ever asked for between two empty moments
        self.event = None  # last copy event of any slice (reuse waits for it)

    @classmethod
    def get(cls, device: torch.device, pinned: bool) -> Arena:
        key = (str(device), pinned)
        with lock:
            a = cls._arenas.get(key)
            if a is None:
                a = cls._arenas[key] = cls(device, pinned)
            return a

    @classmethod
    def clear_idle(cls) -> None:
        """Forget the arenas no value is stored in (their buffers are freed)."""
        with lock:
            for key in [k for k, a in cls._arenas.items() if a.live == 0]:
                del cls._arenas[key]

    @property
    def capacity(self) -> int:
        return 0 if self.buf is None else self.buf.numel()

    def acquire(self, nbytes: int) -> Block:
        size = _round(nbytes)
        with lock:
            if self.live == 0:
                self.offset = 0
                self.demand = 0
                if self.high > self.capacity:
                    self.buf = None  # the old one is freed before the new one is made
                    self.buf = _new_buffer(self.high, self.device, self.pinned)
                    stats["arena_allocations"] += 1
            self.live += 1
            self.demand += size
            self.high = max(self.high, self.demand)
            if self.buf is not None and self.offset + size <= self.capacity:
                block = Block(self.buf[self.offset:self.offset + size], ("arena", self.pinned, size), self)
                block.event = self.event
                self.offset += size
                return block
        block = POOL.acquire(nbytes, self.device, self.pinned)
        block.arena = self
        return block

    def release(self, block: Block) -> None:
        if block.key[0] != "arena":
            POOL.release(block)
        with lock:
            if block.event is not None:
                self.event = block.event
            self.live -= 1


# ---------------------------------------------------------------------------
# Meters (remat_fn.memory.LiveBytes)
# ---------------------------------------------------------------------------


class Meter:
    """Bytes held offloaded, by destination, for values stored while it was registered."""

    __slots__ = ("live", "peak", "__weakref__")

    def __init__(self) -> None:
        self.live: dict[str, int] = {}
        self.peak: dict[str, int] = {}

    def add(self, dst: str, n: int) -> None:
        v = self.live.get(dst, 0) + n
        self.live[dst] = v
        if v > self.peak.get(dst, 0):
            self.peak[dst] = v

    def sub(self, dst: str, n: int) -> None:
        self.live[dst] = self.live.get(dst, 0) - n


_meters: list[Meter] = []


def add_meter(m: Meter) -> None:
    with lock:
        _meters.append(m)


def remove_meter(m: Meter) -> None:
    with lock:
        if m in _meters:
            _meters.remove(m)


def meters() -> list[Meter]:
    """The meters registered now."""
    with lock:
        return list(_meters)
