"""The saved-tensor-hooks adapter: a region under plain (eager) autograd.

The forward runs under saved-tensor hooks that pack through a :class:`remat_fn._frame.Frame`
(a handle per saved tensor, the forward recorded on a tape) and under the recording mode
(:mod:`remat_fn._record`); backward unpacks the handles, which replay the part of the tape
they need.  Where the region runs without a recorded forward (the strict checks,
``debug=True`` and ``early_stop=False``, and forward-mode AD) :class:`HookFrame` runs the
function again under ``torch.enable_grad()`` with hooks that capture the re-saved tensors by
position, stopping as soon as the last still-needed one is rebuilt (unless strict), and checks
them against the forward's.  A function that calls a ``torch.func`` transform (which refuses
these hooks) moves to the ``torch.func`` adapter (:class:`NeedsTorchFuncPath`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import optree
import torch
import torch.autograd.forward_ad as fwad
from torch.utils.hooks import RemovableHandle

from ._ambient import AMBIENT
from ._budget import Measuring
from ._closures import reachable_tensors
from ._debug import OpTrace, format_traces
from ._describe import describe_meta
from ._errors import MutatedSavedTensorError, RecomputeMismatchError, RematError, mutated_input
from ._frame import Frame, finish_record, finish_tape, input_hooks
from ._functorch import forward_mode_active, storage_ptr
from ._offload import input_offloads, named_inputs, unaliased
from ._ops import PLAIN, PrivateWrites
from ._profile import storage_bytes
from ._record import Record, paused, saving
from ._region import AutocastState, RegionCall, RNGSnapshot
from ._tape import Tape
from ._torch_internals import drop_hooks_since, forward_ad_level, hooks_enabled
from ._torch_internals import pop_hooks as _pop_hooks
from ._torch_internals import push_hooks as _push_hooks
from ._torch_internals import top_hooks as _top_hooks
from ._torch_internals import version as version_of

__all__ = ["run_with_hooks", "NeedsTorchFuncPath", "hooks_enabled"]

# False while saved-tensor hooks are switched off for the process (a failed
# torch.compile can leave them so); the torch.func path needs none.
_NULL = contextlib.nullcontext()


class _StopRecompute(Exception):
    pass


class NeedsTorchFuncPath(Exception):
    """Internal: the region calls a torch.func transform, which refuses saved-tensor
    hooks; the caller runs it on the torch.func path (which needs none).  ``tensors``:
    its inputs and what it closes over, whose hooks from handle id ``first_hook`` on
    the try registered."""

    def __init__(self, tensors=(), first_hook: int = 0):
        super().__init__()
        self.tensors, self.first_hook = tensors, first_hook


_HOOKS_REFUSED = "don't yet support saved tensor hooks"



def _duals(tree, tangents: list):
    """``tree``'s tensors made duals of the current dual level with ``tangents`` (one per leaf)."""
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
    leaves = [fwad.make_dual(x, t) if t is not None else x for x, t in zip(leaves, tangents)]
    return optree.tree_unflatten(spec, leaves)


