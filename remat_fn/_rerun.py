"""The ``torch.func`` path's runs again of the function: where no replay of the recorded forward
stands in for it (docs/design.md, "still runs again"), and the strict checks (``debug=True``,
``early_stop=False``), whose run again in backward is checked against the forward and whose
gradient is unused.  Each runs the user's Python, its ops checked op by op against the forward
(see RegionState.call); the ops backward does not need are placeholders where nothing outside
differentiates the backward (see Tape.plan)."""

from __future__ import annotations

import contextlib
import functools
import time

import torch

from ._describe import describe, describe_meta
from ._errors import RecomputeMismatchError, RematError
from ._func_semantics import RegionState, out_meta, primal_under_vjp, random_in_vmap, replace_at
from ._functorch import differentiable_at_top, jvp_innermost, rewrapped, transform_kinds, wrapped_innermost
from ._record import Diverged, saving

__all__ = ["check_again", "rerun_vjp", "recompute_fn"]

_NULL = contextlib.nullcontext()


def check_again(spec: RegionState, tensors, wrt, out_diff, detach: bool, cot) -> None:
    """The strict checks' run again (``debug=True``, ``early_stop=False``), checked against the
    forward; its gradient unused.  A failure of torch's own inside that run (functorch asserts
    under some nestings of side outputs) is named: the gradient does not depend on it."""
    try:
        rerun_vjp(spec, tensors, wrt, out_diff, detach, cot, time.perf_counter(), python=True)
    except RematError:
        raise
    except Exception as e:
        kinds = ", ".join(k.split(".")[-1].lower() for k in transform_kinds()) or "none"
        raise RematError(
            f"remat({spec.name}): the strict check (debug=True or early_stop=False) runs the function again in "
            f"backward, and that run failed under the active transforms ({kinds}): "
            f"{type(e).__name__}: {str(e)[:300]}. The gradient does not come from that run. Fix: check the function "
            "under torch.func.grad, vjp or eager autograd, and pass debug=False (and no early_stop=False) here."
        ) from e


def rerun_vjp(spec: RegionState, tensors, wrt, out_diff, detach: bool, cot, start: float, python: bool = False,
              outer: bool = False):
    """Backward by running the region again under ``torch.func.vjp`` (where no replay of
    the recorded forward stands in for it): the input gradients for ``cot``.  Its torch calls
    replayed where recorded (see remat_fn._logical), unless ``python``: the function itself.
    ``outer``: see recompute_fn."""
    f = recompute_fn(spec, tensors, wrt, out_diff, python=python, outer=outer)
    # (ops whose results backward does not need are skipped where nothing outside differentiates it, see Tape.plan;
    # not at an outer level, which differentiates through what ``detach_`` cut at the innermost: 5x off until this)
    plan = spec.plan if detach and not outer else None

    def rerun(tape, plan):
        with spec.rng or _NULL, saving(spec.rec, recompute=True, tape=tape, plan=plan), random_in_vmap(spec.name):
            return torch.func.vjp(f, *[tensors[i] for i in wrt])[1]

    with torch.no_grad() if detach else _NULL:
        with spec.autocast:  # (the forward's autocast for the forward again; its backward, as autograd's, without)
            try:
                vjp_fn = rerun(None if spec.keep_graph else spec.tape, plan)
            except Diverged:  # (after placeholders: again, computing everything)
                vjp_fn = rerun(None, None)
        if spec.prof is not None:
            spec.prof.record_recompute(spec.name, time.perf_counter() - start)
        return vjp_fn(cot)


def _under_jvp(f, *primals):
    return torch.func.jvp(f, primals, tuple(torch.zeros_like(p) for p in primals))[0]


