"""One forward call of one region, as both adapters record it (:class:`Frame`).

While the forward runs, every tensor autograd saves is replaced by a small handle
(:class:`_Handle`) standing for a Value of the recorded forward (:mod:`remat_fn._tape`);
nothing but the handle is kept.  After the forward, :func:`finish_tape` plans what a
replay needs (JAX's rule: keep the saveable values backward reads, recompute the rest)
and lets go of everything else.  The first time backward unpacks a handle, the part of
the tape the still-needed handles depend on is replayed (:meth:`Frame.replay`); each
rebuilt tensor is handed out once and dropped, so it is freed as soon as backward has
consumed it.  The saved-tensor hooks of plain autograd (:mod:`remat_fn._path_hooks`)
and the forward level's graph on the ``torch.func`` path (:mod:`remat_fn._func_graph`)
both pack and unpack through a Frame; neither adapter imports the other.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import optree
import torch

from ._ambient import AMBIENT
from ._budget import Measuring
from ._describe import describe_meta
from ._errors import MutatedSavedTensorError, RematError
from ._functorch import storage_ptr, unwrap_all
from ._offload import hooks_for_inputs, report_inputs, requesting, unaliased
from ._profile import timer
from ._record import Record
from ._region import RNGSnapshot
from ._tape import Tape
from ._torch_internals import version as version_of
from ._unseen import unseen_alias

__all__ = ["Frame", "finish_tape", "input_hooks", "finish_record", "plan_kept", "output_value"]

_NULL = contextlib.nullcontext()


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
        self.timed(self._replay, target, asked)

    def timed(self, rebuild, *args) -> None:
        """``rebuild(*args)``, its time reported to the active ``remat_fn.profile()``, if any."""
        if self.prof is None:
            rebuild(*args)
            return
        with timer() as tm:
            rebuild(*args)
        self.prof.record_recompute(self.name, tm.seconds)

    def _replay(self, target: int | None, asked: int) -> None:
        tape, rec, values = self.tape, self.rec, self.values
        if target is not None:  # inside the forward: nothing is final yet, recompute from outside
            live = [target]
            run, _, _ = tape.plan([values[target], *self.deps])
            pos = {target: len(tape.nodes)}
        else:
            used = self.consumed or ()
            handles = self.handles
            live = [i for i in values if handles[i]() is not None and (i not in used or i == asked)]
            if len(live) == len(values):
                run = self.run
            else:
                kept = self.kept
                run, _, _ = tape.plan([*(values[i] for i in live), *self.deps], kept)
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

    def recompute(self, target: int | None = None) -> None:
        """Rebuild the saved tensors of a frame without a recorded forward, by running the function
        again: the hooks path's strict checks and forward mode (remat_fn._path_hooks.HookFrame)."""
        raise RematError(f"internal: remat({self.name}) has no recorded forward to replay")


def plan_kept(tape, roots, rec: Record | None) -> tuple[list[int], set, set]:
    """``tape.plan`` with what the policy record ``rec`` keeps (None: nothing); lets go of every kept
    value the plan does not read (``rec.retain``: no dead copies).  Returns what ``tape.plan`` returns."""
    if rec is None:
        return tape.plan(roots)
    nodes = tape.nodes
    kept = {id(v) for n in nodes if n is not None and n.key is not None and n.key in rec.entries
            for v in n.values() if rec.has(n.key, v.idx)}
    run, used_kept, used_outside = tape.plan(roots, kept)
    rec.retain({(nodes[v.node].key, v.idx) for v in used_kept})
    # kept values an op writes into (h = x @ w; h += b): handed out as copies, or a second backward
    # would read the first one's writes (every op, not only the planned ones: a re-run of the
    # function under grad of grad runs them all)
    kept = {id(v) for v in used_kept}
    written = [w for n in nodes if n.writes for w in tape.written_values(n)]
    rec.overwritten = {nodes[b.node].key for b in tape.bases(written) if id(b) in kept}
    return run, used_kept, used_outside


def output_value(tape, t: torch.Tensor):
    """What the tape knows ``t`` (an output of the region) as: its Value, or the plain
    tensor itself where the region returned a tensor it did not make or read.  The last
    write into its storage (through another view of it: ``y[0].sin_()``) is noted in
    ``tape.out_writes``: a replay runs it too, though no op reads the output after it."""
    b = unwrap_all(t)
    if tape.reg is None:  # (released: nothing is known of it)
        return b
    w = tape.write_before(b)
    if w is not None:
        tape.out_writes.append(w)
    e = tape.reg.get(id(b))
    if e is not None:
        v, ref = e
        if (ref() if v.node >= 0 else ref) is b:
            return v
    a = unseen_alias(tape, b)
    return b if a is None else a


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
    run, used_kept, used_outside = plan_kept(tape, roots, rec)
    every = None
    if full is not None:
        every = tape.plan([*roots, *full])
        used_outside = used_outside | every[2]
    frame.run = run
    frame.kept = {id(v) for v in used_kept}
    offl = frame.offload_ids = unaliased(frame.offload_ids, tensors, out) if frame.offload_ids else {}
    store = input_hooks(outer, offl, rec)
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
        finish_record(rec, tensors, offl, out, outer, tape, roots)
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


def input_hooks(outer, offl, rec):
    """The hooks a region stores its inputs through, None to hold them as they are: the
    enclosing ones (an enclosing region recomputes them, remat_fn.distributed keeps a
    slice; asked to offload those the policy offloads), or the offloader's."""
    if outer is not None:
        return requesting(outer, offl, rec.offloader) if offl else outer
    return hooks_for_inputs(offl, rec.offloader) if offl else None


def finish_record(rec: Record, tensors, offl, out, outer, tape=None, roots=()) -> None:
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


