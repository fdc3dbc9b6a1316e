"""``remat`` under ``torch.compile``: delegate to ``torch.utils.checkpoint``.

While Dynamo traces, a remat region is handed to
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, which Dynamo
turns into the ``tag_activation_checkpoint`` higher-order op.  AOTAutograd's
min-cut partitioner then recomputes the region's ops in the compiled backward
unless the policy says to save them: the policy is passed as a selective
activation checkpointing ``context_fn`` (``create_selective_checkpoint_contexts``),
so ``remat(f, policy=...)`` decides what the compiled backward recomputes,
exactly as in eager mode.  The region is never inlined into the surrounding
graph, so the compiler cannot undo the rematerialisation (``prevent_cse``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch.utils.checkpoint as _tc

from ._errors import PolicyError
from ._functorch import transforms_active
from ._region import RegionCall
from .policies import nothing_saveable

__all__ = ["run_compiled", "sac_context_fn"]


def _to_sac(decision: Any) -> _tc.CheckpointPolicy:
    if isinstance(decision, _tc.CheckpointPolicy):
        return decision
    if isinstance(decision, bool):
        return _tc.CheckpointPolicy.MUST_SAVE if decision else _tc.CheckpointPolicy.PREFER_RECOMPUTE
    name = getattr(decision, "name", None)  # a CheckpointPolicy-like enum of remat_fn
    if isinstance(name, str) and hasattr(_tc.CheckpointPolicy, name):
        return getattr(_tc.CheckpointPolicy, name)
    raise PolicyError(
        f"a remat policy returned {decision!r}; expected a bool or a "
        "torch.utils.checkpoint.CheckpointPolicy. Fix the policy's return value."
    )


def _sac_policy(policy, ctx, op, *args, **kwargs):
    return _to_sac(policy(ctx, op, *args, **kwargs))


def sac_context_fn(policy: Any):
    """The ``context_fn`` that makes torch's checkpoint follow ``policy``.

    ``None`` means recompute everything (torch's default ``context_fn``); a
    list/tuple/set of ops means "save these ops"; a callable is a SAC policy
    ``policy(ctx, op, *args, **kwargs)`` returning a bool or a ``CheckpointPolicy``.
    """
    if policy is None or policy is nothing_saveable:
        return _tc.noop_context_fn
    if isinstance(policy, (list, tuple, set, frozenset)):
        return functools.partial(_tc.create_selective_checkpoint_contexts, list(policy))
    if callable(policy):
        return functools.partial(
            _tc.create_selective_checkpoint_contexts, functools.partial(_sac_policy, policy)
        )
    raise PolicyError(f"cannot use policy {policy!r} under torch.compile: expected a callable or a list of ops")


def run_compiled(call: RegionCall):
    """Run the region as a torch checkpoint region (Dynamo is tracing)."""
    fun, args, kwargs = call.fun, call.args, call.kwargs
    policy, preserve_rng_state = call.opts.policy, call.opts.preserve_rng_state
    if transforms_active():
        # torch.compile(grad(f)): AOTAutograd cannot lower torch's checkpoint
        # region inside a traced functorch transform (and a failed attempt leaves
        # saved-tensor hooks disabled for the process).  Trace the function
        # plainly: exact gradients, the compiler's own partitioner decides what
        # to recompute.
        return fun(*args, **kwargs)

    def body(*a):
        return fun(*a, **kwargs)

    context_fn = sac_context_fn(policy)
    if context_fn is _tc.noop_context_fn:
        # Dynamo only accepts a context_fn it can see as a function or a partial.
        return _tc.checkpoint(body, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)
    return _tc.checkpoint(
        body, *args, use_reentrant=False, context_fn=context_fn, preserve_rng_state=preserve_rng_state
    )
