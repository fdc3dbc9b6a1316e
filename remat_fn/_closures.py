"""The tensors a callable reaches: closed-over tensors, found and put back.

A tensor a region's function merely *closes over* (a free variable, a module
parameter or buffer, a tensor swapped in by ``torch.func.functional_call``, a
referenced global) is not one of its arguments.  :func:`reachable_tensors`
walks the callable (closure cells, ``functools.partial`` arguments, bound
``self``, module parameters and buffers, referenced globals, nested user
functions) and returns a :class:`Reachable`: the tensors and the places they
were found.  Both autograd paths use it: to check that none was modified in
place before a recomputation, and, on the ``torch.func`` path, to thread the
ones that need a gradient through the region's ``autograd.Function`` (see
:mod:`remat_fn._captures`) and to put them back where the forward saw them.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from typing import Any

import torch

from ._describe import describe
from ._errors import MutatedSavedTensorError
from ._functorch import any_batched, needs_grad, storage_ptr, unwrap_all
from ._torch_internals import DisableTorchFunction, version

__all__ = ["Reachable", "reachable_tensors"]

_SKIP_MODULE_PREFIXES = ("torch", "optree", "remat_fn", "numpy", "builtins", "functools")
_MAX_DEPTH = 6


def _code(v: Any) -> bool:
    """A function, or a library's wrapper around one (a remat wrapper): see ``visit``."""
    return isinstance(v, (types.FunctionType, functools.partial)) or (
        not isinstance(v, torch.nn.Module) and "__wrapped__" in (getattr(v, "__dict__", None) or ()))


def _user_function(fn: Any) -> bool:
    mod = getattr(fn, "__module__", None) or ""
    return not mod.startswith(_SKIP_MODULE_PREFIXES)


@functools.lru_cache(maxsize=4096)
def _code_names(code: types.CodeType) -> tuple[str, ...]:
    names = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names.extend(_code_names(c))
    return tuple(dict.fromkeys(names))


