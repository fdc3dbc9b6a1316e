"""Rematerialising ``nn.Module``s in place: ``remat_module`` and ``apply_remat``.

``remat_module(m)`` changes the class of ``m`` to a generated subclass
(``Remat<Name>``, created once per class) whose ``forward`` runs the original
``forward`` through :func:`remat_fn.remat`.  This is the technique FSDP2's
``fully_shard`` uses, and it means:

* no wrapper module, so ``state_dict()``/``named_parameters()`` keys, attribute
  access, hooks and ``isinstance(m, OriginalClass)`` are unchanged;
* ``copy.deepcopy(m)`` gives an independent rematerialised module;
* ``torch.func.functional_call(m, params, ...)`` with ``grad``/``vmap(grad)``
  works, since the parameters swapped in are found when the forward runs;
* the module pickles whole (``torch.save(model)``/``torch.load``, ``pickle``):
  the generated class is not importable, so it pickles as "the original class,
  rematerialised" and is rebuilt from the original class on load.  The policy
  travels in the module's ``__dict__`` (the policies of :mod:`remat_fn.policies`
  pickle).

No wrapper function is built per forward: the options are validated once (in
:func:`remat_module`) and each forward is one region call.

``unremat_module(m)`` restores the original class.
"""

from __future__ import annotations

import copyreg
import functools
from collections.abc import Callable
from typing import Any

import torch

from ._transform import call_once
from .policies import normalize_policy

__all__ = ["remat_module", "apply_remat", "unremat_module", "is_remat_module"]

_CLASSES: dict[type, type] = {}
_POLICY_ATTR = "_remat_fn_policy"


def _make_class(cls: type[torch.nn.Module]) -> type:
    sub = _CLASSES.get(cls)
    if sub is not None:
        return sub
    def forward(self, *args, **kwargs):
        # the options are validated once per policy (call_once caches them):
        # no wrapper is built per forward, and the module keeps no reference to
        # itself (a cached bound method would make a reference cycle); a partial,
        # not cls.forward.__get__(self), which Dynamo on torch 2.12 cannot trace
        return call_once(functools.partial(cls.forward, self), args, kwargs, policy=self.__dict__.get(_POLICY_ATTR))

    def __reduce_ex__(self, protocol):
        # ``Remat<Name>`` cannot be looked up by name: pickle the original
        # class and rebuild the generated subclass from it on load
        return _reduce_with_original(cls.__reduce_ex__(self, protocol), sub, cls)

    forward.__doc__ = getattr(cls.forward, "__doc__", None)
    sub = type(
        f"Remat{cls.__name__}",
        (cls,),
        {"forward": forward, "__reduce_ex__": __reduce_ex__,
         "_remat_fn_original_class": cls, "__module__": cls.__module__},
    )
    sub.__qualname__ = f"Remat{cls.__qualname__}"
    _CLASSES[cls] = sub
    return sub


def _new_remat(cls: type, *args: Any) -> Any:
    """Unpickling: ``copyreg.__newobj__`` for the rematerialised subclass of ``cls``."""
    sub = _make_class(cls)
    return sub.__new__(sub, *args)


def _new_remat_ex(cls: type, args: tuple, kwargs: dict) -> Any:
    """Unpickling: ``copyreg.__newobj_ex__`` for the rematerialised subclass of ``cls``."""
    sub = _make_class(cls)
    return sub.__new__(sub, *args, **kwargs)


def _reconstruct_remat(cls: type, base: type, state: Any) -> Any:
    """Unpickling (protocols 0 and 1): ``copyreg._reconstructor`` for ``cls``'s subclass."""
    return copyreg._reconstructor(_make_class(cls), base, state)  # type: ignore[attr-defined]


def _call_remat(cls: type, args: tuple) -> Any:
    """Unpickling, for a ``__reduce__`` that calls the class: call the subclass."""
    return _make_class(cls)(*args)


