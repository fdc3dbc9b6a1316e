"""remat_fn: JAX-style rematerialisation (activation checkpointing) for PyTorch."""

from __future__ import annotations

from . import policies
from ._residuals import Residual, print_saved_residuals, saved_residuals
from ._saving import checkpoint_name
from ._debug import set_debug_enabled
from ._errors import MutatedSavedTensorError, PolicyError, RecomputeMismatchError, RematError
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
]

__version__ = "0.1.0"
