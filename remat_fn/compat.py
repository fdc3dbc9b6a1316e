"""Drop-in replacements for ``torch.utils.checkpoint``, built on :func:`remat_fn.remat`.

``checkpoint`` and ``checkpoint_sequential`` take torch's arguments and behave
like ``torch.utils.checkpoint`` with ``use_reentrant=False``, except that they
also work under ``torch.func`` transforms (``grad``, ``vjp``, ``jacrev``,
``hessian``, ``vmap(grad)``, ``functional_call``), where torch's own
checkpoint fails.  Swap them in wherever a checkpoint function is accepted::

    model._set_gradient_checkpointing(True, gradient_checkpointing_func=remat_fn.compat.checkpoint)

Differences from torch, all deliberate:

* ``use_reentrant`` is accepted and ignored, with no warning: there is a
  single implementation, and none of the limitations of torch's reentrant
  variant (no ``torch.autograd.grad``, no keyword arguments, no nested
  structures) is reproduced.
* ``context_fn``: ``functools.partial(create_selective_checkpoint_contexts,
  policy_or_ops)`` is recognised (the policy is read from the returned
  ``_CachingTorchDispatchMode``) and becomes ``remat(policy=...)``, so
  selective checkpointing also works under ``torch.func``.  Any other
  ``context_fn`` is honoured as torch does: the forward runs under its first
  context manager and every recomputation under its second.
* ``determinism_check``: ``"default"`` and ``"none"`` are accepted (anything
  else raises ``ValueError`` as in torch).  remat_fn always checks the number,
  shapes, dtypes and devices of recomputed tensors: the check is free, and a
  recomputation that differs could only produce wrong gradients.
* ``early_stop`` (or ``torch.utils.checkpoint.set_checkpoint_early_stop``):
  ``True`` (the default) stops a recomputation once the last needed tensor is
  rebuilt; ``False`` runs it whole and raises
  :class:`remat_fn.RecomputeMismatchError` if it saved more, fewer or
  different tensors than the forward.  Under ``torch.func`` the region is
  always recomputed whole and checked op by op.
* ``debug=True`` (or ``torch.utils.checkpoint.set_checkpoint_debug_enabled``,
  or :func:`remat_fn.set_debug_enabled`) records op traces with user source
  lines, runs recomputations whole, and raises
  :class:`remat_fn.RecomputeMismatchError`, showing both traces, when the
  recomputation runs a different op sequence.
* Under ``torch.compile`` both functions call ``torch.utils.checkpoint``
  itself, so the compiler sees the usual ``tag_activation_checkpoint`` region
  (inside a transform traced by the compiler, e.g. ``torch.compile(grad(f))``,
  the function is traced plainly, as ``remat`` does).
"""

from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint as _tc

from ._debug import early_stop as _early_stop
from ._functorch import transforms_active
from ._structured import sequential_segments
from ._torch_internals import CachingTorchDispatchMode, checkpoint_flag
from ._transform import call_once

__all__ = ["checkpoint", "checkpoint_sequential"]

_DETERMINISM_CHECKS = ("default", "none")


def _is_noop(context_fn) -> bool:
    return context_fn is None or context_fn is _tc.noop_context_fn


class _Contexts:
    """The two context managers of one checkpoint call and which one is next."""

    __slots__ = ("context_fn", "forward", "recompute", "forward_done")

    def __init__(self, context_fn, forward, recompute):
        self.context_fn = context_fn
        self.forward = forward
        self.recompute = recompute
        self.forward_done = False


def _run_in_contexts(state: _Contexts, function, *args, **kwargs):
    # The first completed call is the forward; every later call recomputes.
    if state.forward_done:
        with state.recompute:
            return function(*args, **kwargs)
    try:
        with state.forward:
            out = function(*args, **kwargs)
    except BaseException:
        # The forward may be retried (e.g. to thread a newly found captured
        # tensor): give it fresh context managers.
        state.forward, state.recompute = state.context_fn()
        raise
    state.forward_done = True
    return out


