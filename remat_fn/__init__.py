"""remat_fn: JAX-style rematerialisation (activation checkpointing) for PyTorch."""

from __future__ import annotations

from . import policies
from ._errors import MutatedSavedTensorError, PolicyError, RecomputeMismatchError, RematError
from ._transform import checkpoint, remat

checkpoint_policies = policies

__all__ = [
    "remat",
    "checkpoint",
    "policies",
    "checkpoint_policies",
    "RematError",
    "RecomputeMismatchError",
    "MutatedSavedTensorError",
    "PolicyError",
]

__version__ = "0.1.0"
