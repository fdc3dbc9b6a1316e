"""Rematerialising ``nn.Module``s in place: ``remat_module`` and ``apply_remat``.

``remat_module(m)`` changes the class of ``m`` to a generated subclass
(``Remat<Name>``, created once per class) whose ``forward`` runs the original
``forward`` through :func:`remat_fn.remat`.  This is the technique FSDP2's
``fully_shard`` uses, and it means:

* no wrapper module, so ``state_dict()``/``named_parameters()`` keys, attribute
  access, hooks and ``isinstance(m, OriginalClass)`` are unchanged;
* ``copy.deepcopy(m)`` gives an independent rematerialised module;
* ``torch.func.functional_call(m, params, ...)`` with ``grad``/``vmap(grad)``
  works, since the parameters swapped in are found when the forward runs.

``unremat_module(m)`` restores the original class.  Rematerialised modules
cannot be pickled whole (save their ``state_dict()``, as usual).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._transform import remat

__all__ = ["remat_module", "apply_remat", "unremat_module", "is_remat_module"]

_CLASSES: dict[type, type] = {}
_POLICY_ATTR = "_remat_fn_policy"


def _make_class(cls: type[torch.nn.Module]) -> type:
    sub = _CLASSES.get(cls)
    if sub is not None:
        return sub
    def forward(self, *args, **kwargs):
        policy = self.__dict__.get(_POLICY_ATTR)
        return remat(cls.forward.__get__(self), policy=policy)(*args, **kwargs)

    forward.__doc__ = getattr(cls.forward, "__doc__", None)
    sub = type(
        f"Remat{cls.__name__}",
        (cls,),
        {"forward": forward, "_remat_fn_original_class": cls, "__module__": cls.__module__},
    )
    sub.__qualname__ = f"Remat{cls.__qualname__}"
    _CLASSES[cls] = sub
    return sub


def _noop():
    return None


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
    remat(_noop, policy=policy)  # an invalid policy fails now, not at the first forward
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
    check_fn: Callable[[torch.nn.Module], bool],
    *,
    policy: Any = None,
) -> torch.nn.Module:
    """Apply :func:`remat_module` in place to every submodule (``model`` included)
    for which ``check_fn(submodule)`` is true; returns ``model``.

    Matching modules nested in other matching modules become nested regions
    (more recomputation, less memory); pick ``check_fn`` to avoid that if it
    is not wanted.

    >>> import torch, remat_fn.nn
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
    >>> _ = remat_fn.nn.apply_remat(net, lambda m: isinstance(m, torch.nn.Linear))
    >>> [remat_fn.nn.is_remat_module(m) for m in net]
    [True, False, True]
    """
    targets = [m for m in model.modules() if check_fn(m)]
    for m in targets:
        remat_module(m, policy=policy)
    return model
