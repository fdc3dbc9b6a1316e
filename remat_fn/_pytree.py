"""Flattening a region's outputs so that no tensor in them is lost.

optree flattens the containers registered with it (tuples, lists, dicts,
namedtuples, registered dataclasses, ...) and treats everything else as a
leaf.  On the ``torch.func`` path only tensor leaves are differentiated, so a
tensor inside an unregistered container would silently get a zero gradient.
:func:`flatten_output` therefore

* flattens unregistered dataclasses and ``Mapping`` subclasses (Hugging Face's
  ``ModelOutput``, an ``OrderedDict`` subclass that is also a dataclass) by
  registering them, on first sight, in a private optree namespace: the user's
  own registry is untouched;
* refuses, with a :class:`RematError` naming the type and the fix, any other
  leaf through which a tensor is reachable.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import threading
from typing import Any

import optree
import torch

from ._errors import RematError

__all__ = ["NAMESPACE", "flatten_output"]

NAMESPACE = "remat_fn"
_lock = threading.Lock()
_registered: set[type] = set()
_ATOMS = (int, float, complex, str, bytes, bool, type(None), type(Ellipsis), torch.dtype,
          torch.device, torch.Size, type)


def _mapping_node(cls: type) -> None:
    as_kwargs = dataclasses.is_dataclass(cls)  # ModelOutput: cls(**fields)

    def flatten(m):
        keys = tuple(m.keys())
        return [m[k] for k in keys], keys, keys

    def unflatten(keys, children):
        items = dict(zip(keys, children))
        return cls(**items) if as_kwargs else cls(items)

    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)


def _dataclass_node(cls: type) -> None:
    names = tuple(f.name for f in dataclasses.fields(cls))

    def flatten(obj):
        return [getattr(obj, n) for n in names], names, names

    def unflatten(names_, children):
        obj = object.__new__(cls)  # the same state, without re-running __init__
        for n, v in zip(names_, children):
            object.__setattr__(obj, n, v)
        return obj

    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)


def _register(cls: type) -> bool:
    """Register ``cls`` in :data:`NAMESPACE` if it is a container we know how to rebuild
    (``False`` for other types, and for types already registered: nothing new)."""
    with _lock:
        if cls in _registered:
            return False
        if isinstance(cls, type) and issubclass(cls, collections.abc.Mapping):
            _mapping_node(cls)
        elif dataclasses.is_dataclass(cls):
            _dataclass_node(cls)
        else:
            return False
        _registered.add(cls)
        return True


def _reaches_tensor(obj: Any, depth: int = 0, seen: set[int] | None = None) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if depth > 4 or isinstance(obj, _ATOMS) or callable(obj):
        return False
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    if isinstance(obj, (list, tuple, set, frozenset)):
        return any(_reaches_tensor(v, depth + 1, seen) for v in obj)
    if isinstance(obj, dict):
        return any(_reaches_tensor(v, depth + 1, seen) for v in obj.values())
    d = getattr(obj, "__dict__", None)
    vals = list(d.values()) if isinstance(d, dict) else []
    for s in getattr(type(obj), "__slots__", ()):
        vals.append(getattr(obj, s, None))
    return any(_reaches_tensor(v, depth + 1, seen) for v in vals)


def flatten_output(out: Any, name: str) -> tuple[list[Any], optree.PyTreeSpec]:
    """``optree.tree_flatten(out)`` that also opens dataclasses and mapping
    subclasses, and refuses containers hiding tensors."""
    while True:
        leaves, spec = optree.tree_flatten(out, none_is_leaf=True, namespace=NAMESPACE)
        new = False
        for x in leaves:
            if isinstance(x, (torch.Tensor, *_ATOMS)) or not _reaches_tensor(x):
                continue
            if _register(type(x)):
                new = True
                continue
            raise RematError(
                f"remat({name}) returned a {type(x).__module__}.{type(x).__qualname__} that "
                "holds tensors but is not a pytree node, so their gradients could not flow "
                "through the region. Fix: register the type with optree "
                "(optree.register_pytree_node, or make it a dataclass) or return its tensors "
                "in a tuple, list, dict or dataclass."
            )
        if not new:
            return leaves, spec
