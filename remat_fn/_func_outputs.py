"""Outputs of the ``torch.func`` path's Function that alias an input or each other.

A custom ``autograd.Function``'s outputs are new tensors to autograd, whatever memory
they share.  Plain code's are not: ``x[1]`` is a view of ``x``, and ``h[1:3]`` returned
beside ``h`` is a view of ``h``, so writing into one in place after the region (``a.mul_(2)``)
changes the other *and its gradient*.  :func:`alias_map` finds the outputs that alias an
input or another output, and :func:`rebuild` makes each again, outside the Function, as
the same view (``as_strided``) of the caller's tensor or of the Function's other output,
so that autograd knows what plain autograd knows.

``as_strided`` differentiates through memory: on a base whose elements overlap (an
``expand``ed tensor) its backward spreads a gradient over every element sharing the
memory, which is not what the view op the function ran (``select``) does.  Such bases,
and outputs under ``vmap`` (wrapped tensors), are left as the Function returned them.
"""

from __future__ import annotations

import torch

from ._functorch import is_wrapped, storage_ptr

__all__ = ["alias_map", "rebuild"]


def _plain(t) -> bool:
    return isinstance(t, torch.Tensor) and not is_wrapped(t) and t.layout == torch.strided and t.numel() > 0


def overlaps(t: torch.Tensor) -> bool:
    """True where two elements of ``t`` may share memory (conservative: a layout it cannot
    tell counts as overlapping)."""
    reach = 0
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The storage elements ``t`` spans: ``[first, last]``."""
    lo = hi = t.storage_offset()
    for size, stride in zip(t.shape, t.stride()):
        if stride >= 0:
            hi += (size - 1) * stride
        else:
            lo += (size - 1) * stride
    return lo, hi


def _covers(base: torch.Tensor, t: torch.Tensor) -> bool:
    (a, b), (c, d) = _extent(base), _extent(t)
    return a <= c and d <= b and base.dtype == t.dtype and base.device == t.device


def alias_map(outs, tensors, diff) -> dict[int, tuple]:
    """``{i: (kind, j, size, stride, offset)}``: output ``i`` is a view of input ``j``
    (``kind == "in"``) or of output ``j`` (``"out"``).  ``diff``: which outputs are
    differentiable (a view of another output is rebuilt only where both agree)."""
    found: dict[int, tuple] = {}
    storages: dict[int, int] = {}
    for j, t in enumerate(tensors):
        if _plain(t) and (p := storage_ptr(t)) is not None and not overlaps(t):
            storages.setdefault(p, j)
    ids = {id(t) for t in tensors}
    by_storage: dict[int, list[int]] = {}
    for i, o in enumerate(outs):
        if id(o) in ids or not _plain(o):
            continue  # an input returned as is stays inside (see the Function's forward)
        p = storage_ptr(o)
        if p is None:
            continue
        j = storages.get(p)
        if j is not None and o.dtype == tensors[j].dtype and o.device == tensors[j].device:
            found[i] = ("in", j, tuple(o.shape), o.stride(), o.storage_offset())
        else:
            by_storage.setdefault(p, []).append(i)
    for group in by_storage.values():
        if len(group) < 2:
            continue
        # the base: an output that covers the memory of the others and does not overlap itself
        for j in sorted(group, key=lambda k: -outs[k].numel()):
            if overlaps(outs[j]):
                continue
            for i in group:
                o = outs[i]
                if i != j and diff[i] == diff[j] and _covers(outs[j], o):
                    found[i] = ("out", j, tuple(o.shape), o.stride(), o.storage_offset())
            break
    return found


def rebuild(outs: list, views: dict[int, tuple], inputs, diff, n: int) -> None:
    """Make the outputs ``views`` names (among the first ``n``) again as views of the
    caller's input or of another (final) output, in place in ``outs``."""
    for i, (kind, j, size, stride, offset) in views.items():
        if i >= n or (kind == "out" and (j >= n or j in views)):
            continue
        if kind == "in":
            base = inputs[j] if diff[i] else inputs[j].detach()
        else:
            base = outs[j]
        outs[i] = base.as_strided(size, stride, offset)
