"""Threading closed-over tensors through the ``torch.func`` path.

Under ``torch.func`` the region runs inside an ``autograd.Function`` whose
inputs are fixed when it is applied.  A tensor the function closes over (see
:mod:`remat_fn._closures`) is not an input, so without care its gradient is
silently dropped.  The path passes the ones that need a gradient as extra
inputs, and :class:`CaptureMode` (a ``TorchFunctionMode`` keyed by object
identity) substitutes them, during forward and recomputation, by the tensors
the ``autograd.Function`` actually received.  As a safety net it stops the
forward as soon as an op touches a gradient-carrying tensor that is neither an
input, a captured tensor nor produced inside the region
(:class:`MissedCapture`), so the caller can thread it and run again.  Nothing
is ever silently dropped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ._debug import CallTrace
from ._describe import describe
from ._errors import mutated_input
from ._functorch import is_wrapped, needs_grad, storage_ptr, unwrap_one
from ._region import region_depth

__all__ = ["CaptureMode", "MissedCapture"]


class MissedCapture(Exception):
    """Internal: the forward touched a gradient-carrying tensor nobody threaded."""

    def __init__(self, tensor: torch.Tensor):
        super().__init__(describe(tensor))
        self.tensor = tensor


class CaptureMode(TorchFunctionMode):
    """Replace captured tensors by identity; optionally police unknown ones.

    Args:
        subst: ``id(original) -> replacement``.
        known: ``id()`` of tensors that may be used freely (the region's
            inputs); tensors produced inside the region are added as they
            appear.  ``None`` disables the safety net (a recomputation).
        trace: the region's :class:`CallTrace`: recorded in the forward,
            checked during a recomputation.
        name: the region's name, for error messages.
    """

    def __init__(self, subst: dict[int, torch.Tensor], known: set[int] | None,
                 trace: CallTrace | None = None, name: str = "fn",
                 produced: set[int] | None = None):
        super().__init__()
        # Storages of the tensors the region's own aten ops made (recorded, on a
        # retry, by a dispatch mode below every functorch level): a tensor whose
        # storage is among them was made inside, not closed over.
        self.produced = produced
        self._recorder = _Produced(produced) if produced is not None else None
        self.subst = subst
        self.known = known
        self.hits: set[int] = set()
        self.trace = trace
        self.name = name
        self.depth = region_depth()
        # the region's inputs (and their replacements), which it must not modify
        self.inputs = frozenset(known) | {id(r) for r in subst.values()} if known is not None else None

    def _fix(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            r = self.subst.get(id(x))
            if r is not None:
                self.hits.add(id(x))
                return r
            known = self.known
            if (known is not None and id(x) not in known and needs_grad(x)
                    and not self._inner(x) and not self._made_inside(x)):
                raise MissedCapture(x)
            return x
        tx = type(x)
        if tx is tuple or tx is list:
            return tx(self._fix(v) for v in x)
        if isinstance(x, tuple) and hasattr(tx, "n_fields"):  # torch.return_types
            return tx(tuple(self._fix(v) for v in x))
        if tx is dict:
            return {k: self._fix(v) for k, v in x.items()}
        return x

    def _inner(self, x: torch.Tensor) -> bool:
        """True for a wrapper made inside the region (by ``torch.func.grad`` or
        ``vmap`` called by the function) around a tensor the region knows."""
        t = x
        while is_wrapped(t):
            t = unwrap_one(t)
            if id(t) in self.known or id(t) in self.subst:
                self.known.add(id(x))
                return True
        return False

    def _made_inside(self, x: torch.Tensor) -> bool:
        if self.produced is None:
            return False
        ptr = storage_ptr(x)
        made = ptr is not None and ptr in self.produced
        if made:
            self.known.add(id(x))
        return made

    def __enter__(self):
        if self._recorder is not None:
            self._recorder.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self._recorder is not None:
                self._recorder.__exit__(*exc)

    def _note(self, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            self.known.add(id(out))
        elif isinstance(out, (tuple, list)):  # also torch.return_types and namedtuples
            for o in out:
                self._note(o)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args = self._fix(args)
        kwargs = self._fix(kwargs) if kwargs else {}
        inputs = self.inputs
        if inputs is not None and args and id(args[0]) in inputs and _in_place(func):
            raise mutated_input(self.name, args[0])
        out = func(*args, **kwargs)
        if self.known is not None:
            self._note(out)
        if self.trace is not None and region_depth() == self.depth:
            self.trace.step(func, out, self.known is None, self.name)
        return out


class _Produced(TorchDispatchMode):
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
_NOT_DATA = frozenset({"requires_grad_", "share_memory_", "retain_grad", "register_hook"})


def _in_place(func) -> bool:
    """True for the torch functions that write into their first argument."""
    name = getattr(func, "__name__", "")
    if name in _IN_PLACE_DUNDERS:
        return True
    return name.endswith("_") and not name.startswith("_") and name not in _NOT_DATA
