"""The saved-tensor-hooks path: a region under plain (eager) autograd.

During the forward, every tensor autograd wants to save is replaced by a small
handle (:class:`_Handle`); nothing but the handle is kept.  The first time
backward unpacks a handle of a region, the region is run again under
``torch.enable_grad()`` with hooks that capture the re-saved tensors by
position, stopping as soon as the last still-needed one has been rebuilt
(early stop).  Each recomputed tensor is handed out once and dropped, so it is
freed as soon as backward has consumed it; a second backward through a
retained graph recomputes again.  Because the recomputation runs the real
function on the real (non-detached) inputs, tensors the function closes over,
``create_graph=True`` and higher-order derivatives need no special care.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import Any

import optree
import torch

from ._ambient import AMBIENT
from ._autocast import AutocastState
from ._budget import Measuring
from ._closures import reachable_tensors
from ._debug import OpTrace, format_traces
from ._describe import describe_meta
from ._errors import MutatedSavedTensorError, RecomputeMismatchError, RematError, mutated_input
from ._functorch import forward_mode_active, storage_ptr
from ._offload import hooks_for_inputs, input_offloads, named_inputs, report_inputs, requesting, unaliased
from ._ops import PLAIN
from ._profile import storage_bytes, timer
from ._record import Record, paused, saving
from ._region import RegionCall
from ._rng_state import RNGSnapshot
from ._tape import Tape
from ._torch_internals import hooks_enabled
from ._torch_internals import pop_hooks as _pop_hooks
from ._torch_internals import push_hooks as _push_hooks
from ._torch_internals import top_hooks as _top_hooks
from ._torch_internals import version as version_of

__all__ = ["run_with_hooks", "NeedsTorchFuncPath", "hooks_enabled", "Frame", "finish_tape"]

# False while saved-tensor hooks are switched off for the process (a failed
# torch.compile can leave them so); the torch.func path needs none.
_NULL = contextlib.nullcontext()


class _StopRecompute(Exception):
    pass


class NeedsTorchFuncPath(Exception):
    """Internal: the region calls a torch.func transform, which refuses saved-tensor
    hooks; the caller runs it on the torch.func path (which needs none)."""


_HOOKS_REFUSED = "don't yet support saved tensor hooks"


class _Handle:
    __slots__ = ("idx", "__weakref__")

    def __init__(self, idx: int):
        self.idx = idx


class _Direct:
    """A saved input kept as it is, with its version, checked like autograd does."""

    __slots__ = ("t", "version")

    def __init__(self, t: torch.Tensor):
        self.t = t
        self.version = version_of(t)

    def get(self, name: str) -> torch.Tensor:
        t = self.t
        if version_of(t) != self.version:
            raise MutatedSavedTensorError(
                f"The tensor {describe_meta(t.shape, t.dtype, t.device)} that remat({name}) saved for "
                f"backward (an argument, a parameter or a value the policy saves) was modified in "
                f"place after the forward "
                f"(version {self.version} -> {version_of(t)}). Fix: clone it before modifying it "
                "(x = x.clone()), or apply the in-place update (e.g. optimizer.step()) after "
                "the backward pass."
            )
        return t


def _DEAD():  # the weakref of a saved tensor that needs no recomputation
    return None


class Frame:
    """One forward call of one region."""

    __slots__ = (
        "fun", "args", "kwargs", "name", "rng", "meta", "handles", "recomputed",
        "debug", "fwd_trace", "reach", "stash", "rec", "autocast", "in_forward", "strict",
        "input_ids", "outer", "nhandles", "saved_ptrs", "inner_backward", "prof", "prof_saved",
        "offload_ids", "tape", "values", "run", "kept", "deps", "deferred", "consumed", "pos", "packed",
    )

    def __init__(self, fun, args, kwargs, name, debug):
        self.fun = fun
        self.args = args
        self.kwargs = kwargs
        self.name = name
        self.rng: RNGSnapshot | None = None
        self.meta: list[tuple] = []
        self.handles: list[weakref.ref] = []
        self.recomputed: dict[int, torch.Tensor] = {}
        self.debug = debug
        self.strict = debug  # run recomputations whole and check them completely
        self.fwd_trace: list[str] | None = None
        self.reach = None  # the tensors the function reaches (remat_fn._closures)
        # When saved-tensor hooks are already active (an enclosing remat region,
        # save_on_cpu, remat_fn.distributed), the region's tensor inputs are
        # stored through them instead of being held here: an enclosing region
        # can then drop and recompute them, save_on_cpu moves them, and so on.
        self.stash = None
        self.rec = None  # remat_fn._record.Record when a policy is in force
        self.autocast = None  # AutocastState re-entered by a re-run (not on the tape path)
        # True while the forward runs: a backward *inside* the region (the
        # function calls torch.autograd.grad) unpacks handles of a forward
        # that has not finished; those are recomputed one at a time.
        self.in_forward = True
        self.inner_backward = False  # set once a backward ran inside the forward
        self.prof = None  # the remat_fn.profile() active at forward, if any
        self.prof_saved: list | None = None  # (saved tensor, kept as is), while profiling
        self.input_ids: set[int] = set()  # ids of the region's tensor arguments
        self.outer = None  # the enclosing saved-tensor hooks, if any
        self.nhandles = 0  # saved tensors that need recomputation
        self.saved_ptrs: dict[int, int] = {}  # storages autograd saved -> bytes (see Record.prune)
        self.offload_ids: dict = {}  # id of an input -> the Offload its policy decided for it
        # The recorded forward (remat_fn._tape): backward replays it instead of
        # running the function again.  None with debug checks or forward-mode AD,
        # where the function itself runs again (and is checked).
        self.tape = None
        self.values: dict[int, Any] = {}  # handle index -> the tape Value it stands for
        # handle index -> the tape's length when autograd saved it: backward reads the value
        # as it was then (a later write reaches a copy, see Tape.replay)
        self.pos: dict[int, int] = {}
        # handle index -> the saved tensor's storage, until the forward ends (see settle_writes)
        self.packed: dict[int, int] | None = {}
        self.run: list[int] | None = None  # the nodes the forward's plan replays
        self.kept: set[int] = set()  # ids of the kept Values the plan reads
        self.deps: list = []  # writes (through views) into saved tensors after they were made
        # offloads copied after the forward (Record.retain), not as autograd saves them: the
        # torch.func path's forward level, whose hooks run inside a functorch transform
        self.deferred = False
        # handles unpacked in this backward pass (None: not tracked).  The torch.func path's
        # graph is differentiated with retain_graph=True, so used handles stay alive: a
        # replay rebuilds only the ones not unpacked yet (and the one asked for)
        self.consumed: set[int] | None = None

    def stash_inputs(self, hooks) -> None:
        pack, unpack = hooks
        leaves, spec = optree.tree_flatten((self.args, self.kwargs), none_is_leaf=True)
        packed = [(x.requires_grad, pack(x)) if isinstance(x, torch.Tensor) else (None, x) for x in leaves]
        self.stash = (packed, spec, unpack)
        self.args = self.kwargs = None

    def inputs(self):
        if self.stash is None:
            return self.args, self.kwargs
        packed, spec, unpack = self.stash
        leaves = []
        for rg, v in packed:
            if rg is not None:
                v = unpack(v)
                if rg and not v.requires_grad:  # a hook that stored a plain copy
                    v = v.detach().requires_grad_(True)
            leaves.append(v)
        return optree.tree_unflatten(spec, leaves)

    # -- forward -------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        if self.tape is None:  # (checked by a re-run; the replay runs the recorded ops)
            self.meta.append((t.shape, t.dtype, t.device, version_of(t)))
        packed = self._pack(t)
        if self.prof_saved is not None:
            self.prof_saved.append((t, type(packed) is _Direct))
        return packed

    def _pack(self, t: torch.Tensor) -> Any:
        rec = self.rec
        ptr = storage_ptr(t) if rec is not None else None
        if ptr is not None:  # (a tensor without a storage, e.g. sparse, is never kept)
            self.saved_ptrs[ptr] = nbytes = t.untyped_storage().nbytes()
            if type(rec.policy) is Measuring:  # memory_budget's first call
                rec.policy.note_saved(ptr, nbytes)
            if ptr in rec.pending and not self.deferred:  # a value its policy offloads: copy it now
                rec.commit(ptr)
            if self.outer is None and self.tape is None and ptr in rec.kept_ptrs:
                # the policy keeps it anyway: autograd holds it as is, so backward
                # needs no recomputation for it (and keeps no extra copy).  Without
                # its history: an op's output held by its own node through a hook
                # is a reference cycle (node -> packed -> tensor -> node) that
                # outlives a graph dropped without backward until gc runs.
                self.handles.append(_DEAD)
                return _Direct(t.detach() if t.grad_fn is not None else t)
        # On the tape path a kept value is a handle too: a later checkpoint_name may
        # still decide to recompute it, and the plan (after the forward) decides.
        tape = self.tape
        if tape is not None:
            v = tape.value_of(t)
            if v is None:
                if id(t) not in self.input_ids or (self.outer is None and id(t) not in self.offload_ids):
                    # from outside the region (a parameter, a buffer, a tensor it
                    # closes over) or an input: alive anyway, kept as autograd keeps it
                    self.handles.append(_DEAD)
                    return _Direct(t)
                v = tape.lookup(t)  # an input stored through hooks (see finish_tape)
            w = tape.write_before(t)
            if w is not None and w is not v:
                self.deps.append(w)
            h = _Handle(len(self.handles))
            self.values[h.idx] = v
            self.pos[h.idx] = len(tape.nodes)
            if self.packed is not None:
                self.packed[h.idx] = tape.key(t)
            self.handles.append(weakref.ref(h))
            self.nhandles += 1
            return h
        if self.outer is None and id(t) not in self.offload_ids and (
                id(t) in self.input_ids or (t.is_leaf and t.requires_grad)):
            # An input or a parameter is alive anyway: keep it as plain autograd
            # does, so a backward that needs only such tensors recomputes
            # nothing.  (Under enclosing hooks the region's inputs are stored
            # through them and come back with the recomputation, as before.)
            self.handles.append(_DEAD)
            return _Direct(t)
        h = _Handle(len(self.handles))
        self.handles.append(weakref.ref(h))
        self.nhandles += 1
        return h

    def unpack(self, h: Any) -> torch.Tensor:
        if type(h) is _Direct:
            return h.get(self.name)

        t = self.recomputed.pop(h.idx, None)
        if t is None:
            if self.in_forward:
                self.inner_backward = True
            if self.tape is not None:
                self.replay(h.idx if self.in_forward else None, h.idx)
            else:
                self.recompute(h.idx if self.in_forward else None)
            t = self.recomputed.pop(h.idx)
        if self.consumed is not None:
            self.consumed.add(h.idx)
        return t

    # -- backward from the tape ------------------------------------------------
    def replay(self, target: int | None, asked: int) -> None:
        """Rebuild every still-needed saved tensor (or ``target``, for a backward inside
        the forward) by replaying the part of the tape it depends on; ``asked``: the
        handle being unpacked."""
        if self.prof is not None:
            with timer() as tm:
                self._replay(target, asked)
            self.prof.record_recompute(self.name, tm.seconds)
        else:
            self._replay(target, asked)

    def _replay(self, target: int | None, asked: int) -> None:
        tape, rec, values = self.tape, self.rec, self.values
        if target is not None:  # inside the forward: nothing is final yet, recompute from outside
            live = [target]
            run, _, _ = tape.plan([values[target], *self.deps], lambda v: False)
            pos = {target: len(tape.nodes)}
        else:
            used = self.consumed or ()
            handles = self.handles
            live = [i for i in values if handles[i]() is not None and (i not in used or i == asked)]
            if len(live) == len(values):
                run = self.run
            else:
                kept = self.kept
                run, _, _ = tape.plan([*(values[i] for i in live), *self.deps], lambda v: id(v) in kept)
            pos = self.pos
        nodes = tape.nodes

        def kept_value(v):
            return rec.value(nodes[v.node].key, v.idx)

        targets = [(values[i], pos[i]) for i in live]
        if target is not None:
            tape.paused += 1
        try:
            with rec.replaying() if rec is not None and target is None else _NULL:
                got = tape.replay(run, targets, kept_value, self.name)
        finally:
            if target is not None:
                tape.paused -= 1
        for i, t in zip(live, got):
            self.recomputed[i] = t

    # -- backward ------------------------------------------------------------
    def recompute(self, target: int | None = None) -> None:
        """Rebuild every still-needed saved tensor (or only ``target``, for a
        backward that runs inside the forward) by running the region again."""
        if self.reach is not None:
            self.reach.check_versions(self.name)
        handles = self.handles
        recomputed = self.recomputed
        if target is not None:
            needed = [target]
        else:
            needed = [i for i, w in enumerate(handles) if i not in recomputed and w() is not None]
        if not needed:  # pragma: no cover - unpack only happens for live handles
            return
        if self.prof is not None:
            with timer() as tm:
                self._recompute(target, needed)
            self.prof.record_recompute(self.name, tm.seconds)
        else:
            self._recompute(target, needed)

    def _recompute(self, target, needed) -> None:
        handles = self.handles
        recomputed = self.recomputed
        last = needed[-1]
        early = target is not None or not self.strict
        # The recomputation's own graph is differentiated when a backward runs
        # inside the region, or when the backward that unpacks builds a graph
        # (create_graph=True: grad mode is on in the engine): then what it saves
        # must be kept; otherwise nothing is, so unneeded tensors are freed at once.
        inner = self.inner_backward or torch.is_grad_enabled()
        meta = self.meta
        counter = [0]
        arg_ids: set[int] | None = None

        def rpack(t: torch.Tensor):
            nonlocal arg_ids
            i = counter[0]
            counter[0] = i + 1
            if i >= len(meta):
                self._mismatch(f"more tensors were saved than the {len(meta)} of the forward")
            shape, dtype, device, version = meta[i]
            if t.shape != shape or t.dtype != dtype or t.device != device:
                self._mismatch(
                    f"saved tensor #{i} is {describe_meta(t.shape, t.dtype, t.device)} on recompute "
                    f"but was {describe_meta(shape, dtype, device)} in the forward"
                )
            if version_of(t) != version:
                if arg_ids is None:
                    arg_ids = {
                        id(x) for x in optree.tree_leaves((args, kwargs))
                        if isinstance(x, torch.Tensor)
                    }
                if id(t) in arg_ids:
                    # stored through enclosing hooks, an input comes back as a new
                    # tensor; those hooks (or the enclosing region) check it.
                    mutated = self.stash is None
                else:
                    mutated = True
                if mutated:
                    raise MutatedSavedTensorError(
                        f"A tensor {describe_meta(shape, dtype, device)} needed to recompute "
                        f"remat({self.name}) was modified in place after the forward (its version "
                        f"went from {version} to {version_of(t)}). Fix: clone it before modifying it "
                        "(x = x.clone()), or apply the in-place update after the backward pass."
                    )
            if (i == target if target is not None else handles[i]() is not None):
                recomputed[i] = t
            if i == last and early:
                raise _StopRecompute
            # (detached: a node holding its own output through the hook would be
            # a reference cycle that outlives the graph)
            return t.detach() if inner else None

        def runpack(t):
            if t is None:  # pragma: no cover - inner is set whenever this can happen
                raise RematError("internal: a tensor was unpacked during recomputation")
            return t

        trace = None
        rng = self.rng
        args, kwargs = self.inputs()
        # Inside the forward the policy's record is incomplete: recompute
        # everything, and keep the forward's own policy mode out of it.
        rec = None if self.in_forward else self.rec
        relocated = self.reach.relocated() if self.reach is not None else _NULL
        _push_hooks(rpack, runpack)
        try:
            with torch.enable_grad(), self.autocast, relocated, saving(rec, recompute=True), \
                    paused(self.rec if self.in_forward else None):
                if rng is not None:
                    rng.__enter__()
                try:
                    if self.debug:
                        with OpTrace() as trace:
                            self.fun(*args, **kwargs)
                    else:
                        self.fun(*args, **kwargs)
                except _StopRecompute:
                    pass
                finally:
                    if rng is not None:
                        rng.__exit__(None, None, None)
        finally:
            _pop_hooks()
        if counter[0] <= last or (not early and counter[0] != len(meta)):
            self._mismatch(
                f"{counter[0]} tensors were saved on recompute but the forward saved "
                f"{len(meta)}", trace,
            )
        if trace is not None and not early and self.fwd_trace is not None:
            # (detaches aside: autograd adds some under create_graph, which change no value)
            ops = [op.split()[0] for op in trace.ops if not op.startswith("aten.detach.")]
            if ops != [op.split()[0] for op in self.fwd_trace if not op.startswith("aten.detach.")]:
                self._mismatch("the recomputation ran a different sequence of ops", trace)

    def _mismatch(self, what: str, trace=None):
        msg = (
            f"Recomputing remat({self.name}) did not reproduce the forward: {what}. The region "
            "must run the same ops on tensors of the same shapes each time: make control flow "
            "depend only on its arguments and not on global state, and keep "
            "preserve_rng_state=True (or use remat_fn.random keys) for random ops."
        )
        if self.debug and self.fwd_trace is not None:
            msg += "\n" + format_traces(self.fwd_trace, trace.ops if trace is not None else None)
        elif not self.debug:
            msg += " Pass debug=True to see the op traces of both runs."
        raise RecomputeMismatchError(msg)


def run_with_hooks(call: RegionCall) -> Any:
    """Run the region so that its saved tensors are recomputed in backward.

    With ``call.strict`` recomputations run whole (no early stop) and must save
    exactly the forward's tensors (``call.debug`` also compares op traces)."""
    fun, args, kwargs, name, debug = call.fun, call.args, call.kwargs, call.name, call.debug
    preserve_rng_state = call.opts.preserve_rng_state
    frame = Frame(fun, args, kwargs, name, debug)
    frame.strict = call.strict or debug
    prof = AMBIENT.profiles[-1] if AMBIENT.profiles else None  # (remat_fn.profile(), innermost)
    if prof is not None:
        frame.prof, frame.prof_saved, start = prof, [], time.perf_counter()
    outer = _top_hooks(False)
    frame.outer = outer
    leaves, tensors = _input_tensors(args, kwargs)
    frame.input_ids = {id(x) for x in tensors}
    fwd_mode = forward_mode_active()
    if not frame.strict and not fwd_mode:
        # backward replays the recorded ops (random ones from the generator states
        # recorded with them): no snapshot of the whole region needed, and the tape
        # tells which inputs the region wrote
        frame.tape = undo = Tape(copies=True)
        snap = None
        in_versions = []
    else:
        in_versions = [(x, version_of(x)) for x in tensors]
        snap = RNGSnapshot(call.rng_devices(tensors)) if preserve_rng_state else None
        frame.autocast = AutocastState()
        undo = Tape(copies=True, replayed=False)  # (what the forward wrote into tensors from outside, see below)
    frame.rng = snap  # provisional: a backward inside the forward may recompute
    policy = call.policy("eager", tensors)
    if type(policy) is Measuring:  # memory_budget's first call: activation inputs count
        policy.note_inputs(storage_ptr(t) for t in tensors if t.grad_fn is not None)
    if policy is not None and not fwd_mode:
        frame.rec = Record(policy)
        frame.offload_ids = {id(tensors[i]): d for i, d in input_offloads(policy, tensors).items()}
        frame.rec.on_input = named_inputs(tensors, frame.offload_ids)  # (named inside the region)
    _push_hooks(frame.pack, frame.unpack)
    try:
        with saving(frame.rec, recompute=False, tape=undo):
            if debug:
                with OpTrace() as tr:
                    out = fun(*args, **kwargs)
                frame.fwd_trace = tr.ops
            else:
                out = fun(*args, **kwargs)
    except RuntimeError as e:
        if _HOOKS_REFUSED not in str(e):
            raise
        # The function runs a torch.func transform, which refuses saved-tensor
        # hooks: the caller reruns the region on the hook-free path, from the
        # generator states and buffers (BatchNorm's statistics) before this try.
        if snap is not None:
            snap.restore_now()
        else:
            undo.restore_rng()
        undo.undo_writes()
        raise NeedsTorchFuncPath() from None
    finally:
        _pop_hooks()
        frame.in_forward = False
        frame.rng = None
        frame.recomputed.clear()
    undo.written_storages, undo.pre_write = [], {}  # (only a try that failed puts them back)
    if frame.rec is not None:
        frame.rec.hint_outputs(optree.tree_leaves(out))
    if frame.nhandles and frame.tape is not None:
        # (an input the region wrote in place needs no refusal: the replay reads the
        # copy taken before the write and writes into copies)
        finish_tape(frame, tensors, out, outer)
    elif frame.nhandles:
        for x, v in in_versions:
            if version_of(x) != v:
                raise mutated_input(name, x)
        # Remember where the tensors the function reaches live, so that the
        # recomputation sees the same ones even if (as with
        # torch.func.functional_call) they are swapped back before backward.
        others = [x for x in leaves if not isinstance(x, torch.Tensor)]
        frame.reach = reachable_tensors((fun, others) if others else fun)
        offl = frame.offload_ids = unaliased(frame.offload_ids, tensors, out) if frame.offload_ids else {}
        store = _input_hooks(outer, offl, frame.rec)
        if store is not None:  # (the inputs come back with the recomputation)
            frame.stash_inputs(store)
        if outer is not None:
            frame.reach.record_versions()
        else:
            frame.reach.record_versions([t for t in tensors if id(t) not in offl])
        if frame.rec is not None:
            # keep no more than plain autograd would (see Record.prune)
            frame.rec.prune(frame.saved_ptrs)
            _finish_record(frame.rec, tensors, offl, out, outer)
    else:
        frame.rec = None  # nothing will be recomputed: keep nothing
        frame.tape = None
        frame.args = frame.kwargs = None
    frame.saved_ptrs = None
    if snap is not None and snap.finish():
        frame.rng = snap
    if prof is not None:
        _report(frame, prof, start, tensors)
    return out


