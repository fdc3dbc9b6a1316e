"""Recompute checks: the global switches and the op traces of ``debug=True``.

By default a recomputation stops as soon as the last tensor backward needs is
rebuilt (early stop), and checks the count, shapes, dtypes and devices of
the tensors it rebuilt.  *Strict* checks run the whole recomputation and
also require the same number of saved tensors; ``debug`` additionally
records which aten ops ran, from which user line, and requires the same op
sequence.  Both are chosen when a region is called and kept for its
backward.
"""

from __future__ import annotations

import contextlib
import threading

from torch.utils._python_dispatch import TorchDispatchMode

from ._format import user_frame

__all__ = ["OpTrace", "format_traces", "set_debug_enabled", "early_stop", "checks"]

_state = threading.local()
_debug_global: list[bool | None] = [None]


@contextlib.contextmanager
def set_debug_enabled(enabled: bool | None):
    """Turn ``debug`` on (``True``) or off (``False``) for every remat region
    called inside the block, whatever its own ``debug=``; ``None`` restores
    the per-region setting.  The counterpart of torch's
    ``torch.utils.checkpoint.set_checkpoint_debug_enabled``.

    >>> import torch, remat_fn
    >>> with remat_fn.set_debug_enabled(True):
    ...     y = remat_fn.remat(torch.sin)(torch.ones(2, requires_grad=True))
    """
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_debug_enabled expects True, False or None, got {enabled!r}")
    prev = _debug_global[0]
    _debug_global[0] = enabled
    try:
        yield
    finally:
        _debug_global[0] = prev


@contextlib.contextmanager
def early_stop(enabled: bool):
    """Internal (used by :mod:`remat_fn.compat`): regions called in the block stop
    their recomputation early (``True``) or run it whole and check it strictly."""
    prev = getattr(_state, "early_stop", True)
    _state.early_stop = bool(enabled)
    try:
        yield
    finally:
        _state.early_stop = prev


def checks(debug: bool) -> tuple[bool, bool]:
    """``(debug, strict)`` for a region called now with ``debug=debug``."""
    g = _debug_global[0]
    debug = g if g is not None else bool(debug)
    return debug, debug or not getattr(_state, "early_stop", True)


class OpTrace(TorchDispatchMode):
    """Records ``aten.op  file:line (function)`` for every op dispatched."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(f"{func}  {user_frame()}")
        return func(*args, **(kwargs or {}))


def format_traces(forward: list[str], recompute: list[str] | None) -> str:
    lines = ["forward ops:"]
    lines += [f"  {i:4d} {op}" for i, op in enumerate(forward)]
    lines.append("recompute ops:")
    if recompute is None:
        lines.append("  (not recorded)")
    else:
        lines += [f"  {i:4d} {op}" for i, op in enumerate(recompute)]
        for i, (a, b) in enumerate(zip(forward, recompute)):
            if a.split()[0] != b.split()[0]:
                lines.append(f"first difference at op {i}: {a!r} vs {b!r}")
                break
    return "\n".join(lines)
