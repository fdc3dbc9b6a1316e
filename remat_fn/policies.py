"""Rematerialisation policies (JAX names)."""

from __future__ import annotations

__all__ = ["nothing_saveable"]


def nothing_saveable(*_args, **_kwargs) -> bool:
    """Save nothing: recompute every intermediate value (the default policy)."""
    return False
