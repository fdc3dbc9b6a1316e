"""Tensors a function closes over: finding them and threading them through.

Under ``torch.func`` the region runs inside an ``autograd.Function`` whose
inputs are fixed when it is applied.  A tensor the function merely *closes
over* (a free variable, a module parameter, a tensor swapped in by
``torch.func.functional_call``) is not an input, so without care its gradient
is silently dropped.  This module

1. finds such tensors before the call by walking the callable (closure cells,
   ``functools.partial`` arguments, bound ``self``, module parameters and
   buffers, referenced globals, nested user functions), keeping those that
   need a gradient at some level (:func:`find_captured`);
2. substitutes them, during forward and recomputation, by the tensors the
   ``autograd.Function`` actually received (:class:`CaptureMode`, a
   ``TorchFunctionMode`` keyed by object identity);
3. as a safety net, stops the forward as soon as an op touches a
   gradient-carrying tensor that is neither an input, a captured tensor nor
   produced inside the region (:class:`MissedCapture`), so the caller can
   thread it and run again.  Nothing is ever silently dropped.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["needs_grad", "find_captured", "CaptureMode", "MissedCapture", "describe"]

_F = torch._C._functorch
_SKIP_MODULE_PREFIXES = ("torch", "optree", "remat_fn", "numpy", "builtins", "functools")
_MAX_DEPTH = 5


def needs_grad(t: torch.Tensor) -> bool:
    """True if some autograd level (functorch or eager) may want ``t``'s gradient."""
    if not (t.is_floating_point() or t.is_complex()):
        return False
    if t.requires_grad:
        return True
    while _F.is_functorch_wrapped_tensor(t):
        if _F.is_gradtrackingtensor(t):
            return True
        t = _F.get_unwrapped(t)
        if t.requires_grad:
            return True
    return False


def describe(t: torch.Tensor) -> str:
    """Short JAX-style description, e.g. ``f32[8,512]``."""
    from ._format import short_dtype

    return f"{short_dtype(t.dtype)}[{','.join(str(s) for s in t.shape)}]"


def _user_function(fn: Any) -> bool:
    mod = getattr(fn, "__module__", None) or ""
    return not mod.startswith(_SKIP_MODULE_PREFIXES)


def _code_names(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names.extend(_code_names(c))
    return names


def find_captured(fn: Any, exclude: set[int]) -> list[torch.Tensor]:
    """Tensors reachable from ``fn`` that need a gradient and are not in ``exclude``.

    ``exclude`` holds ``id()`` of the tensors already passed as arguments.
    """
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def add(t: torch.Tensor) -> None:
        i = id(t)
        if i not in exclude and i not in found and needs_grad(t):
            found[i] = t

    def visit(obj: Any, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            add(obj)
            return
        if depth > _MAX_DEPTH or obj is None or isinstance(obj, (int, float, str, bool, type)):
            return
        oid = id(obj)
        if oid in seen:
            return
        seen.add(oid)
        if isinstance(obj, torch.nn.Module):
            for t in obj.parameters():
                add(t)
            for t in obj.buffers():
                add(t)
            for sub in obj.modules():
                for v in sub.__dict__.values():  # plain tensor attributes
                    if isinstance(v, torch.Tensor):
                        add(v)
            fwd = getattr(type(obj), "forward", None)
            if isinstance(fwd, types.FunctionType) and _user_function(fwd):
                visit_globals(fwd, depth + 1)
            return
        if isinstance(obj, types.MethodType):
            visit(obj.__self__, depth + 1)
            visit(obj.__func__, depth + 1)
            return
        if isinstance(obj, functools.partial):
            visit(obj.func, depth + 1)
            for a in obj.args:
                visit(a, depth + 1)
            for a in obj.keywords.values():
                visit(a, depth + 1)
            return
        if isinstance(obj, types.FunctionType):
            if not _user_function(obj):
                return
            for cell in obj.__closure__ or ():
                try:
                    visit(cell.cell_contents, depth + 1)
                except ValueError:  # empty cell
                    pass
            for d in obj.__defaults__ or ():
                visit(d, depth + 1)
            for d in (obj.__kwdefaults__ or {}).values():
                visit(d, depth + 1)
            visit_globals(obj, depth + 1)
            return
        if isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v, depth + 1)
            return
        if isinstance(obj, dict):
            for v in obj.values():
                visit(v, depth + 1)
            return
        if isinstance(obj, types.ModuleType) or not _user_function(type(obj)):
            return
        d = getattr(obj, "__dict__", None)  # callable objects, dataclasses, ...
        if d is not None:
            for v in d.values():
                visit(v, depth + 1)
            call = getattr(type(obj), "__call__", None)
            if isinstance(call, types.FunctionType):
                visit(call, depth + 1)

    def visit_globals(fn: types.FunctionType, depth: int) -> None:
        g = fn.__globals__
        for name in _code_names(fn.__code__):
            v = g.get(name)
            if v is not None and not isinstance(v, (types.ModuleType, type)):
                visit(v, depth)

    visit(fn, 0)
    return list(found.values())


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
            appear.  ``None`` disables the safety net.
    """

    def __init__(self, subst: dict[int, torch.Tensor], known: set[int] | None):
        super().__init__()
        self.subst = subst
        self.known = known

    def _fix(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            r = self.subst.get(id(x))
            if r is not None:
                return r
            known = self.known
            if known is not None and id(x) not in known and needs_grad(x):
                raise MissedCapture(x)
            return x
        tx = type(x)
        if tx is tuple or tx is list:
            return tx(self._fix(v) for v in x)
        if tx is dict:
            return {k: self._fix(v) for k, v in x.items()}
        return x

    def _note(self, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            self.known.add(id(out))
        elif type(out) in (tuple, list):
            for o in out:
                self._note(o)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args = self._fix(args)
        kwargs = self._fix(kwargs) if kwargs else {}
        out = func(*args, **kwargs)
        if self.known is not None:
            self._note(out)
        return out