def _input_tensors(args: tuple, kwargs: dict) -> tuple:
    """(the leaves of ``(args, kwargs)``, the tensors among them); without the pytree
    walk when the arguments are plain tensors (most calls)."""
    if not kwargs:
        for x in args:
            if type(x) not in PLAIN:
                break
        else:
            return args, list(args)
    leaves = optree.tree_leaves((args, kwargs), none_is_leaf=True)
    return leaves, [x for x in leaves if isinstance(x, torch.Tensor)]


def finish_tape(frame: Frame, tensors, out, outer, full=None) -> None:
    """After the forward: plan the replay from what autograd saved (JAX's rule: keep the
    saveable values that backward or the replay reads, recompute the rest) and
    let go of everything else.  ``full``: Values of the region's outputs: also keep what a
    replay computing them from the inputs needs (see remat_fn._replay_live)."""
    tape, rec = frame.tape, frame.rec
    settle_writes(frame, tape)
    # (a saved tensor whose graph node is gone, a dead branch's, needs nothing)
    handles = frame.handles
    roots = [*(v for i, v in frame.values.items() if handles[i]() is not None), *frame.deps]
    run, used_kept, used_outside = tape.plan_kept(roots, rec)
    every = None
    if full is not None:
        every = tape.plan([*roots, *full], lambda v: False)
        used_outside = used_outside | every[2]
    frame.run = run
    frame.kept = {id(v) for v in used_kept}
    offl = frame.offload_ids = unaliased(frame.offload_ids, tensors, out) if frame.offload_ids else {}
    store = _input_hooks(outer, offl, rec)
    if store is not None:
        by_id: dict[int, list] = {}
        for v in used_outside:
            by_id.setdefault(id(v.t), []).append(v)
        for x in tensors:  # in argument order
            if outer is not None or id(x) in offl:
                for v in by_id.pop(id(x), ()):
                    v.store = (store[0](v.t), store[1])
                    v.t = None
    if rec is not None:
        _finish_record(rec, tensors, offl, out, outer, tape, roots)
    tape.release(used_outside)
    tape.keep_only(run, used_kept, every and every[:2])
    frame.fun = frame.args = frame.kwargs = None


