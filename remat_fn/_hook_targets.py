"""Where a hook the region's function registers goes (the ``torch.func`` path).

Plain code's hook on an argument or on a tensor the function closes over sits on the
caller's tensor and sees that tensor's whole gradient, also where the caller uses it
outside the region.  Under ``torch.func`` the function gets the Function's inputs in
their place (:mod:`remat_fn._captures`), whose hooks would see the region's share
only: 4.1 off under ``grad``, 26 under ``vmap(grad)``, 148 under ``grad`` of ``grad``,
up to 1.6e3 through nested regions, silently, until this module.  So such a hook goes
on the caller's tensor, through every enclosing region of which the tensor is an
input too; a run again of the function registers nothing (its forward put the hook
there), nor does a hook where the caller's tensor needs no gradient (forward mode:
remat's forward level reports ``requires_grad`` where plain code's does not).  A hook
on a tensor an enclosing region made is that region's backward code (its capture
mode turns ``opaque``: a replay cannot run it, the function runs again).
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from ._ambient import AMBIENT
from ._torch_internals import hooks_since

__all__ = ["REDIRECTED", "redirect_hook", "claiming", "no_hook"]

_HOOK = torch.Tensor.register_hook
REDIRECTED = frozenset({_HOOK, torch.Tensor.register_post_accumulate_grad_hook})
_KIND = {_HOOK: 0, torch.Tensor.register_post_accumulate_grad_hook: 1}  # (see hooks_since)


@contextlib.contextmanager
def claiming(tensors, first: int):
    """The ``torch.func`` path's forward after an abandoned eager try (which stopped at the function's ``torch.func``
    call): the hooks that try registered on ``tensors`` (its inputs and what it closes over) stay, and a registration
    of the forward on one of them takes the place of one, with its own function (whose closure sees what the function
    did after the ``torch.func`` call, where the try stopped).  Dropped, a hook the function registers once (behind a
    flag) was lost (15.2 off, a hostile pass); kept and added again, it fired twice (1.65 off); kept as the try left it,
    its closure saw the try's objects (5.4x off, a hostile pass)."""
    claims: dict = {}
    for t in {id(t): t for t in tensors}.values():  # (a tensor passed twice, or passed and closed over: once)
        for kind, hooks, k in hooks_since(t, first):
            claims.setdefault((id(t), kind), []).append((hooks, k))
    prev, AMBIENT.claims = AMBIENT.claims, claims or None
    try:
        yield
    finally:
        AMBIENT.claims = prev


_NONE: collections.OrderedDict = collections.OrderedDict()  # (what a handle that removes nothing points at)


def no_hook() -> RemovableHandle:
    """The handle of a registration that registers nothing (a hook plain code's tensor would never run)."""
    return RemovableHandle(_NONE)


def _unless_none(hook, grad):
    """An input no op read gets no gradient, which autograd hands its hook as None: plain code's never runs."""
    return None if grad is None else hook(grad)


def redirect_hook(mode, func, args, kwargs) -> tuple[bool, Any]:
    """``func(*args, **kwargs)`` (a hook registration) seen by the capture ``mode`` innermost now:
    ``(True, handle)`` where it went on the caller's tensor (or nowhere), ``(False, None)`` for a
    tensor this region made (its own backward code: the caller registers it as it is)."""
    t, modes = args[0], AMBIENT.captures
    if mode.hook_on is None or not modes or modes[-1] is not mode or (id(t) not in mode.hook_on and id(t) not in mode.threaded):
        return False, None
    for m in reversed(modes):
        on = m.hook_on or {}
        if id(t) not in on and id(t) not in m.threaded:  # (made by that region: its backward code)
            m.opaque, _ = True, m.logical is not None and m.logical.fail()
            break
        t = None if m.known is None else on.get(id(t), t)  # (a run again: its forward put it on the caller's tensor)
        if t is None:
            break
    if t is None or not t.requires_grad:
        return True, no_hook()
    if func is _HOOK:
        args = (t, functools.partial(_unless_none, args[1]), *args[2:])
    if AMBIENT.claims and (left := AMBIENT.claims.get((id(t), _KIND[func]))):
        hooks, k = left.pop(0)  # (the abandoned eager try's, in its place among the tensor's hooks: this run's function,
        hooks[k] = args[1]  # whose closure sees what the function did after its torch.func call, see claiming)
        out = RemovableHandle(hooks)
        out.id = k
    else:
        out = func(t, *args[1:], **(kwargs or {}))
    for m in modes:  # (removed if a try of any of them stops: see RegionState._call)
        m.hooked.append(out)
    return True, out