def _reduce_with_original(rv: Any, sub: type, cls: type) -> Any:
    """``rv`` (a ``__reduce_ex__`` value) with the generated ``sub`` replaced by
    a constructor that rebuilds it from the importable ``cls``."""
    if not isinstance(rv, tuple) or len(rv) < 2:
        return rv
    fn, args, rest = rv[0], rv[1], rv[2:]
    if fn is copyreg.__newobj__ and args and args[0] is sub:  # type: ignore[attr-defined]
        return (_new_remat, (cls, *args[1:]), *rest)
    if fn is copyreg.__newobj_ex__ and args and args[0] is sub:  # type: ignore[attr-defined]
        return (_new_remat_ex, (cls, *args[1:]), *rest)
    if fn is copyreg._reconstructor and args and args[0] is sub:  # type: ignore[attr-defined]
        return (_reconstruct_remat, (cls, *args[1:]), *rest)
    if fn is sub:
        return (_call_remat, (cls, args), *rest)
    return rv


def is_remat_module(module: torch.nn.Module) -> bool:
    """True if ``module``'s forward is rematerialised by :func:`remat_module`."""
    return "_remat_fn_original_class" in type(module).__dict__


def remat_module(module: torch.nn.Module, *, policy: Any = None) -> torch.nn.Module:
    """Rematerialise ``module``'s forward, in place; returns ``module``.

    Parameter and buffer names, ``state_dict()`` keys and attribute access are
    unchanged (no wrapper is inserted).  Calling it again only changes the
    policy.

    >>> import torch, remat_fn.nn
    >>> lin = torch.nn.Linear(3, 3)
    >>> keys = list(lin.state_dict())
    >>> remat_fn.nn.remat_module(lin) is lin, list(lin.state_dict()) == keys
    (True, True)
    >>> isinstance(lin, torch.nn.Linear), lin.in_features
    (True, 3)
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"remat_module expects an nn.Module, got {type(module).__name__}")
    # an invalid policy fails now, not at the first forward; a list of ops (or one
    # op) is kept normalised: hashable, it pickles, and the object exists before
    # torch.compile traces a forward (Dynamo takes it as a constant)
    policy = normalize_policy(policy)
    if not is_remat_module(module):
        module.__class__ = _make_class(type(module))
    module.__dict__[_POLICY_ATTR] = policy
    return module


def unremat_module(module: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`remat_module`; returns ``module``."""
    if is_remat_module(module):
        module.__class__ = type(module).__dict__["_remat_fn_original_class"]
        module.__dict__.pop(_POLICY_ATTR, None)
    return module


def apply_remat(
    model: torch.nn.Module,
    check_fn: Callable[[torch.nn.Module], bool] | type | tuple[type, ...],
    *,
    policy: Any = None,
) -> torch.nn.Module:
    """Apply :func:`remat_module` in place to every submodule (``model`` included)
    for which ``check_fn(submodule)`` is true; returns ``model``.

    ``check_fn`` may also be a module class or a tuple of classes, meaning
    ``isinstance(submodule, check_fn)`` (as FSDP's wrap policies take classes):
    ``apply_remat(model, nn.TransformerEncoderLayer)``.

    Matching modules nested in other matching modules become nested regions
    (more recomputation, less memory); pick ``check_fn`` to avoid that if it
    is not wanted.

    >>> import torch, remat_fn.nn
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
    >>> _ = remat_fn.nn.apply_remat(net, lambda m: isinstance(m, torch.nn.Linear))
    >>> [remat_fn.nn.is_remat_module(m) for m in net]
    [True, False, True]
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"apply_remat expects an nn.Module as model, got {type(model).__name__}. "
                        "Fix: apply_remat(model, check_fn, policy=...).")
    if isinstance(check_fn, type) or (
        isinstance(check_fn, tuple) and check_fn and all(isinstance(c, type) for c in check_fn)
    ):
        classes = check_fn
        targets = [m for m in model.modules() if isinstance(m, classes)]
    elif callable(check_fn):
        targets = [m for m in model.modules() if check_fn(m)]
    else:
        raise TypeError(
            f"apply_remat's check_fn must be a function check_fn(module) -> bool, a module class or "
            f"a tuple of classes; got {type(check_fn).__name__} {check_fn!r}. Fix: e.g. "
            "apply_remat(model, lambda m: isinstance(m, Block)) or apply_remat(model, Block)."
        )
    for m in targets:
        remat_module(m, policy=policy)
    return model