def settle_writes(frame: Frame, tape: Tape) -> None:
    """After the forward: a saved tensor the region wrote after autograd saved it.  The op
    being dispatched when autograd saved it may write it (``rrelu_with_noise`` saves
    ``noise``, then fills it): backward reads the value after that write, as plain autograd
    does; the replay runs it into the saved value.  A later write (``h.mul_(2)`` after
    ``h.sin()`` saved ``h``) reaches a copy the replay takes before it: backward reads the
    value as saved, as plain autograd under
    ``torch.autograd.graph.allow_mutation_on_saved_tensors`` does (without it, it raises)."""
    packed, frame.packed = frame.packed, None
    for i, p in packed.items():
        hit = tape.first_write(p, frame.pos[i]) if p else None
        if hit is None or frame.handles[i]() is None:
            continue
        k, w = hit
        frame.pos[i] = k + 1
        frame.deps.append(w)


def _input_hooks(outer, offl, rec):
    """The hooks a region stores its inputs through, None to hold them as they are: the
    enclosing ones (an enclosing region recomputes them, remat_fn.distributed keeps a
    slice; asked to offload those the policy offloads), or the offloader's."""
    if outer is not None:
        return requesting(outer, offl, rec.offloader) if offl else outer
    return hooks_for_inputs(offl, rec.offloader) if offl else None


