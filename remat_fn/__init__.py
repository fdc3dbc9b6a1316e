"""remat_fn: JAX-style rematerialisation (activation checkpointing) for PyTorch.

``remat_fn.random``, ``.policies``, ``.compat``, ``.nn`` and ``.distributed`` are
reachable after ``import remat_fn``; all but ``policies`` load on first use (so
``import remat_fn`` does not import ``torch.distributed``).
"""

from __future__ import annotations

import importlib

from . import policies
from ._debug import set_debug_enabled
from ._errors import MutatedSavedTensorError, PolicyError, RecomputeMismatchError, RematError
from ._profile import Profile, RegionStats, profile
from ._record import checkpoint_name
from ._residuals import Residual, print_saved_residuals, saved_residuals
from ._structured import remat_scan, remat_sequential
from ._transform import checkpoint, remat

checkpoint_policies = policies

__all__ = [
    "remat",
    "checkpoint",
    "policies",
    "checkpoint_name",
    "saved_residuals",
    "print_saved_residuals",
    "Residual",
    "checkpoint_policies",
    "remat_sequential",
    "remat_scan",
    "RematError",
    "RecomputeMismatchError",
    "MutatedSavedTensorError",
    "PolicyError",
    "set_debug_enabled",
    "profile",
    "Profile",
    "RegionStats",
]

__version__ = "0.1.0"

_LAZY = ("random", "compat", "nn", "distributed", "memory")


def __getattr__(name: str):
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