class Reachable:
    """What a callable reaches: its tensors and the places they were found.

    ``places`` are ``(container, key, tensor)`` with ``container`` a dict
    (a module's ``_parameters``/``_buffers``/``__dict__``, a function's
    globals) or a closure cell (``key`` is ``None``).  ``relocated()``
    temporarily puts every tensor back where it was found, so a recomputation
    that runs after ``torch.func.functional_call`` has restored the module's
    own parameters still sees the tensors the forward used.
    """

    __slots__ = ("tensors", "places", "versions", "labels")

    def __init__(self) -> None:
        self.labels: dict[int, str] = {}
        self.tensors: dict[int, torch.Tensor] = {}
        self.places: list[tuple[Any, Any, torch.Tensor]] = []
        self.versions: list[tuple[torch.Tensor, int]] = []

    def record_versions(self, extra: list[torch.Tensor] = (), skip=()) -> None:
        """Remember the version counter of every reachable tensor (after the forward),
        but those whose storage is in ``skip``."""
        versions = []
        for t in (*self.tensors.values(), *extra):
            if skip and storage_ptr(t) in skip:
                continue
            v = _version(t)
            if v is not None:
                versions.append((t, v))
        self.versions = versions

    def refs_to(self, t: torch.Tensor, cells: set) -> int:
        """The Python references to ``t`` this walk's tables hold (see
        ``CaptureMode.escaped``); the closure cells holding ``t`` now, which the
        function it walked holds, are added to ``cells`` (ids: a cell two walks found,
        or two functions share, holds one reference).  A dict it found ``t`` in (a
        module's, globals) is the caller's: not counted."""
        n = int(self.tensors.get(id(t)) is t)
        for container, key, u in self.places:
            if u is t:
                n += 1
                if key is None and _contents(container) is t:
                    cells.add(id(container))
        return n + sum(u is t for u, _ in self.versions)

    def check_versions(self, name: str) -> None:
        """Raise if a reachable tensor was modified in place since :meth:`record_versions`."""
        for t, v in self.versions:
            now = _version(t)
            if now is not None and now != v:
                raise MutatedSavedTensorError(
                    f"The tensor {describe(t)} that remat({name}) uses (an argument or a tensor "
                    f"it closes over) was modified in place after the forward (version {v} -> "
                    f"{now}), so recomputing the region would silently give different values. "
                    "Fix: clone it before modifying it (x = x.clone()), or apply the in-place "
                    "update (e.g. optimizer.step()) after the backward pass."
                )

    def captured(self, exclude: set[int], substitute=None) -> list[torch.Tensor]:
        """The reachable tensors that need a gradient, or are batched by an active ``vmap`` (its
        level is set aside inside the region's Function, whose vmap rule handles its inputs),
        and are not in ``exclude``.  ``substitute(tensors)``: the tensors as enclosing regions'
        ops see them, whose replacement may need a gradient where the tensor itself does not
        (a weight wrapped at a vjp level that is gone, replaced by an enclosing region's re-run)."""
        def live(t):
            return needs_grad(t) or any_batched(t)
        # (each tensor's own flags: an enclosing region's CaptureMode answers a metadata read of a
        # tensor it replaces with its replacement's, which a level may not differentiate)
        with DisableTorchFunction():
            return [t for i, t in self.tensors.items()
                    if i not in exclude and (live(t) or (substitute is not None and live(substitute([t])[0])))]

    def relocated(self, replace: dict | None = None):
        """Context manager putting every tensor back where it was found (or, for the
        ids in ``replace``, the tensor given there)."""
        return self._relocated(replace or {}) if self.places else _NULL

    @contextlib.contextmanager
    def _relocated(self, replace: dict):
        undo = []
        try:
            for container, key, t in self.places:
                t = replace.get(id(t), t)
                if key is None:
                    cur = _contents(container)
                    if cur is not t:
                        container.cell_contents = t
                        undo.append((container, key, cur, t))
                elif container.get(key, _EMPTY) is not t:
                    undo.append((container, key, container.get(key, _EMPTY), t))
                    container[key] = t
            yield
        finally:
            # (a place the function assigned meanwhile keeps what it assigned, as in plain code: ``box.h = h``,
            # where ``box.h`` held a tensor the region closed over, was put back and its gradient lost until this)
            for container, key, old, put in reversed(undo):
                if (_contents(container) if key is None else container.get(key, _EMPTY)) is not put:
                    continue
                if key is None:
                    if old is _EMPTY:
                        del container.cell_contents
                    else:
                        container.cell_contents = old
                elif old is _EMPTY:
                    container.pop(key, None)
                else:
                    container[key] = old


_EMPTY = object()


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # (an empty cell)
        return _EMPTY


def _managed(t: torch.Tensor) -> bool:
    """DTensors (FSDP2, tensor parallel) are swapped by their owners around every
    call, recompute included; putting a forward-time one back would be wrong.
    (No DTensor can exist unless its module was imported, so none is imported here.)"""
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    return cls is not None and isinstance(t, cls)


_CONTAINERS = (list, tuple, dict)
_ATOMS = frozenset({int, float, str, bool, bytes, complex, type(None), type(Ellipsis)})


def _version(t: torch.Tensor) -> int | None:
    """The version counter of the storage behind ``t``; ``None`` for a tensor with
    no storage of its own (a transform's wrapper seen while its level is live,
    which is gone once the level exits and so cannot be mutated afterwards)."""
    t = unwrap_all(t)
    with DisableTorchFunction():  # (bookkeeping: no enclosing region's CaptureMode polices it)
        try:
            t.untyped_storage()
            return version(t)
        except (RuntimeError, NotImplementedError):
            return None


_NULL = contextlib.nullcontext()