def _finish_record(rec: Record, tensors, offl, out, outer, tape=None, roots=()) -> None:
    """After the forward, on either recompute path: memory_budget's first call plans
    (on the tape when there is one), saved_residuals hears what is kept, and the kept
    values go through the enclosing hooks or are sealed against later writes."""
    rec.producer = {}
    if isinstance(rec.policy, Measuring):
        rec.policy.finish(tape=tape, roots=roots)
    sink = AMBIENT.residuals  # (remat_fn.saved_residuals collecting)
    if sink is not None:
        for key, _, t, kind, nm in rec.kept():
            sink.append((t, kind, nm, f"aten.{key[0].overloadpacket.__name__}"))
        report_inputs(sink, tensors, offl)
    if outer is not None and rec.entries:
        rec.stash_through(outer)  # the enclosing hooks check versions
    else:
        rec.seal(optree.tree_leaves(out))


def _report(frame: Frame, prof, start: float, inputs) -> None:
    """One call for remat_fn.profile(): time, bytes kept, bytes plain autograd keeps."""
    seconds = time.perf_counter() - start
    saved, frame.prof_saved = frame.prof_saved, None
    kept = [t for t, direct in saved if direct]  # what autograd holds as is (see Frame.pack)
    if frame.nhandles:  # the region may be recomputed: it holds its inputs (or their offloaded copies)
        kept += [x for x in inputs if id(x) not in frame.offload_ids]
    offloaded = None
    if frame.rec is not None:
        kept += [t for _, _, t, kind, _ in frame.rec.kept() if kind == "saved"]
        offloaded = frame.rec.offloader.bytes_by_dst()
    prof.record_call(frame.name, seconds, storage_bytes(kept), storage_bytes(t for t, _ in saved), offloaded)
