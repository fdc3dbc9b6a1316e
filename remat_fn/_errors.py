"""Exceptions raised by remat_fn. Every message names the fix."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils.checkpoint import CheckpointError

from ._describe import describe

__all__ = [
    "RematError",
    "RecomputeMismatchError",
    "MutatedSavedTensorError",
    "PolicyError",
    "mutated_input",
    "explain_misuse",
]

F = TypeVar("F", bound=Callable[..., Any])


class RematError(RuntimeError):
    """Base class of every error raised by :mod:`remat_fn`."""


class RecomputeMismatchError(RematError, CheckpointError):
    """The recomputation produced different tensors from the original forward.

    Raised when the number, shape, dtype or device of the tensors saved (or
    returned) during recomputation differs from the first run. With
    ``debug=True`` the message lists both op traces with user source lines.
    Also a ``torch.utils.checkpoint.CheckpointError``, which torch's checkpoint
    raises there: code catching that catches this.
    """


class MutatedSavedTensorError(RematError):
    """A tensor needed to recompute the region was modified in place after forward."""


class PolicyError(RematError):
    """A policy returned an invalid decision or was configured inconsistently."""


def mutated_input(name: str, t: torch.Tensor) -> RematError:
    """The error for a region that modifies one of its inputs in place."""
    return RematError(
        f"remat({name}) modified its input {describe(t)} in place; recomputing the region in "
        "backward would apply the change twice. Fix: work on a copy inside the function "
        "(x = x.clone()) or move the in-place update out of the rematerialised region."
    )


def mutated_outside(name: str, t: torch.Tensor, old: int, new: int) -> MutatedSavedTensorError:
    """The error for an outside tensor the recomputation reads that changed in place since the forward."""
    return MutatedSavedTensorError(
        f"The tensor {describe(t)} that remat({name}) reads to recompute its saved values (an "
        "argument, a parameter, a buffer or a tensor it closes over) was modified in place after "
        f"the forward (version {old} -> {new}). Fix: clone it before modifying it (x = x.clone()), "
        "or apply the in-place update (e.g. optimizer.step()) after the backward pass."
    )


def explain_misuse(hint: Callable[[tuple, dict], str | None]) -> Callable[[F], F]:
    """Decorator: a call that does not bind to the function's signature raises
    Python's ``TypeError`` with ``hint(args, kwargs)`` appended (the fix for a
    habit from another API; ``None``: the error as it is).  Calls that bind pay
    one Python frame; ``inspect.signature`` still shows the function's own."""
    def decorate(fn: F) -> F:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except TypeError as e:
                try:
                    sig.bind(*args, **kwargs)
                except TypeError:
                    msg = hint(args, kwargs)
                    if msg:
                        raise TypeError(f"{e}. {msg}") from None
                raise
        return wrapper  # type: ignore[return-value]
    return decorate