def _nothing_reachable(fn: Any) -> bool:
    """Fast path: a user function with no closure or defaults whose referenced
    globals are all absent, modules, classes or library functions."""
    if type(fn) is not types.FunctionType or fn.__closure__ or fn.__defaults__ or fn.__kwdefaults__:
        return False
    g = fn.__globals__
    for name in _code_names(fn.__code__):
        v = g.get(name)
        if v is None or isinstance(v, (types.ModuleType, type, types.BuiltinFunctionType)):
            continue
        if isinstance(v, types.FunctionType) and not _user_function(v):
            continue
        return False
    return True


def reachable_tensors(fn: Any) -> Reachable:
    """Find the tensors reachable from ``fn`` and where they live."""
    res = Reachable()
    if _nothing_reachable(fn):
        return res
    tensors = res.tensors
    places = res.places
    seen: set[int] = set()

    labels = res.labels

    def put(container: Any, key: Any, t: torch.Tensor, label: Any = None) -> None:
        if _managed(t):
            return
        tensors.setdefault(id(t), t)
        places.append((container, key, t))
        if label is not None or key is not None:
            labels.setdefault(id(t), str(label if label is not None else key))

    def visit(obj: Any, depth: int, container: Any = None, key: Any = None, label: Any = None) -> None:
        if isinstance(obj, torch.Tensor):
            if container is not None:
                put(container, key, obj, label)
            elif not _managed(obj):
                tensors.setdefault(id(obj), obj)
            return
        if depth > _MAX_DEPTH or type(obj) in _ATOMS or isinstance(obj, type):
            return
        oid = id(obj)
        if oid in seen:
            return
        seen.add(oid)
        if isinstance(obj, torch.nn.Module):
            # labelled with their module path (``block.attn.proj.weight``), rooted at the
            # name the module was found under (a closure variable, a global, an attribute)
            root = label if label is not None else key if isinstance(key, str) else ""
            for path, sub in obj.named_modules(prefix=str(root)):
                pre = f"{path}." if path else ""
                for d in (sub._parameters, sub._buffers):
                    for k, t in d.items():
                        if t is not None:
                            put(d, k, t, pre + k)
                d = sub.__dict__
                for k, v in d.items():  # plain tensor attributes, and tensors in containers
                    if isinstance(v, torch.Tensor):
                        put(d, k, v, pre + k)
                    elif type(v) in _CONTAINERS and not k.startswith("_"):
                        visit(v, depth + 1)
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
            # A decorated function (functools.wraps, another remat) reaches
            # what the function it wraps reaches, whatever module defined it.
            # (the depth bounds a walk through data; a chain of functions and the wrappers around them,
            # nested regions closing over each other, is code, each object visited once: not counted)
            wrapped = getattr(obj, "__wrapped__", None)
            if wrapped is not None:
                visit(wrapped, depth)
            if not _user_function(obj):
                return
            for var, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
                try:
                    v = cell.cell_contents
                except ValueError:  # empty cell
                    continue
                visit(v, depth if _code(v) else depth + 1, cell, None, var)
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
            for k, v in obj.items():
                visit(v, depth + 1, obj if isinstance(v, torch.Tensor) else None, k)
            return
        if isinstance(obj, types.ModuleType):
            return
        d = getattr(obj, "__dict__", None)  # callable objects, dataclasses, ...
        if not _user_function(type(obj)):
            # a library's wrapper object (a remat wrapper) reaches what it wraps
            if isinstance(d, dict) and "__wrapped__" in d:
                visit(d["__wrapped__"], depth)
            return
        if isinstance(d, dict):
            for k, v in d.items():
                visit(v, depth + 1, d if isinstance(v, torch.Tensor) else None, k)
            call = type(obj).__dict__.get("__call__") or getattr(type(obj), "__call__", None)  # noqa: B004
            if isinstance(call, types.FunctionType):
                visit(call, depth + 1)

    def visit_globals(fn: types.FunctionType, depth: int) -> None:
        g = fn.__globals__
        for name in _code_names(fn.__code__):
            v = g.get(name)
            if v is not None and not isinstance(v, (types.ModuleType, type)):
                visit(v, depth, g, name)

    visit(fn, 0)
    return res
