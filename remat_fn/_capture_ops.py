"""Helpers of :class:`remat_fn._captures.CaptureMode` for the torch calls it sees: which write into
their first argument (:func:`in_place`), whether an argument carries a gradient
(:func:`carry_grad`), a write done below every functorch wrapper (:func:`write_below`), the
storages a retry's ops produce (:class:`Produced`), and the reference counts of a tensor held
by autograd alone or by a list alone (:data:`ONLY_CPP`, :data:`ONLY_PY`), measured at import."""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

from ._functorch import any_batched, requires_grad_anywhere, storage_ptr, unwrap_all
from ._torch_internals import DisableFuncTorch, TorchDispatchMode

__all__ = ["ONLY_CPP", "ONLY_PY", "carry_grad", "write_below", "Produced", "in_place"]


def refcount_baselines() -> tuple[int, int]:
    """``sys.getrefcount`` of a tensor nothing in Python holds, read through a weak reference
    into a local name, as ``CaptureMode.escaped`` (remat_fn._captures) reads it: one autograd holds (the
    reference its TensorImpl keeps to its Python object, the name, the argument), and one
    held by a list alone, less the list's reference.  Measured once, at import (outside
    any region and transform), not assumed: interpreters count differently."""
    with torch.enable_grad():
        x = torch.zeros(1, requires_grad=True)
        h = x * 1
        ref = weakref.ref(h)
        y = h.sin()  # (saves h)
        del h
        t = ref()
        cpp = sys.getrefcount(t)
        del t, y
        box = [x * 1]
        ref = weakref.ref(box[0])
        t = ref()
        py = sys.getrefcount(t) - 1
        del t, box
    return cpp, py


ONLY_CPP, ONLY_PY = refcount_baselines()


def carry_grad(args, kwargs) -> bool:
    """True if a tensor among the arguments requires grad at some level (or is batched
    by a ``vmap``: its plain tensor holds every batch entry)."""
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (tuple, list)) else (a,)):
            if isinstance(t, torch.Tensor) and (requires_grad_anywhere(t) or any_batched(t)):
                return True
    return False


def write_below(func, a0: torch.Tensor, args, kwargs) -> torch.Tensor:
    """An in-place write that carries no gradient into a tensor wrapped at a level set
    aside (``num_batches_tracked.add_(1)`` of a BatchNorm under ``grad`` of ``grad``),
    done on the plain tensors below every wrapper: plain code writes it at that level,
    where the wrapper and the tensor below share their memory, so the result is the
    same; functorch would refuse the write from the region's own level."""
    def plain(a):
        if isinstance(a, torch.Tensor):
            return unwrap_all(a)
        if isinstance(a, (tuple, list)):
            return type(a)(plain(e) for e in a)
        return a

    with DisableFuncTorch():
        func(*[plain(a) for a in args], **{k: plain(v) for k, v in kwargs.items()})
    return a0


class Produced(TorchDispatchMode):
    """Records the storages that non-view aten ops produce (see CaptureMode)."""

    def __init__(self, produced: set[int]):
        super().__init__()
        self.produced = produced

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and (ptr := storage_ptr(t)) is not None:
                    self.produced.add(ptr)
        return out


_IN_PLACE_DUNDERS = frozenset({
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__setitem__",
})
_NOT_DATA = frozenset({"requires_grad_", "share_memory_", "retain_grad", "register_hook", "detach_"})


_IN_PLACE: dict[int, tuple[Any, bool]] = {}


def in_place(func) -> bool:
    """True for the torch functions that write into their first argument (cached by
    id, the function held with the answer so its id stays its own)."""
    e = _IN_PLACE.get(id(func))
    if e is not None:
        return e[1]
    name = getattr(func, "__name__", "")
    w = name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("_") and name not in _NOT_DATA)
    if len(_IN_PLACE) < 4096:
        _IN_PLACE[id(func)] = (func, w)
    return w
