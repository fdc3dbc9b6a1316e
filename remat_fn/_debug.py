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

from ._ambient import AMBIENT, SWITCHES
from ._describe import call_meta, describe_meta, user_frame
from ._errors import RecomputeMismatchError
from ._torch_internals import TorchDispatchMode

__all__ = ["OpTrace", "CallTrace", "format_traces", "set_debug_enabled", "early_stop"]


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
    prev = SWITCHES.debug
    SWITCHES.debug = enabled
    try:
        yield
    finally:
        SWITCHES.debug = prev


@contextlib.contextmanager
def early_stop(enabled: bool):
    """Internal (used by :mod:`remat_fn.compat`): regions called in the block stop
    their recomputation early (``True``) or run it whole and check it strictly."""
    prev = AMBIENT.early_stop
    AMBIENT.early_stop = bool(enabled)
    try:
        yield
    finally:
        AMBIENT.early_stop = prev


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


class CallTrace:
    """The check of a recomputation against the tensor-producing torch calls of a region's forward
    (torch-function level: the same calls in both runs, whatever the grad mode, unlike the aten ops
    of :class:`OpTrace`).  The forward records them (``ops``: (func, :func:`call_meta`, user source
    line with ``debug=True``), by ``CaptureMode``); a recomputation makes one of these to check them.

    The ``torch.func`` path cannot see the tensors autograd saves (saved-tensor
    hooks are refused there), so it checks, call by call, that the
    recomputation produces tensors of the same count, shapes, dtypes and
    devices as the forward did: what the eager path checks on saved tensors.
    """

    __slots__ = ("ops", "pos", "where")

    def __init__(self, ops: list, where: bool = False):
        self.ops = ops
        self.pos = 0
        self.where = where  # the forward recorded user source lines (debug=True)

    def step(self, func, out, name: str) -> None:
        meta = call_meta(out)
        if meta is None:
            return
        i = self.pos
        self.pos = i + 1
        if i >= len(self.ops):
            self._mismatch(name, f"the recomputation ran more tensor ops than the {len(self.ops)} "
                           f"of the forward (extra: {_fname(func)} -> {_fmeta(meta)})")
        f0, m0, _ = self.ops[i]
        if m0 != meta or (f0 is not func and _fname(f0) != _fname(func)):
            self._mismatch(name, f"tensor op #{i} was {_fname(f0)} -> {_fmeta(m0)} in the forward "
                           f"but {_fname(func)} -> {_fmeta(meta)} on recompute")

    def finish(self, name: str) -> None:
        """After a complete recomputation: it must have run every op of the forward."""
        if self.pos != len(self.ops):
            self._mismatch(name, f"the recomputation ran {self.pos} tensor ops but the forward "
                           f"ran {len(self.ops)}")

    def _mismatch(self, name: str, what: str):
        msg = (
            f"Recomputing remat({name}) did not reproduce the forward: {what}. The region must "
            "run the same ops on tensors of the same shapes each time: make control flow depend "
            "only on its arguments (pass Python values through static_argnums/static_argnames), "
            "not on global state, and keep preserve_rng_state=True (or use remat_fn.random keys) "
            "for random ops."
        )
        if self.where:
            msg += "\nforward ops:\n" + "\n".join(
                f"  {_fname(f)} -> {_fmeta(m)}  {w}" for f, m, w in self.ops[: self.pos + 1])
        else:
            msg += " Pass debug=True to see the forward's ops with user source lines."
        raise RecomputeMismatchError(msg)


def _fname(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)


def _fmeta(meta) -> str:
    parts = [describe_meta(m[0], m[1]) if m else "-" for m in meta]
    return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"