def recompute_fn(spec: RegionState, tensors, wrt, out_diff, side: list | None = None, python: bool = False,
                 under_jvp: bool = False, outer: bool = False):
    """The region as a function of its differentiated inputs, returning its differentiable outputs
    (``side``: receives its side outputs, which the run left in the caller's objects), to run under
    a vjp level (backward's), or a jvp level (``under_jvp``: the jvp rule's).  That level stands
    innermost where the call's innermost level stood, and ``.data`` strips the innermost wrapper
    only: where the function read it (``spec.foreign``) and the call's innermost level was of the
    other kind, a level of that kind goes around it, for ``.data`` to strip (the levels below
    differentiate through it, as they do plain code's).  Autograd called inside: always under a
    vjp level, as the forward ran it.  ``outer``: the backward of the Function as functorch applies it
    at a level outside the call's innermost (``outside_innermost``), which differentiates through what
    ``.data``, ``detach_`` or a hook did there: a vjp level of its own inside, for them to act on."""
    # (an input the call's innermost level wrapped without differentiating it: see rewrapped)
    held = [i for i, w in enumerate(wrapped_innermost(spec.levels, spec.inner_wrapped)) if w and i not in wrt] \
        if spec.foreign and spec.inner_wrapped and (not under_jvp or spec.foreign == "autograd") else []  # (the jvp rule's: under a vjp level, below)

    # (one it differentiated there, where the function calls autograd itself: requiring grad, as plain code's does, for
    # its torch.autograd.grad of it ("One of the differentiated Tensors does not require grad" until this))
    needed = {i for i in held if spec.foreign == "autograd" and spec.inner_rg[i]}

    def f(*diff_inputs):
        args = replace_at(tensors, wrt, diff_inputs)
        for i in held:
            args[i] = differentiable_at_top(args[i]) if i in needed else rewrapped(args[i])
        with torch.set_grad_enabled(spec.grad_mode):  # (the caller's mode, as the forward ran it)
            outs = checked_outputs(spec, spec.call(args, None, side is not None, python)[0])
        if side is not None:
            side[:] = outs[spec.n_out:]
        return tuple(o for o, d in zip(outs, out_diff) if d)

    # (only those: .data of another strips its own outermost level, as in plain code)
    wrapped = wrapped_innermost(spec.levels, [spec.inner_wrapped[i] for i in wrt]) if spec.inner_wrapped else [True] * len(wrt)
    if under_jvp and spec.foreign == "autograd":
        return functools.partial(primal_under_vjp, f)
    if under_jvp and spec.foreign and spec.levels and not jvp_innermost(spec.levels):
        return functools.partial(_inside, primal_under_vjp, f, wrapped)
    if not under_jvp and spec.foreign is True and jvp_innermost(spec.levels):
        return functools.partial(_inside, _under_jvp, f, wrapped)
    if outer and not under_jvp:
        return functools.partial(_inside, primal_under_vjp, f, wrapped)
    return f


def _inside(level, f, wrapped: list[bool], *primals):
    """``f(*primals)`` under a level of its own (``level(g, *primals)``: ``primal_under_vjp``, ``_under_jvp``)
    that wraps the primals ``wrapped`` says only."""
    at = [i for i, w in enumerate(wrapped) if w]
    if not at:  # (the level all the same: ``detach_`` acts at the innermost level, a no-op on what it does not wrap,
        return level(lambda _: f(*primals), torch.zeros(()))  # which the levels outside differentiate, as plain code's)

    def g(*some):
        full = list(primals)
        for i, t in zip(at, some):
            full[i] = t
        return f(*full)

    return level(g, *[primals[i] for i in at])


def checked_outputs(spec, outs):
    """A re-run's outputs, checked against the forward's (shape, dtype, device)."""
    meta = spec.out_meta
    if len(outs) != len(meta) or any(out_meta(o) != m for o, m in zip(outs, meta)):
        got = ", ".join(describe(o, device=True) for o in outs)
        want = ", ".join(describe_meta(*m) for m in meta)
        raise RecomputeMismatchError(
            f"Recomputing remat({spec.name}) returned tensors ({got}) but the forward returned "
            f"({want}). The function must be deterministic in its tensor structure: make shapes "
            "and control flow depend only on its arguments (pass Python values through "
            "static_argnums/static_argnames), not on global state."
        )
    return outs