def _policy_of(context_fn):
    """Return (policy, contexts or None) for a ``context_fn``."""
    if _is_noop(context_fn):
        return None, None
    contexts = context_fn()
    try:
        fwd, rec = contexts
    except (TypeError, ValueError):
        raise TypeError(
            "context_fn must return a tuple of two context managers (forward, recompute), "
            f"got {contexts!r}"
        ) from None
    if isinstance(fwd, CachingTorchDispatchMode):
        # functools.partial(create_selective_checkpoint_contexts, policy_fn_or_ops)
        return fwd.policy_fn, None
    return None, _Contexts(context_fn, fwd, rec)


def checkpoint(
    function,
    *args,
    use_reentrant: bool | None = None,
    context_fn=None,
    preserve_rng_state: bool = True,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    **kwargs,
):
    """Checkpoint ``function(*args, **kwargs)``: same arguments and results as
    ``torch.utils.checkpoint.checkpoint``, also under ``torch.func`` transforms.

    Inputs and outputs may be any nesting of tensors and other values;
    ``kwargs`` are passed to ``function``.  See the module docstring for how
    each of torch's options is honoured.

    >>> import torch
    >>> from remat_fn.compat import checkpoint
    >>> w = torch.randn(3, 3)
    >>> f = lambda x, scale=1.0: torch.tanh(x @ w) * scale
    >>> x = torch.randn(2, 3)
    >>> g = torch.func.grad(lambda x: checkpoint(f, x, scale=2.0).sum())(x)
    >>> torch.allclose(g, torch.func.grad(lambda x: f(x, scale=2.0).sum())(x))
    True
    """
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(
            f"determinism_check should be one of {list(_DETERMINISM_CHECKS)}, "
            f"but got {determinism_check}"
        )
    if not callable(function):
        raise TypeError(f"checkpoint expects a callable, got {type(function).__name__}")
    if torch.compiler.is_compiling():
        if transforms_active():
            return function(*args, **kwargs)  # see remat_fn/_path_compile.py
        return _tc.checkpoint(
            function, *args, use_reentrant=False,
            context_fn=_tc.noop_context_fn if context_fn is None else context_fn,
            preserve_rng_state=preserve_rng_state, determinism_check=determinism_check,
            debug=debug, early_stop=early_stop, **kwargs,
        )
    global_debug = checkpoint_flag("_checkpoint_debug_enabled")
    if global_debug is not None:
        debug = global_debug
    if not torch.is_grad_enabled() and not transforms_active():
        # As torch: without grad mode nothing is saved and context_fn is not used.
        return function(*args, **kwargs)
    policy, contexts = _policy_of(context_fn)
    if contexts is not None:
        function = functools.partial(_run_in_contexts, contexts, function)
    global_early_stop = checkpoint_flag("_enable_checkpoint_early_stop")
    if global_early_stop is not None:
        early_stop = global_early_stop
    if early_stop and contexts is None:
        # (a generic context_fn's recompute context wraps a re-run of the function,
        # as in torch: such calls re-run it, whole and checked)
        return call_once(function, args, kwargs, policy=policy, preserve_rng_state=preserve_rng_state,
                         debug=bool(debug))
    with _early_stop(False):
        return call_once(function, args, kwargs, policy=policy, preserve_rng_state=preserve_rng_state,
                         debug=bool(debug))


def checkpoint_sequential(functions, segments, input, use_reentrant: bool | None = None, **kwargs):
    """``torch.utils.checkpoint.checkpoint_sequential`` on remat_fn.

    ``functions`` is an ``nn.Sequential`` or a list of callables; they are
    split into ``segments`` chunks of ``len(functions) // segments`` (the last
    takes the rest) and all chunks but the last are checkpointed.  Accepted
    keyword: ``preserve_rng_state``; ``use_reentrant`` is ignored.
    """
    preserve = kwargs.pop("preserve_rng_state", True)
    if kwargs:
        raise ValueError("Unexpected keyword arguments: " + ",".join(arg for arg in kwargs))
    if torch.compiler.is_compiling():
        return _tc.checkpoint_sequential(
            functions, segments, input, use_reentrant=False, preserve_rng_state=preserve
        )
    return sequential_segments(functions, segments, input, policy=None, preserve_rng_state=preserve)