class HookFrame(Frame):
    """The hooks path's frame: backward replays the recorded forward, or, where the region runs
    without one (the strict checks, ``debug=True`` and ``early_stop=False``, and forward-mode AD),
    runs the function again, its saved tensors captured by position and checked."""

    __slots__ = ("written", "dual", "own_dual")

    def __init__(self, fun, args, kwargs, name, debug):
        super().__init__(fun, args, kwargs, name, debug)
        # storages the forward wrote that it did not make -> their contents before (Tape.pre_write):
        # a run again reads and writes private copies of them, as on the torch.func path
        self.written: dict = {}
        # the forward ran under an eager dual level (torch.autograd.forward_ad): the arguments' tangents
        self.dual: list | None = None
        self.own_dual = False  # a run again under a dual level of its own (that one exited)

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
        self.timed(self._recompute, target, needed)

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
        self.own_dual = self.dual is not None and forward_ad_level() < 0  # (that level exited: one of its own)
        dual = fwad.dual_level() if self.own_dual else _NULL
        # Inside the forward the policy's record is incomplete: recompute
        # everything, and keep the forward's own policy mode out of it.
        rec = None if self.in_forward else self.rec
        relocated = self.reach.relocated() if self.reach is not None else _NULL
        _push_hooks(rpack, runpack)
        first_hook = RemovableHandle.next_id
        try:
            with dual, torch.enable_grad(), self.autocast, relocated, saving(rec, recompute=True), \
                    paused(self.rec if self.in_forward else None), \
                    PrivateWrites(self.written, {}) if self.written and not self.in_forward else _NULL:
                if rng is not None:
                    rng.__enter__()
                if dual is not _NULL:
                    args, kwargs = _duals((args, kwargs), self.dual)
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
            if RemovableHandle.next_id != first_hook:  # (the forward's hooks on its inputs and what it closes over fire in
                # backward: this run's twice, 3.7 to 2.5e8 off with debug=True until this; the forward's walk where it kept one)
                reach = self.reach if self.reach is not None else reachable_tensors(self.fun)
                for t in (*_input_tensors(args, kwargs)[1], *reach.tensors.values()):
                    drop_hooks_since(t, first_hook)
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
        if self.own_dual:
            raise RematError(
                f"remat({self.name}): the forward ran under forward-mode AD (torch.autograd.forward_ad."
                "dual_level) and backward runs after that dual_level exited: the run again in backward, "
                "under a dual level of its own with the arguments' tangents, did not save what the forward "
                f"saved ({what}; a tensor it closes over carrying a tangent has none there). Fix: pass such "
                "tensors as arguments, call backward inside the dual_level block, or use torch.func.jvp "
                "and torch.func.grad, which remat replays.")
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
    frame = HookFrame(fun, args, kwargs, name, debug)
    frame.strict = call.strict or debug
    prof = AMBIENT.profiles[-1] if AMBIENT.profiles else None  # (remat_fn.profile(), innermost)
    if prof is not None:
        frame.prof, frame.prof_saved, start = prof, [], time.perf_counter()
    outer = _top_hooks(False)
    frame.outer = outer
    leaves, tensors = _input_tensors(args, kwargs)
    frame.input_ids = {id(x) for x in tensors}
    fwd_mode = forward_mode_active()
    if forward_ad_level() >= 0:  # (the leaves as stash_inputs and _duals flatten them)
        frame.dual = [fwad.unpack_dual(x).tangent if isinstance(x, torch.Tensor) else None for x in leaves]
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
    first_hook = RemovableHandle.next_id  # (handles are numbered in order: the try's hooks are those from here on)
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
        undo.restore_rng()  # (the function's own generators too)
        undo.undo_writes()
        # (its hooks on the inputs and on what it closes over: the torch.func path's forward claims them, see claiming)
        raise NeedsTorchFuncPath([*tensors, *reachable_tensors(call.reach_roots()).tensors.values()], first_hook) from None
    finally:
        _pop_hooks()
        frame.in_forward = False
        frame.rng = None
        frame.recomputed.clear()
    if frame.tape is None:  # (a run again writes private copies of what the forward wrote: BatchNorm's statistics)
        frame.written = undo.pre_write
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
        store = input_hooks(outer, offl, frame.rec)
        if store is not None:  # (the inputs come back with the recomputation)
            frame.stash_inputs(store)
        if outer is not None:
            frame.reach.record_versions()
        else:
            frame.reach.record_versions([t for t in tensors if id(t) not in offl])
        if frame.rec is not None:
            # keep no more than plain autograd would (see Record.prune)
            frame.rec.prune(frame.saved_ptrs)
            finish_record(frame.rec, tensors, offl, out, outer)
    else:
        frame.rec = None  # nothing will be recomputed: keep nothing
        frame.tape = None
        frame.args = frame.kwargs = None
    frame.saved_ptrs = None
    if snap is not None and snap.finish(undo):
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
