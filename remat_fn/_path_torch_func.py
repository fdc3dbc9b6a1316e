"""The ``torch.func`` path: an ``autograd.Function`` that recomputes in backward.

torch refuses saved-tensor hooks under ``torch.func.grad``/``vjp``/``jacrev``,
so when a functorch transform is active the region runs inside
:class:`_RematFunction`:

* ``forward`` runs the region once, under a ``vjp`` level of its own whose
  graph saves tape handles (see :mod:`remat_fn._func_graph`), and returns its
  tensor outputs; the Function saves only the inputs (and captured tensors).
* ``backward`` differentiates that graph, its saved tensors replayed from the
  tape, where nothing outside differentiates the backward; where something
  does (``grad`` of ``grad``, ``hessian``) and under forward mode (``jvp``),
  the tape's replay through every active transform (:mod:`remat_fn._replay_live`).
  Where no replay can stand in (docs/design.md) it runs the region again (:mod:`remat_fn._rerun`);
  ``debug=True`` runs it again to check it.  ``generate_vmap_rule`` covers ``vmap``.
* Under ``vmap(grad)`` (every vmap outside the other transforms) backward
  differentiates the forward level's graph under the forward's vmap levels:
  the tape replays the batched tensors below them and the unpack puts their
  wrappers back (see remat_fn._func_graph.KeepHandles).
* Tensors the function closes over (found by :mod:`remat_fn._closures`, substituted
  by :mod:`remat_fn._captures`) are extra inputs, so their gradients are exact.
* Memory under ``grad``: functorch differentiates with ``create_graph=True``,
  which would keep every recomputed activation alive in the graph of the
  gradient.  When no outer level can differentiate the result (no other live
  grad level wraps the saved tensors or cotangents, and no base tensor
  requires grad) the recomputation and its vjp run under ``torch.no_grad()``
  (the inner ``vjp`` still differentiates), so each block's recomputed
  activations are freed as soon as its backward finishes.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
import weakref
from typing import Any

import torch

from ._ambient import AMBIENT
from ._budget import Measuring
from ._captures import Known, MissedCapture, logical_around, nested_in_forward, note_region_inputs, note_region_outputs, refs_counted, substituted
from ._closures import reachable_tensors
from ._describe import describe
from ._errors import RematError
from ._frame import Frame, finish_tape, output_value
from ._func_graph import (
    KeepHandles,
    Unpack,
    alias_map,
    alias_output,
    batched_outputs,
    detached_alias,
    distinct_objects,
    foreign_functions,
    from_graph,
    input_places,
    note_storage,
    outside_reach,
    rebuild,
    release_outputs,
    returned,
    saved_storages,
    unread_inputs,
)
from ._func_semantics import (
    ForwardHook,
    NeedsGraph,
    RegionState,
    check_lazy_outputs,
    check_unsure,
    connect_side_outputs,
    cotangents,
    deep_enough,
    distinct_inputs,
    draws_in_vmap,
    hooks_aside,
    keep_nothing,
    out_meta,
    plan_rerun,
    saved_inputs,
    stale_side_outputs,
    undo_forward,
)
from ._function_steps import FunctionStep
from ._functorch import (
    above_vmaps,
    any_batched,
    apart_inputs,
    batch_layers,
    carries_grad,
    current_level,
    differentiable,
    differentiated_outside_vmaps,
    forward_mode_active,
    forward_mode_at,
    grad_on_top,
    grad_tops,
    grad_wrappers,
    is_vmap_kind,
    is_wrapped,
    jvp_innermost,
    live_levels,
    needs_grad,
    outside_innermost,
    requires_grad_anywhere,
    storage_ptr,
    unwrap_all,
    unwrap_if_dead,
    version_alias,
    vmaps_outermost,
)
from ._offload import FuncInputs, hint, input_offloads
from ._profile import storage_bytes
from ._record import Record, recording_tapes, saving
from ._region import RegionCall, RNGSnapshot, entered, region_depth
from ._replay_live import CannotReplay, forward_reached, inputs_reaching, replay_fn, replay_jvp, replay_vjp
from ._rerun import check_again, recompute_fn, rerun_vjp
from ._tape import Tape, Value
from ._torch_internals import top_hooks, use_count

__all__ = ["run_torch_func"]

_NULL = contextlib.nullcontext()
# Each retry threads one more tensor closed over; real functions close over a
# bounded number of them, so a long run of retries means a bug, not a model.
_MAX_RETRIES = 256


class _RematFunction(torch.autograd.Function):
    generate_vmap_rule = True
    remat_fn_region = True  # (a nested region under no_grad runs as a region: see remat_fn._function_steps.invisible)

    @staticmethod
    def forward(spec: RegionState, *tensors: torch.Tensor):
        known = Known(tensors)
        wrt = [i for i, n in enumerate(spec.needs) if n]
        returned_ids: set[int] = set()  # (the tensors the function returned, below their wrappers)
        own: dict[int, int] = {}  # (output place -> the input it is, or a view of: see alias_map)
        if wrt:
            # (under forward mode the vjp level takes the inputs reverse mode differentiates, where there are
            # any: a tensor only a jvp level wraps gets its tangent from the replay; see also untracked_stats)
            if spec.fwd and any(spec.rev):
                wrt = [i for i in wrt if spec.rev[i]]
            # The forward runs under a vjp level over the inputs that need a gradient, so the function sees what plain
            # code sees (grad mode on, requires_grad), its outputs tell which are differentiable (a detached or no_grad
            # view is not), tensors that leave by a side channel are found, and ops whose decomposition depends on
            # requires_grad run as they will in the recomputation (so a policy's kept outputs can be replayed).  Without
            # a policy the level's graph keeps nothing (see keep_nothing).  vjp differentiates floating outputs only: the
            # others travel as its auxiliary output.
            box = []
            keep = spec.keep_graph
            measure = spec.rec.policy is not None or spec.prof is not None  # what autograd would save
            tape = spec.tape
            roots: list = []
            noted: dict[int, int] = {}
            frame = spec.frame
            hooks = None
            if frame is not None:  # the level's graph is kept, its saved tensors as tape handles
                hooks = (KeepHandles(frame, noted, spec.batched), Unpack(frame))

            def note(t):  # a tensor autograd saves: backward needs its value
                note_storage(noted, t)
                b = unwrap_all(t)
                v = tape.value_of(b)
                if v is not None:
                    roots.append(v)
                w = tape.write_before(b)
                if w is not None:
                    roots.append(w)

            def f(*diff):
                # (grad mode as at the call: off where only forward mode differentiates, see spec.fwd)
                with _NULL if keep else keep_nothing(spec.name, note, hooks), torch.set_grad_enabled(spec.grad_mode):
                    o, rb = spec.call(spec.level_args(tensors, wrt, diff, known), known)
                # side outputs: candidates now (a tensor the graph saved is alive
                # too), confirmed once the level's graph is gone (below)
                cands = [(p, weakref.ref(t)) for p, t in spec.escaped]
                spec.escaped = []  # (a candidate nothing else held died here: no side output)
                pos, refs = [list(x) for x in zip(*[c for c in cands if c[1]() is not None])] or ([], [])
                o = o + tuple(unwrap_if_dead(r()) for r in refs)  # (one of an exited transform: as functorch reads it)
                returned_ids.update(id(unwrap_all(t)) for t in o if isinstance(t, torch.Tensor))
                own.update(input_places(tape, o, tensors))
                # (see _replay_live; draws under vmap: a replay of the batched ops draws them as they were)
                if (frame is not None or spec.replay) and not spec.aliased and (frame is None or spec.batched or not draws_in_vmap(spec, tape)):
                    spec.out_values = [output_value(tape, t) for t in o]
                    if spec.batched:  # (see replay_jvp, replay_vjp: how the recorded ops batch them)
                        spec.layers = ([batch_layers(t) for t in tensors], [batch_layers(t) for t in o])
                    if (all(is_vmap_kind(k) for k in spec.levels.values()) if spec.batched else any(unwrap_all(t).requires_grad for t in tensors)):
                        # (eager autograd around: an input no output is computed from gets no gradient, None, as plain autograd gives it)
                        reach = inputs_reaching(tape, [t for t in o if differentiable(t)], [id(unwrap_all(t)) for t in tensors], True)
                        spec.unused = [not r for r in reach]
                    roots = [t.grad_fn for t in o if isinstance(t, torch.Tensor) and t.grad_fn is not None]
                    if frame is not None and not spec.held_inputs:  # (checked if a replay is asked for: the graph is kept anyway)
                        spec.roots = roots
                    else:  # (checked now: these nodes would hold the level's graph)
                        spec.foreign = spec.foreign or foreign_functions(roots, _RematFunction, tape.functions)
                mask = [differentiable(t) and carries_grad(t) for t in o]
                # (forward mode around the call: an output made under no_grad has a tangent; in an enclosing
                # region's forward, its tape must see a view of an input made under no_grad as a view, see rebuild)
                if spec.fwd or nested_in_forward():
                    reach = forward_reached(tape, o, {id(unwrap_all(t)) for t in tensors})
                    spec.fwd_diff = [m or (differentiable(t) and r) for m, t, r in zip(mask, o, reach)]
                box.append((rb, mask, saved_storages(o) if keep and measure else noted,
                            pos, refs))
                # vjp wants one output at least: a constant stands in (never read).  A kept
                # graph holds the level's outputs: private aliases (see release_outputs)
                return (tuple(alias_output(t) if frame is not None else t for t, d in zip(o, mask) if d)
                        or (torch.zeros(()),),
                        tuple(t for t, d in zip(o, mask) if not d))

            with saving(spec.rec, recompute=False, tape=tape), hooks_aside():
                douts, vjp_fn, aux = torch.func.vjp(f, *[tensors[i] for i in wrt], has_aux=True)
            if frame is not None:
                frame.in_forward = False
                frame.recomputed.clear()
                spec.graph = vjp_fn  # (its saved tensors: handles the tape replays)
            if spec.out_values is not None:  # (see replay_fn)
                spec.bases = [id(unwrap_all(t)) for t in tensors]
            if frame is not None:
                spec.dmeta = [out_meta(t) for t in douts]
            del vjp_fn  # without a frame, the level's graph: what it saved dies here
            spec.written = tape.pre_write
            if (not keep or spec.replay) and not tape.functions and not spec.foreign:  # (see unread_inputs; keep: the tape holds all)
                spec.unread = unread_inputs(tape, tensors, returned_ids)
            tape.written_storages = []  # (only a retry of this forward puts them back)
            rebuild, mask, saved, pos, refs = box.pop()
            # Side outputs are swapped into the caller's objects: backward replays the recorded forward,
            # or, under vmap(grad), where no replay runs, differentiates the level's graph (its outputs
            # private aliases, see alias_output) unless a region nested in this one holds one of them
            # (swapped, its version checks would fail); batched draws: see draws_in_vmap
            # (``.data`` read where a jvp level is the innermost: plain code's strips that level, the grad levels
            # below differentiate through it; the graph's strips its own level: the function runs again, see rerun_vjp)
            if spec.held_inputs or (refs and (not spec.batched or any(type(s[2]) is not FunctionStep for s in tape.spans))) \
                    or (not spec.batched and draws_in_vmap(spec, tape, batched=True)) or (spec.foreign is True and jvp_innermost(spec.levels)):
                spec.graph = None  # backward re-runs (or replays)
            if spec.graph is not None:
                douts = release_outputs(douts)
            diff, other = iter(douts), iter(aux)
            outs = tuple(next(diff) if d else next(other) for d in mask)
            del douts, aux, diff, other
            n = len(outs) - len(refs)
            # A candidate held by nothing but Python is a side output.  One that
            # autograd also holds (``_use_count() > 1``) may only be saved by
            # another side output's history (it dies with that history, after
            # the swap); one still alive then was missed: see connect_side_outputs.
            alive = [r() for r in refs]
            side = [k for k, t in enumerate(alive) if t is not None and use_count(t) == 1]
            spec.unsure = [refs[k] for k, t in enumerate(alive) if t is not None and k not in side]
            del refs  # a tensor with weak references cannot be swapped
            spec.escaped = [alive[k] for k in side]  # the caller's objects, swapped after apply
            # (held: a re-run that reads one reads its own value instead, see CaptureMode)
            spec.side_objs = [(alive[k], pos[k]) for k in side]
            spec.escapes = {}
            for k in side:
                c, i = pos[k]
                spec.escapes.setdefault(c, []).append(i)
            # (the caller's object itself, or a wrapper holding it of a transform the function entered: takes an alias's content)
            outs = outs[:n] + tuple(detached_alias(outs[n + k]) if outs[n + k] is alive[k] or is_wrapped(alive[k]) else outs[n + k] for k in side)
            del alive
            if frame is not None:  # each output's position among the level's differentiated outputs
                at = [sum(mask[:i]) if d else None for i, d in enumerate(mask)]
                spec.dpos = at[:n] + [at[n + k] for k in side]
            spec.n_out = n
            if spec.out_values is not None:
                spec.out_values = spec.out_values[:n] + [spec.out_values[n + k] for k in side]
                spec.layers = spec.layers and (spec.layers[0], spec.layers[1][:n] + [spec.layers[1][n + k] for k in side])
            mask = mask[:n] + [mask[n + k] for k in side]
            if spec.fwd_diff:
                spec.fwd_diff = spec.fwd_diff[:n] + [spec.fwd_diff[n + k] for k in side]
            spec.plain_bytes = sum(saved.values())
            rec = spec.rec
            if keep and spec.replay:  # (the function calls torch.func: backward replays the whole recorded forward)
                plan_rerun(spec, roots, tensors)
                spec.plan = None  # (no hook told what autograd saved: a run again, where no replay serves, runs whole)
            elif keep:
                # the function calls torch.func (which refuses hooks): what autograd
                # saved is only known by storage; keep those values, and the
                # region's outputs (alive anyway), and recompute the whole region
                keep_ptrs = set(saved) | {p for o in outs if (p := storage_ptr(o)) is not None}
                rec.prune(keep_ptrs, set(saved))  # an offloaded output: recomputed, not copied
                spec.tape = None
            elif frame is not None:  # as on the hooks path (memory_budget's plan, seal, ...)
                spec.wrt = wrt
                if spec.offload is not None:
                    spec.offload.hints = rec.hint_outputs(outs)
                full = [*(v for v in spec.out_values or () if type(v) is Value), *tape.out_writes]
                finish_tape(frame, tensors, outs, None, full=tape.plan_steps(full)[0])
            else:
                plan_rerun(spec, roots, tensors)
            if isinstance(rec.policy, Measuring) and frame is None:  # memory_budget's first call
                rec.policy.finish(saved, spec.tape, roots)
        else:
            mask = None
            # (an enclosing forward records this call: an output aliasing an input that the inputs reach
            # only through detach is rebuilt detached, so that tape sees no tangent reach it, see rebuild)
            tape = spec.tape if nested_in_forward() else None
            spec.tape = spec.frame = None  # nothing will be differentiated
            with saving(spec.rec, recompute=False, tape=tape), torch.set_grad_enabled(spec.grad_mode):
                outs, rebuild = spec.call(tensors, known)
            if tape is not None:
                ptrs = {storage_ptr(t) for t in tensors} - {None}
                reach = forward_reached(tape, outs, {id(unwrap_all(t)) for t in tensors})
                mask = [differentiable(o) and (r or storage_ptr(o) not in ptrs) for o, r in zip(outs, reach)]
            # (what it stored, made under no_grad, which an enclosing forward under forward mode watches:
            # that region sees this call make it, see note_region_outputs)
            spec.escaped = [t for _, t in spec.escaped] if tape is not None else []
            spec.n_out = len(outs)
        spec.diff = [differentiable(o) for o in outs] if mask is None else mask
        if spec.rec is not None and spec.frame is None:
            if spec.offload is not None:
                spec.offload.hints = spec.rec.hint_outputs(outs)
            spec.rec.producer = {}
            spec.rec.seal(outs)
        spec.views = alias_map(outs, tensors, spec.diff, own)
        outs = returned(outs, tensors)
        if any(spec.widen):  # (torch's generated vmap rule: see remat_fn._func_graph)
            outs = batched_outputs(outs, tensors, spec.diff, spec.widen, spec.views)
        spec.out_box.append(rebuild)
        spec.out_meta = [out_meta(o) for o in outs]
        return outs

    @staticmethod
    def setup_context(ctx, inputs, output):
        spec = inputs[0]
        ctx.spec, ctx.level = spec, current_level()  # (the level functorch applies it at: see outside_innermost)
        if spec.offload is not None:  # offloaded inputs are kept as copies (None saved here)
            ctx.save_for_backward(*spec.offload.save(inputs[1:], output, spec.rec and spec.rec.offloader))
        else:
            ctx.save_for_backward(*inputs[1:])
        # (the tensors it closes over: an enclosing region's forward must not take them for side outputs;
        # its arguments are checked there as any tensor, remat holding no Python reference to them)
        note_region_inputs(inputs[1 + spec.n_in:], spec)
        ctx.save_for_forward(*inputs[1:])
        fwd_diff = spec.fwd_diff if spec.fwd and spec.fwd_diff else spec.diff  # (forward mode: what no_grad made too)
        nd = [o for o, d in zip(output, fwd_diff) if not d]
        if nd:
            ctx.mark_non_differentiable(*nd)
        ctx.out_diff = spec.diff
        ctx.fwd_diff = fwd_diff
        # Outputs nobody differentiates arrive as None: see backward.
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *grads):
        spec: RegionState = ctx.spec
        if not any(g is not None and d for g, d in zip(grads, ctx.out_diff)):
            # no gradient flows in (an output only forward mode differentiates, see fwd_diff, takes none:
            # called under no_grad, functorch's custom_function_call re-enables grad below the innermost
            # level, where the region's ops would be constants)
            return (None,) * len(ctx.needs_input_grad)
        tensors = saved_inputs(ctx, spec)
        wrt = [i for i, t in enumerate(tensors) if ctx.needs_input_grad[i + 1] and differentiable(t)]
        result: list[Any] = [None] * (len(tensors) + 1)
        if not wrt:
            return tuple(result)
        out_diff = ctx.out_diff
        unread = spec.unread if spec.unread is not None and not _foreign(spec) else None
        saved = ctx.saved_tensors if unread is None else [t for t, u in zip(ctx.saved_tensors, unread) if not u]
        clear, saved_tracked, cots_tracked, grads, tensors = outside_reach(saved, grads, tensors)
        detach = clear and not saved_tracked and not cots_tracked  # (nothing outside differentiates this backward)
        grads = tuple(unwrap_if_dead(g) if g is not None else None for g in grads)
        if spec.check and (spec.graph is not None or _replayable(spec)):  # (strict checks: debug, early_stop=False)
            check_again(spec, tensors, wrt, out_diff, detach, cotangents(spec, grads, out_diff))
        # (grad mode off: nothing records this backward; a forward-mode level would, see from_graph)
        quiet = (detach or not torch.is_grad_enabled()) and not forward_mode_active()
        outer = _foreign(spec) and spec.foreign is True and outside_innermost(spec.levels, ctx.level)  # (.data, detach_, a hook:
        graph = spec.graph is not None and (not spec.batched or grad_on_top()) and not outer  # the run again, see recompute_fn)
        if quiet and graph:  # (batched saved tensors: see rebatch)
            return from_graph(spec, tensors, wrt, grads)
        if clear and not saved_tracked and graph:
            return from_graph(spec, tensors, wrt, grads, linear=True)  # (eager autograd reaches the cotangents alone)
        cot = cotangents(spec, grads, out_diff)
        start = time.perf_counter()
        # The recorded forward, replayed (where an outer transform differentiates this backward, for a nested
        # region, under vmap): the regions nested in it replay as regions of their own
        gin = None
        # (under vmap(grad), a backward whose grad level has exited, under vmaps alone (a vjp_fn called
        # under a vmap, jacrev's over the cotangents): the batched replay, as under grad(vmap))
        vmaps_alone = spec.layers is not None and all(is_vmap_kind(k) for k in live_levels().values())
        # (the batched replay below every level: under vmap(grad) where eager autograd alone may differentiate
        # the backward, which it records as it records plain code's batched ops; or where nothing does and no
        # forward level's graph was kept: a region calling torch.func, or nested in another)
        below = spec.layers is not None and (clear if not quiet else spec.graph is None)
        if _replayable(spec, spec.layers is not None and (vmaps_alone or below or not vmaps_outermost(spec.levels))):
            try:
                with torch.no_grad() if detach else _NULL:
                    if spec.batched:  # (nothing differentiates this backward: grad mode off says so under vmaps alone)
                        alone = detach or below or (not torch.is_grad_enabled() and vmaps_alone)
                        # (a grad level's backward keeps the examples of a vmap outside it apart; eager autograd's,
                        # through the rule's vmap, sums them: its saved tensors carry no grad wrapper)
                        own = any(grad_wrappers(t)[0] for t in ctx.saved_tensors if isinstance(t, torch.Tensor))
                        vjp_fn = functools.partial(replay_vjp, spec, tensors, wrt=wrt, out_diff=out_diff, region=_run_span,
                                                   quiet=alone, apart=own)
                    else:
                        vjp_fn = torch.func.vjp(replay_fn(spec, tensors, wrt, out_diff, _run_span), *[tensors[i] for i in wrt])[1]
                    if spec.prof is not None:
                        spec.prof.record_recompute(spec.name, time.perf_counter() - start)
                    gin = vjp_fn(cot)
            except CannotReplay:
                spec.out_values = None  # (the function runs again, now and from now on)
        # (an input the replayed ops never read in grad mode gets None, as from plain autograd; a run
        # again's gradient as it comes: what the function did out of the tape's sight counts there)
        unused = spec.unused if gin is not None else None
        if gin is None:
            gin = rerun_vjp(spec, tensors, wrt, out_diff, detach, cot, start, outer=outer)
        # (an input no op of the forward read: None, as plain autograd leaves it; a run again's ops, checked, read none either)
        for i, g in zip(wrt, gin):
            result[i + 1] = None if (unused is not None and unused[i]) or (unread is not None and unread[i]) else g
        return tuple(result)

    @staticmethod
    def jvp(ctx, _spec_tangent, *tangents):
        spec: RegionState = ctx.spec
        tensors = saved_inputs(ctx, spec)
        wrt = [i for i, (t, tt) in enumerate(zip(tensors, tangents)) if tt is not None and differentiable(t)]
        out_diff = ctx.fwd_diff
        if not any(out_diff):  # no output depends on the inputs differentiably
            return (None,) * len(out_diff)
        touts = None
        if _replayable(spec, spec.layers is not None):  # tangents pushed through the recorded forward
            try:
                touts = replay_jvp(spec, tensors, tangents, wrt, out_diff, _run_span)
            except CannotReplay:
                spec.out_values = None
        if touts is None:  # (inside apply: the caller's objects get views of the side outputs, see connect_side_outputs)
            f = recompute_fn(spec, tensors, wrt, out_diff, spec.rerun_objs, under_jvp=True)
            if spec.rng is not None and spec.tape is not None:  # (inside apply, before RNGSnapshot.finish)
                spec.rng.note_draws(spec.tape)
            with spec.rng or _NULL, spec.autocast:  # forward mode: recompute everything
                _, touts = torch.func.jvp(f, tuple(tensors[i] for i in wrt), tuple(tangents[i] for i in wrt))
        it = iter(touts)
        return tuple(next(it) if d else None for d in out_diff)


# Function.apply binds its arguments with inspect.signature(forward) on every
# call; a precomputed signature makes that lookup free.
_RematFunction.forward.__signature__ = inspect.signature(_RematFunction.forward)  # type: ignore[attr-defined]


def _replayable(spec: RegionState, batched: bool = False) -> bool:
    """The recorded forward can stand in for the function (see remat_fn._replay_live); ``batched``:
    on the batched tensors below the vmaps, as the tape holds them (the jvp rule)."""
    if spec.out_values is None or (spec.batched and not batched):
        return False
    if batched and spec.tape is not None and spec.tape.functions:  # (a custom Function's rules and context see the
        return False  # logical tensors, not the batched ones below the vmaps a batched replay runs on)
    if spec.tape is not None and not all(spec.tape.functions.values()):  # (a custom Function no step stands for)
        return False
    return not _foreign(spec)


def _foreign(spec: RegionState) -> bool:
    """The region's graph holds what the tape cannot stand for (a custom Function no step stands
    for, ``.data``, a hook, autograd called inside: see CaptureMode), found once."""
    if spec.foreign is None:
        spec.foreign = foreign_functions(spec.roots, _RematFunction, spec.tape and spec.tape.functions)
        spec.roots = []
    return bool(spec.foreign)


def _run_span(fun, name: str, opts, args: tuple):
    """A region nested in a replayed one, run as a region of its own (see remat_fn._replay_live, LogicalTape.region)."""
    with entered():  # (one region deeper, as remat's call enters it: its Function is no op of the enclosing one's)
        return run_torch_func(RegionCall(fun, name, opts.flat(), args, {}))  # (its tensors, flat: no static arguments)


def run_torch_func(call: RegionCall, calls_torch_func: bool = False):
    """Run the region as a custom ``autograd.Function`` (under ``torch.func``, or wherever saved-tensor hooks
    cannot be used); returns its output pytree.  ``calls_torch_func``: the function is known to call a
    ``torch.func`` transform itself (see :func:`keep_nothing`)."""
    deep_enough(region_depth())
    calls_torch_func = calls_torch_func or call.calls_torch_func
    given, expand = distinct_inputs(call.inputs)
    name, debug = call.name, call.debug
    reach = reachable_tensors(call.reach_roots())
    captured = reach.captured({id(t) for t in given}, substituted)
    # (a tensor an enclosing region closes over: as its ops see it; one left over from a transform
    # that has exited, as its ops see it: without the dead levels' wrappers, which the Function refuses)
    inputs = [unwrap_if_dead(t) for t in substituted(given)]
    separate = not forward_mode_active()  # (objects over one tensor below a transform's wrapper: see distinct_objects)
    if separate:
        inputs = distinct_objects(inputs, [])
    policy = call.policy("func", [*inputs, *captured])
    if type(policy) is Measuring:  # memory_budget's first call: activation inputs count
        policy.note_inputs(storage_ptr(t) for t in inputs if t.grad_fn is not None)
    devices = call.rng_devices(inputs)
    snap = RNGSnapshot(devices) if call.opts.preserve_rng_state else None
    # storages made inside the region (recorded on retries, and from the start where the function calls torch.func)
    produced = set() if calls_torch_func else None
    prof = AMBIENT.profiles[-1] if AMBIENT.profiles else None  # (remat_fn.profile(), innermost)
    start = time.perf_counter() if prof is not None else 0.0
    grad_mode = torch.is_grad_enabled()
    keep_graph = calls_torch_func
    top = top_hooks(False)
    nested = top is not None and isinstance(top[0], ForwardHook)
    levels = live_levels()  # (set aside inside the Function's forward: see needs_grad)
    relocate = False
    stale: list = []  # (what the tries that stopped made, see stale_side_outputs)
    for attempt in range(_MAX_RETRIES + 1):
        if attempt == _MAX_RETRIES:
            raise RematError(
                f"remat({name}): the forward kept reaching tensors that need a gradient but are "
                f"neither arguments nor tensors it closes over ({_MAX_RETRIES} retries; the last "
                f"was {describe(captured[-1])}). Fix: pass the tensors the function differentiates "
                "as explicit arguments."
            )
        spec = RegionState(call.run, len(inputs), captured, name, debug, reach, expand)
        spec.given_ids, spec.callers = [id(t) for t in inputs], given
        closed = [unwrap_if_dead(t) for t in substituted(captured)]  # (what the Function gets; the function reads ``captured``)
        if separate:
            closed = distinct_objects(closed, inputs)
        spec.produced, spec.keep_graph, spec.levels = produced, keep_graph, levels
        spec.relocate = relocate or keep_graph  # (see RegionState.call)
        spec.aliases = [(id(t), k) for k, t in enumerate(given) if id(t) in reach.tensors]
        spec.vmapped = any(is_vmap_kind(kind) for kind in levels.values())
        spec.rec = Record(policy)  # (without a policy: the op sequence, for the plan)
        if policy is not None:
            spec.offload = FuncInputs(input_offloads(policy, inputs))
            spec.offload.listen(spec.rec, inputs)  # (arguments checkpoint_name names inside the region)
        # (backward runs the function again: the function calls torch.func, offloads; and where no replay stands in, docs/design.md,
        # "still runs again".  Under vmap(grad), every vmap outside the other transforms, backward runs under the forward's vmap
        # levels, see remat_fn._func_graph.KeepHandles; under grad(vmap) it replays the batched ops below the vmaps, see replay_vjp)
        spec.batched = any(any_batched(t) for t in (*inputs, *closed))
        if spec.batched:
            spec.apart = apart_inputs(levels, (*inputs, *closed))
            # (its torch calls recorded, see remat_fn._logical: above_vmaps, apart inputs, or nested in a region recording its own)
            spec.logical = above_vmaps(levels, (*inputs, *closed)) or (spec.apart is not None and not all(spec.apart)) or None
        spec.logical = spec.logical or logical_around() or None
        spec.check = call.strict  # (a run again in backward checks the function; the gradient comes from the forward)
        rerun = (keep_graph and policy is not None) or (spec.offload is not None and spec.offload.rerun)
        if rerun or keep_graph or nested or (spec.batched and not vmaps_outermost(levels)):  # (nested: replays its recorded forward)
            spec.tape = Tape(func_path=True)
            spec.replay = not rerun
        else:  # backward differentiates the forward's graph, its saved tensors replayed
            frame = spec.frame = Frame(None, None, None, name, False)
            frame.rec, frame.deferred = spec.rec, True
            spec.frame.tape = spec.tape = Tape(func_path=spec.batched, copies=True)  # (batched: see draws_in_vmap below)
        spec.fwd = forward_mode_at(levels)  # (not stopped by no_grad: see forward_reached)
        # (and under no_grad, where the function may enable grad itself: its outputs tell, see mask)
        spec.needs = [needs_grad(t) and differentiable(t) for t in (*inputs, *closed)]
        spec.inner_wrapped, spec.inner_rg = grad_tops(both := (*inputs, *closed)), [t.requires_grad for t in both]  # (see recompute_fn)
        # (the inputs reverse mode differentiates: under forward mode the others, which only a jvp level wraps, stay out of the forward's
        # vjp level, see forward)
        if spec.fwd:
            spec.rev = [n and requires_grad_anywhere(t) for n, t in zip(spec.needs, (*inputs, *closed))]
        if spec.vmapped and any(spec.needs):
            spec.widen = differentiated_outside_vmaps(levels, any(unwrap_all(t).requires_grad for t in (*inputs, *closed)))
        spec.prof = prof
        spec.rng = snap  # (forward mode runs the Function's jvp inside apply: draws from before them)
        # (the enclosing regions' tapes, the call a span of each; under no_grad, plain code, none: its ops replay each in its grad mode)
        tapes = recording_tapes() if grad_mode else []
        starts = [len(t.nodes) for t in tapes]
        try:
            # (called under no_grad: applied with grad on, so an output the function makes under its own
            # enable_grad, or an input it returns, is differentiated as in plain code; the others are
            # marked non-differentiable, see mask; the function runs in the caller's grad mode)
            with torch.enable_grad() if not grad_mode and any(spec.needs) else _NULL:
                outs = _RematFunction.apply(spec, *inputs, *closed)
            for t, k in zip(tapes, starts):
                t.spans.append((k, len(t.nodes), call.opts, name))
        except NeedsGraph:
            undo_forward(spec, snap)
            stale += spec.aborted
            keep_graph = True
            # (its later calls keep the graph from the start; tensors torch.func's autograd makes are
            # recorded from this try on: no third try to find them)
            produced = set() if produced is None else produced
            call.note_torch_func()
            continue
        except MissedCapture as e:
            undo_forward(spec, snap)
            if e.plain is not None:  # (autograd inside reaches through the caller's graph between inputs: plain code, see _related;
                if e.plain != region_depth():  # an enclosing region's inputs so related: that region's call)
                    raise
                return call.fun(*call.args, **call.kwargs)
            stale += spec.aborted
            if e.bypassed:
                if relocate:  # pragma: no cover - defensive (the places held the replacements)
                    raise RematError(
                        f"remat({name}): the tensor {describe(e.tensor)} it closes over reached a torch.func "
                        "transform inside the region unthreaded. Fix: pass it to the function as an argument."
                    ) from None
                relocate = True
                continue
            if produced is None:
                # The tensor may have been made inside the region where no torch
                # function sees it (by autograd in a torch.func.grad the function
                # calls): run again, recording what the region's ops produce.
                produced = set()
                continue
            t = e.tensor
            if any(t is c for c in captured):  # pragma: no cover - defensive
                raise RematError(
                    f"remat({name}): the tensor {describe(t)} it closes over could not be threaded "
                    "through the torch.func path. Fix: pass it as an explicit argument."
                ) from None
            captured = [*captured, t]
            produced = set()
            continue
        break
    if spec.grad_left != grad_mode:  # (the function left grad mode set: the caller goes on in it, as in plain code)
        torch.set_grad_enabled(spec.grad_left)
    if stale:
        stale_side_outputs(spec, stale)
    spec.rng = snap if snap is not None and snap.finish(spec.tape) else None
    off = spec.offload
    # (the recomputation reads private copies of the buffers the forward wrote)
    kept = off.kept_inputs(inputs) if off is not None else inputs
    if refs_counted():  # (an enclosing forward's side-output check, or run again's stored inputs, counts Python references)
        kept = [version_alias(t) for t in kept]
        call.drop_tensors()  # (backward runs the function on the Function's saved inputs)
    reach.record_versions(kept, skip=spec.written)
    if prof is not None:
        kept = [*kept, *captured]  # (version aliases share the inputs' storages)
        if spec.rec is not None:
            kept += [t for _, _, t, kind, _ in spec.rec.kept() if kind == "saved"]
        prof.record_call(name, time.perf_counter() - start, storage_bytes(kept), spec.plain_bytes,
                         spec.rec.offloader.bytes_by_dst() if spec.rec.policy is not None else None)
    n = spec.n_out
    outs, side = list(outs[:n]), list(outs[n:])
    held = spec.escaped  # (the caller's objects: an enclosing region sees them made by this call too)
    if side or spec.held_inputs or spec.rerun_objs:
        connect_side_outputs(spec, side, inputs)
    # (the caller's objects holding side outputs, read by a run again of this call or of an enclosing one)
    late = spec.side_late()
    first = (late, spec.nested_side) if late or spec.nested_side else None
    if first is not None and not spec.check and _replayable(spec) and spec.tape is not None \
            and not any(nd is not None and nd.rng is not None for nd in spec.tape.nodes):
        spec.side_objs, spec.nested_side, spec.late_objs = [], {}, []  # (no run again of this call reads them)
    del side
    if spec.unsure:
        check_unsure(spec)
    if spec.views:
        rebuild(outs, spec.views, (*inputs, *closed), spec.diff, n, spec.fwd_diff)
    if off is not None:
        for o, h in zip(outs, off.hints):
            if h is not None:
                hint(o, h)  # the next region may offload it (see Record.hint_outputs)
        if off.stored:
            call.drop_tensors()  # the call must not keep the offloaded inputs alive
    note_region_outputs([*outs, *held], first, spec.foreign, ([given[k] for k in expand], n, spec.logical, call.opts, name, grad_mode, _run_span))
    del held, first, late
    result = spec.out_box[-1](outs)
    if any(spec.needs):
        check_lazy_outputs(spec, result)
    return result
