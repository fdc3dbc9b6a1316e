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

import contextlib
import functools
import threading
import types
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ._debug import CallTrace
from ._errors import RematError

__all__ = ["needs_grad", "scan", "Scan", "CaptureMode", "MissedCapture", "describe",
           "mutated_input", "entered", "region_depth", "unwrap_all", "storage_ptr"]

_F = torch._C._functorch
_SKIP_MODULE_PREFIXES = ("torch", "optree", "remat_fn", "numpy", "builtins", "functools")
_MAX_DEPTH = 6


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


@functools.lru_cache(maxsize=4096)
def _code_names(code: types.CodeType) -> tuple[str, ...]:
    names = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names.extend(_code_names(c))
    return tuple(dict.fromkeys(names))


class Scan:
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

    def record_versions(self, extra: list[torch.Tensor] = ()) -> None:
        """Remember the version counter of every reachable tensor (after the forward)."""
        versions = []
        for t in (*self.tensors.values(), *extra):
            v = _version(t)
            if v is not None:
                versions.append((t, v))
        self.versions = versions

    def check_versions(self, name: str) -> None:
        """Raise if a reachable tensor was modified in place since :meth:`record_versions`."""
        for t, v in self.versions:
            now = _version(t)
            if now is not None and now != v:
                from ._errors import MutatedSavedTensorError

                raise MutatedSavedTensorError(
                    f"The tensor {describe(t)} that remat({name}) uses (an argument or a tensor "
                    f"it closes over) was modified in place after the forward (version {v} -> "
                    f"{now}), so recomputing the region would silently give different values. "
                    "Fix: clone it before modifying it (x = x.clone()), or apply the in-place "
                    "update (e.g. optimizer.step()) after the backward pass."
                )

    def captured(self, exclude: set[int]) -> list[torch.Tensor]:
        """The reachable tensors that need a gradient and are not in ``exclude``."""
        return [t for i, t in self.tensors.items() if i not in exclude and needs_grad(t)]

    def relocated(self):
        """Context manager putting every tensor back where it was found."""
        return self._relocated() if self.places else _NULL

    @contextlib.contextmanager
    def _relocated(self):
        undo = []
        try:
            for container, key, t in self.places:
                if key is None:
                    try:
                        cur = container.cell_contents
                    except ValueError:
                        cur = _EMPTY
                    if cur is not t:
                        container.cell_contents = t
                        undo.append((container, key, cur))
                elif container.get(key, _EMPTY) is not t:
                    undo.append((container, key, container.get(key, _EMPTY)))
                    container[key] = t
            yield
        finally:
            for container, key, old in reversed(undo):
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


_DTENSOR: list = []


def _managed(t: torch.Tensor) -> bool:
    """DTensors (FSDP2, tensor parallel) are swapped by their owners around every
    call, recompute included; putting a forward-time one back would be wrong."""
    if not _DTENSOR:
        try:
            from torch.distributed.tensor import DTensor

            _DTENSOR.append(DTensor)
        except Exception:  # pragma: no cover - builds without torch.distributed
            _DTENSOR.append(())
    cls = _DTENSOR[0]
    return bool(cls) and isinstance(t, cls)
_CONTAINERS = (list, tuple, dict)
_ATOMS = frozenset({int, float, str, bool, bytes, complex, type(None), type(Ellipsis)})


def unwrap_all(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor below every functorch wrapper around ``t``."""
    while _F.is_functorch_wrapped_tensor(t):
        t = _F.get_unwrapped(t)
    return t


def storage_ptr(t: torch.Tensor) -> int | None:
    """The address of the storage behind ``t`` (below functorch wrappers); ``None``
    for a tensor without one (sparse, a wrapper whose level is live)."""
    try:
        return unwrap_all(t).untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _version(t: torch.Tensor) -> int | None:
    """The version counter of the storage behind ``t``; ``None`` for a tensor with
    no storage of its own (a transform's wrapper seen while its level is live,
    which is gone once the level exits and so cannot be mutated afterwards)."""
    t = unwrap_all(t)
    try:
        t.untyped_storage()
        return t._version
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


def scan(fn: Any) -> Scan:
    """Find the tensors reachable from ``fn`` and where they live."""
    res = Scan()
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
            for sub in obj.modules():
                for d in (sub._parameters, sub._buffers):
                    for k, t in d.items():
                        if t is not None:
                            put(d, k, t)
                d = sub.__dict__
                for k, v in d.items():  # plain tensor attributes, and tensors in containers
                    if isinstance(v, torch.Tensor):
                        put(d, k, v)
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
            wrapped = getattr(obj, "__wrapped__", None)
            if wrapped is not None:
                visit(wrapped, depth + 1)
            if not _user_function(obj):
                return
            for var, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
                try:
                    v = cell.cell_contents
                except ValueError:  # empty cell
                    continue
                visit(v, depth + 1, cell, None, var)
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
        if isinstance(obj, types.ModuleType) or not _user_function(type(obj)):
            return
        d = getattr(obj, "__dict__", None)  # callable objects, dataclasses, ...
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


_nesting = threading.local()


def region_depth() -> int:
    """How many remat regions this thread is inside of (see :func:`entered`)."""
    return getattr(_nesting, "depth", 0)


@contextlib.contextmanager
def entered():
    """Mark a remat region's call: the op trace of an enclosing region treats the
    whole nested call as opaque (it may run plainly in one run and as a custom
    ``autograd.Function`` in the other)."""
    _nesting.depth = region_depth() + 1
    try:
        yield
    finally:
        _nesting.depth -= 1


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
        while _F.is_functorch_wrapped_tensor(t):
            t = _F.get_unwrapped(t)
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


def mutated_input(name: str, t: torch.Tensor) -> RematError:
    """The error for a region that modifies one of its inputs in place."""
    return RematError(
        f"remat({name}) modified its input {describe(t)} in place; recomputing the region in "
        "backward would apply the change twice. Fix: work on a copy inside the function "
        "(x = x.clone()) or move the in-place update out of the rematerialised region."
    )
