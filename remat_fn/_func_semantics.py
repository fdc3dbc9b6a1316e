"""What makes the ``torch.func`` path look like plain code to the function and its caller.

The path runs a region as a custom ``autograd.Function`` (see
:mod:`remat_fn._path_torch_func`); torch runs such a forward below every grad
level, with grad mode off and the inputs unwrapped.  The pieces here give the
function and its caller what plain code would:

* :func:`keep_nothing`: the forward runs under a ``vjp`` level (so requires_grad,
  grad mode and which outputs are differentiable are the plain ones) whose
  graph keeps nothing: saved-tensor hooks that drop what autograd would save.
* :func:`connect_side_outputs`: tensors made inside that left the region by a
  side channel (a list, a module attribute, a forward hook's collection) are
  outputs of the Function; the caller's objects take their content.
* :func:`check_lazy_outputs`: closures and generators among the outputs would
  compute later on untracked tensors: refused.
* :func:`random_in_vmap`: a recomputation drawing random numbers inside a vmap
  that forbids it: a clear error.
* :func:`distinct_inputs`: a tensor passed twice is one input of the Function, so
  the function sees ``a is b`` as plain code does.
* :class:`RegionState`: one call's state on the path, and the function run under
  the :class:`~remat_fn._captures.CaptureMode` that threads what it closes over
  (in the forward, and in a re-run, which reads its own side outputs).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import sys
import types
import weakref
from collections.abc import Iterator

import optree
import torch

from ._captures import CaptureMode, Known, first_run_of_nested, innermost_kind, swap_side_output, swap_view_of, watched
from ._closures import Reachable, reachable_tensors
from ._debug import CallTrace
from ._describe import describe
from ._errors import MutatedSavedTensorError, RecomputeMismatchError, RematError, mutated_outside
from ._frame import plan_kept
from ._functorch import (
    as_given,
    carries_grad,
    differentiable,
    draws_batched,
    is_wrapped,
    needs_grad,
    requires_grad_anywhere,
    storage_ptr,
    unwrap_all,
    unwrap_if_dead,
    wrap_at_top,
)
from ._logical import LogicalTape
from ._offload import FuncInputs
from ._ops import PrivateWrites, private_copies
from ._region import AutocastState, RNGSnapshot
from ._tape import Tape, Value
from ._torch_internals import disable_hooks as _disable_hooks
from ._torch_internals import enable_hooks as _enable_hooks
from ._torch_internals import hooks_disabled_message as _hooks_off_message
from ._torch_internals import hooks_enabled as _hooks_on
from ._torch_internals import pop_hooks as _pop_hooks
from ._torch_internals import push_hooks as _push_hooks
from ._torch_internals import top_hooks as _top_hooks
from ._torch_internals import use_count
from ._torch_internals import version as version_of

__all__ = ["RegionState", "ForwardHook", "NeedsGraph", "keep_nothing", "hooks_aside", "random_in_vmap", "draws_in_vmap",
           "connect_side_outputs", "check_unsure", "stale_side_outputs",
           "check_lazy_outputs", "distinct_inputs", "out_meta", "saved_inputs",
           "replace_at", "undo_forward", "plan_rerun", "deep_enough", "primal_under_vjp", "cotangents"]

_NULL = contextlib.nullcontext()


class NeedsGraph(Exception):
    """Internal: the function calls a torch.func transform, which refuses the
    saved-tensor hooks of :func:`keep_nothing`; the forward runs again without."""


class ForwardHook:
    """Base of the pack hooks :func:`keep_nothing` pushes for the forward's vjp level
    (a nested region steps them aside, see :func:`hooks_aside`)."""

    __slots__ = ()


class _Discard(ForwardHook):
    """The pack hook of :func:`keep_nothing`: keeps nothing, tells ``note`` (if any)
    what autograd would have saved."""

    __slots__ = ("note",)

    def __init__(self, note=None):
        self.note = note

    def __call__(self, t):
        if self.note is not None:
            self.note(t)
        return None


class _Differentiated(Exception):
    """The function differentiated inside the region (``torch.autograd.grad``) through the
    forward's level, whose saved tensors :func:`keep_nothing` dropped: it runs again keeping them."""


def _never(_p):
    raise _Differentiated()


@contextlib.contextmanager
def keep_nothing(name: str, note=None, hooks=None):
    """Saved-tensor hooks that keep nothing, for the forward's vjp level (or ``hooks``,
    a :class:`ForwardHook` pack hook and its unpack, that keep handles).

    That level only tells what plain code would see (requires_grad, grad mode,
    side outputs); it is never differentiated, so what autograd would save
    there is dropped at once and the forward keeps no more memory than a
    forward without grad.  torch switches saved-tensor hooks off under its
    grad levels; they are switched on for the region's own ops only.  A
    ``torch.func`` transform the function calls refuses them (``NeedsGraph``:
    the forward runs again without); a region nested in this one steps them
    aside while it enters its own level (:func:`hooks_aside`).
    """
    was = _hooks_on()
    msg = _hooks_off_message() if not was else None
    if not was:
        _enable_hooks()
    _push_hooks(*(hooks or (_Discard(note), _never)))
    refused = False
    try:
        yield
    except _Differentiated:
        refused = True
    except RuntimeError as e:
        if "don't yet support saved tensor hooks" not in str(e):
            raise
        # raised below, outside this handler: no __context__ holding the traceback (its frames would keep the forward's tensors alive)
        refused = True
    finally:
        _pop_hooks()
        if not was:
            _disable_hooks(msg)
    if refused:
        raise NeedsGraph()


@contextlib.contextmanager
def hooks_aside():
    """Step an enclosing region's :func:`keep_nothing` hooks aside (a nested
    region enters its own ``torch.func`` level, which refuses hooks)."""
    top = _top_hooks(False)
    if top is None or not isinstance(top[0], ForwardHook):
        yield
        return
    _pop_hooks()
    try:
        yield
    finally:
        _push_hooks(*top)


@contextlib.contextmanager
def random_in_vmap(name: str):
    """A recomputation that draws from the global generator inside a ``vmap``
    whose randomness mode is "error" (``jacrev``, a vmapped ``vjp_fn``): the
    plain function drew in the forward, outside the vmap; say what to do."""
    try:
        yield
    except RuntimeError as e:
        if "randomness error mode" not in str(e):
            raise
        raise RematError(
            f"remat({name}) draws random numbers from a torch generator (the global one or its own) and its "
            "recomputation runs inside a vmap whose randomness mode is 'error' (jacrev, or a "
            "vmapped vjp_fn), where torch forbids such draws. Fix: draw with explicit keys "
            "(remat_fn.random.dropout(key, x, p), remat_fn.random.normal(key, ...)), which "
            "recompute without any generator, or use jacfwd(..., randomness='same'/'different')."
        ) from None


def draws_in_vmap(spec, tape, batched: bool = False) -> bool:
    """A random op drew inside a ``vmap`` around the region (asked in the forward): the
    tape may hold batched draws, which no replay hands to backward's vmap.  Under
    ``randomness='different'`` they are batched even where no input of the region is
    (``w * torch.rand(4)``, ``w`` not vmapped), and the forward level's graph cannot serve
    either: its saved tensors come back from the tape below every transform, the batch
    dimension a plain one, so ``cot * rand`` mixed every example's draw into each example's
    gradient.  There backward re-runs the function, each draw from its recorded state
    (inside ``jacrev``'s vmap, whose randomness mode is "error", that is refused with a
    RematError naming the fix: see random_in_vmap).  ``batched``: only where they are batched.
    Asked where backward would differentiate the forward level's graph and no input is batched
    (with one batched, the graph's saved draws come back batched as they were saved, see
    KeepHandles); where it replays the batched ops below the vmaps (``grad(vmap)``, the jvp rule),
    the draws replay there from their recorded states, as the physical tensors they were."""
    return spec.vmapped and any(n.rng is not None for n in tape.nodes) and (not batched or draws_batched())


def connect_side_outputs(spec, side: list, inputs) -> None:
    """Make the tensors that left the forward by a side channel the Function's
    outputs, in place: the caller's objects (in a list, an attribute, a hook's
    collection) take the content of the outputs, so their gradient flows; the
    forward's side tensors (now in ``side``) die, with their history.

    Then an input the function stored (see RegionState.call) takes a view of the caller's tensor,
    and what a run again in the jvp rule left where a side output was (``rerun_objs``) a view of
    that side output.  One that cannot take it (a weak reference, or autograd holds it too) stays
    as it is: refused if a gradient or tangent would pass through it."""
    held, spec.escaped = spec.escaped, []
    for t, o in zip(held, side):
        try:
            swap_side_output(t, o)
        except RuntimeError as e:
            raise side_output_error(spec, t, str(e)) from None
    t = o = None
    side.clear()  # (their history held the inputs the function stored)
    stored, spec.held_inputs = spec.held_inputs, []
    again, spec.rerun_objs = spec.rerun_objs, []
    # (an input the Function's forward sees as the caller's very object: stored as plain code stores it)
    for t, x, needs, counted in [*((t, inputs[k], spec.needs[k], c) for k, t, c in stored if t is not inputs[k]),
                                 *((t, o, True, True) for t, o in zip(again, held))]:
        if use_count(t) == 1 and not weakref.getweakrefcount(t):
            swap_view_of(t, x, counted)
        elif needs:
            why = "autograd holds it too" if use_count(t) > 1 else "a weak reference to it exists"
            raise RematError(
                f"remat({spec.name}): the function stored the tensor {describe(t)} it was given (in a list, "
                f"an attribute or a hook's record) and it cannot be connected to the gradient under torch.func "
                f"({why}). Fix: store a copy (x.clone()) or return the tensor from the function.")


def stale_side_outputs(spec, refs) -> None:
    """Refuse a tensor that a try of the forward which stopped (the function called a
    ``torch.func`` transform, or read a tensor nobody threaded: it runs again) made and
    that is still held, by Python alone: it left the region by a side channel, and holds
    that try's value, which no gradient reaches (plain code made it once)."""
    alive = [t for r in refs if (t := r()) is not None]
    if alive:
        del alive
        gc.collect()  # (a cycle the stopped try left)
        alive = [t for r in refs if (t := r()) is not None]
    if alive:
        raise side_output_error(spec, alive[0], "the forward ran again: the function calls a torch.func transform or "
                                "reads a tensor it was not given, and the tensor is from the try that stopped")


def check_unsure(spec) -> None:
    unsure, spec.unsure = spec.unsure, []
    for r in unsure:
        t = r()
        if t is not None:
            raise side_output_error(spec, t, "autograd holds it too")


def _py_refs(t) -> int:
    """Python references to ``t``, less the one its TensorImpl keeps while C++ also holds it."""
    return 0 if t is None else sys.getrefcount(t) - (use_count(t) > 1)


def _stored(given: list, before: list, out, counted: bool = True) -> list:
    """(index, object, counted) of the inputs in ``given`` with more Python references after the run
    (``before``: counted before it) than its outputs account for: the function stored them
    (``counted``: see swap_view_of)."""
    in_outs = collections.Counter(id(o) for o in out[0])
    after = [_py_refs(t) - in_outs[id(t)] for t in given]  # (counted as before was)
    return [(k, given[k], counted) for k, (a, b) in enumerate(zip(after, before)) if a > b]


def side_output_error(spec, t: torch.Tensor, why: str) -> RematError:
    return RematError(
        f"remat({spec.name}): the tensor {describe(t)} made inside the region left it by a side "
        "channel (stored in a list or an attribute, or recorded by a hook) and cannot be "
        f"connected to the gradient under torch.func ({why}). Fix: return it from the function "
        "as an output."
    )


def check_lazy_outputs(spec, result) -> None:
    """Refuse outputs that compute with the region's tensors later (a closure, a
    generator): under torch.func they would see the forward's untracked tensors
    and silently give no gradient."""
    for leaf in optree.tree_leaves(result, none_is_leaf=True):
        if isinstance(leaf, (torch.Tensor, str, bytes, int, float, bool, type(None))):
            continue
        if isinstance(leaf, (types.GeneratorType, Iterator)):
            what = "a generator or iterator"
        elif callable(leaf) and not isinstance(leaf, (type, torch.nn.Module)) and reachable_tensors(leaf).tensors:
            what = "a function holding tensors"
        else:
            continue
        raise RematError(
            f"remat({spec.name}) returned {what} ({type(leaf).__name__}) that computes with the "
            "region's tensors later; under torch.func those tensors are not tracked, so its "
            "results would get no gradient. Fix: compute the values inside the function and "
            "return the tensors (e.g. return list(gen) or fn())."
        )


def distinct_inputs(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """The distinct tensors among ``tensors`` (by identity) and, per position,
    its index among them: a tensor passed twice is one input of the Function,
    so the function sees ``a is b`` as plain code does."""
    index: dict[int, int] = {}
    distinct: list[torch.Tensor] = []
    expand = []
    for t in tensors:
        k = index.get(id(t))
        if k is None:
            k = index[id(t)] = len(distinct)
            distinct.append(t)
        expand.append(k)
    return distinct, expand


def out_meta(t: torch.Tensor) -> tuple:
    """(shape, dtype, device) of an output."""
    return (tuple(t.shape), t.dtype, t.device)


def saved_inputs(ctx, spec):
    """The Function's saved inputs in backward (checked against in-place changes since the
    forward; offloaded ones fetched)."""
    spec.reach.check_versions(spec.name)
    for t, v in spec.outside:
        if version_of(t) != v:
            raise mutated_outside(spec.name, t, v, version_of(t))
    try:
        # A vjp_fn called after its level exited hands us dead wrappers; a new level created inside this backward may reuse their number.
        saved = tuple(unwrap_if_dead(t) if t is not None else None for t in ctx.saved_tensors)
        saved = tuple(as_given(t, top) for t, top in zip(saved, spec.inner_wrapped)) if spec.inner_wrapped else saved
        return saved if spec.offload is None else spec.offload.restore(saved)
    except RuntimeError as e:
        if "inplace" in str(e) or "version" in str(e):
            raise MutatedSavedTensorError(
                f"An input of remat({spec.name}) (an argument or a tensor it closes over) was "
                "modified in place after the forward, so it can no longer be recomputed. Fix: "
                "clone the tensor before modifying it (x = x.clone()), or apply the in-place "
                f"update after the backward pass.\n(autograd said: {e})"
            ) from None
        raise


def replace_at(tensors, wrt, diff) -> list:
    """``tensors`` with the positions ``wrt`` replaced by ``diff``."""
    full = list(tensors)
    for i, t in zip(wrt, diff):
        full[i] = t
    return full


def primal_under_vjp(f, *primals):
    """``f(*primals)`` under a ``vjp`` level of its own, as the region's forward runs: a function
    that differentiates inside (``torch.autograd.grad``) finds its inputs requiring grad."""
    return torch.func.vjp(f, *primals)[0]


def cotangents(spec, grads, out_diff) -> tuple:
    """The differentiable outputs' cotangents (zeros for those nobody differentiates)."""
    return tuple(g if g is not None else torch.zeros(m[0], dtype=m[1], device=m[2])
                 for g, m, d in zip(grads, spec.out_meta, out_diff) if d)


def undo_forward(spec, snap) -> None:
    """Before the forward runs again: the generators (``snap``) and the buffers it wrote as
    they were (a retry must not update a BatchNorm's statistics twice)."""
    if snap is not None:
        snap.restore_now()
    if spec.tape is not None:
        spec.tape.restore_rng()  # (the function's own generators too)
        spec.tape.undo_writes()


def plan_rerun(spec, roots, inputs) -> None:
    """JAX's rule on the recorded forward: keep the saveable values backward or the
    recomputation of what it needs reads; compute only those ops (see Tape.plan).  A
    region whose backward may replay its recorded forward (``spec.out_values``, see
    remat_fn._replay_live) keeps what that replay reads too."""
    tape, rec = spec.tape, spec.rec
    nodes = tape.nodes
    run, used_kept, used_outside = plan_kept(tape, roots, rec)
    replay = spec.out_values is not None
    if replay:
        used_outside = used_outside | tape.plan_steps([*roots, *tape.out_writes, *(v for v in spec.out_values if isinstance(v, Value))])[3]
    tape.release(used_outside)
    # The recomputation re-runs the function, which reads the live tensors: the ones the needed ops read must still be
    # what the forward read.  The region's inputs are saved by the Function (version-checked there, or offloaded): not held here.
    mine = {p for t in inputs if (p := storage_ptr(t))}
    spec.outside = [(v.t, v.version) for v in used_outside
                    if v.snap is None and v.t is not None and v.ptr not in mine]
    if not replay:  # (the replay reads the tensors the forward read, and knows inputs by them)
        for n in nodes:
            for v in n.reads:
                if v.node < 0 and v.snap is None:
                    v.t = None
    spec.plan = set(run)


# Python frames one region nested in another's forward adds under torch.func (the
# autograd.Function machinery of torch's functorch, about 35, and the region's own)
_FRAMES_PER_REGION = 64


def deep_enough(depth: int) -> None:
    """Regions nested ``depth`` deep: raise Python's recursion limit to what their calls
    need, if it is lower (plain code nests 30 functions in a few frames each; 30 nested
    regions under ``grad`` pass the default limit of 1000).  It is never lowered."""
    need = 1000 + _FRAMES_PER_REGION * (depth + 1)
    if sys.getrecursionlimit() < need:
        sys.setrecursionlimit(need)


class RegionState:
    """One call's state on this path: everything the Function needs that is not a
    tensor input (mutable: the forward fills in what backward reads)."""

    __slots__ = ("run", "n_in", "captured", "rng", "out_meta", "out_box", "name", "debug", "reach", "inner_rg",
                 "fwd_hits", "rec", "needs", "trace", "views", "autocast", "produced", "prof",
                 "plain_bytes", "expand", "grad_mode", "escapes", "escaped", "n_out", "diff", "keep_graph", "unsure",
                 "offload", "tape", "plan", "outside", "written", "frame", "graph", "dmeta", "dpos", "wrt",
                 "levels", "aliases", "roots", "bases", "foreign", "out_values", "vmapped", "batched", "replay", "widen", "apart", "unused", "unread",
                 "side_objs", "nested_side", "late_objs", "relocate", "check", "fwd", "fwd_only", "fwd_diff", "aliased", "aborted",
                 "grad_left", "rev", "held_inputs", "rerun_objs", "given_ids", "callers", "layers", "logical", "inner_wrapped", "inner_kind")

    def __init__(self, run, n_in, captured, name, debug, reach: Reachable, expand):
        self.run = run  # run(list_of_input_tensors) -> (tuple_of_out_tensors, rebuild)
        self.n_in = n_in  # distinct input tensors (the same tensor passed twice is one input)
        self.expand = expand  # argument position -> index among the distinct inputs
        self.grad_mode = torch.is_grad_enabled()  # what the function sees, as in plain code
        self.grad_left = self.grad_mode  # what it leaves (torch.set_grad_enabled(False) not undone)
        # side outputs: {call index: positions} of the forward's tensors that left the region by a side channel,
        # and the objects the caller holds (until they are swapped for the Function's outputs)
        self.escapes: dict[int, list[int]] = {}
        self.escaped: list = []
        self.held_inputs: list = []  # (index, object, counted) of the inputs the function stored: see connect_side_outputs
        # ids of the inputs as the caller holds them (the Function's forward may see others), and those (in the forward)
        self.given_ids, self.callers = [], None
        self.layers = None  # under vmap of forward mode: the batch layers of the inputs and outputs
        self.logical: LogicalTape | bool | None = None  # the forward's torch calls, where recorded (True: to record)
        self.inner_wrapped, self.inner_rg = [], []  # (each input's innermost grad level at the call, requires_grad there)
        self.inner_kind = None  # (the innermost transform plain code would run the function under, see innermost_kind)
        self.apart: list[bool] | None = None  # see remat_fn._functorch.apart_inputs
        self.unused: list[bool] | None = None  # (eager autograd around vmap: see _RematFunction.forward)
        self.unread: list[bool] | None = None  # per input: no op of the region read it (see unread_inputs)
        self.rerun_objs: list = []  # what the jvp rule's run again left in the caller's objects, per side output
        self.side_objs: list = []  # (the caller's object, its (call index, position)) per side output
        self.nested_side: dict = {}  # the same for the regions nested in it (see CaptureMode's first)
        self.late_objs: list = []  # the same, of its first run, where this call runs inside a run again
        # the closure's places hold the replacements while the function runs (it handed a tensor it
        # closes over to torch.func itself, where no torch function replaces it: see MissedCapture)
        self.relocate = False
        self.check = False  # strict checks (debug, early_stop=False): backward runs the function again to check it
        self.n_out = 0
        self.diff: list[bool] = []  # which outputs are differentiable (as in plain code)
        # forward mode is on at the call, and which outputs it differentiates (diff, and those
        # the inputs reach under no_grad: a tangent is not stopped by it); empty: diff
        self.fwd = False
        self.fwd_only: set[int] = set()
        self.aliased = False  # the function read an input's own tensor as a constant (see CaptureMode.bases)
        self.fwd_diff: list[bool] = []
        self.aborted: list = []  # weak refs to what a forward that stopped (a try, see MissedCapture) made
        self.keep_graph = False  # the forward's vjp level keeps what autograd saves (see keep_nothing)
        self.unsure: list = []  # weak refs to side-output candidates autograd also held
        self.captured = captured
        self.rng: RNGSnapshot | None = None
        self.out_meta: list[tuple] | None = None
        self.out_box: list = []
        self.name = name
        self.debug = debug
        self.reach = reach
        self.fwd_hits: set[int] = set()
        self.rec = None  # remat_fn._record.Record when a policy is in force
        self.needs: list[bool] = []  # which tensor inputs need a gradient
        self.rev: list[bool] = []  # which of them reverse mode differentiates (see forward)
        self.trace: list = []  # the forward's tensor ops (see CallTrace), checked on recompute
        self.views: dict[int, tuple] = {}  # output index -> (input index, size, stride, offset)
        self.autocast = AutocastState()  # re-entered by the recomputation
        self.produced: set[int] | None = None  # see CaptureMode
        self.prof = None  # the remat_fn.profile() active at forward, if any
        self.plain_bytes = 0  # what plain autograd would save (measured while profiling)
        self.offload: FuncInputs | None = None  # inputs the policy offloads (remat_fn._offload)
        self.tape: Tape | None = None  # the forward's ops (remat_fn._tape)
        self.plan: set[int] | None = None  # the tape nodes the recomputation computes
        self.outside: list = []  # (tensor, version) of the outside tensors the recomputation reads
        self.written: dict = {}  # storages the forward wrote -> their copy before (Tape.pre_write)
        # Backward from the forward's own graph: the hooks path's frame whose handles the graph saved (None: backward
        # re-runs the function), that graph (the forward level's vjp_fn), its differentiated outputs' metadata, each
        # Function output's position among them, and the inputs it differentiates
        self.frame = None
        self.graph = None
        self.dmeta: list = []
        self.dpos: list = []
        self.wrt: list[int] = []
        self.batched = False  # a vmap wraps an input (see vmaps_outermost)
        self.levels: dict | None = None  # the transforms active at the call (see needs_grad)
        # (id of the caller's object, index) of the inputs a closure reads too: substituted like captured tensors
        self.aliases: list[tuple[int, int]] = []
        # the forward level's graph (its outputs' nodes, until checked), the ids of the plain tensors below the
        # Function's inputs, whether it holds a custom autograd.Function (whose forward's ops autograd does not differentiate)
        self.roots: list = []
        self.bases: list[int] = []
        self.foreign: bool | None = None
        self.out_values: list | None = None  # the outputs as the tape knows them (see _replay_live)
        self.vmapped = False  # a vmap is active at the call
        self.replay = False  # a nested region: its backward replays the recorded forward
        self.widen: list[bool] = []  # per vmap level: something outside differentiates (see batched_outputs)

    def refs_to(self, t, cells: set) -> int:
        """The Python references to ``t`` this call keeps after its forward (see note_region_inputs;
        the closure cells holding it go to ``cells``)."""
        return sum(c is t for c in self.captured) + self.reach.refs_to(t, cells)

    def side_late(self) -> list:
        """The caller's objects holding this call's side outputs (see CaptureMode's ``late``)."""
        return [*self.side_objs, *self.late_objs]

    def level_args(self, tensors, wrt, diff, known: Known) -> list:
        """The forward's arguments under its vjp level: ``diff`` (the level's wrappers) at ``wrt``.  An input
        the level does not differentiate, which apply unwrapped (a jvp level's, an enclosing forward's), is
        wrapped at the level too, so that if the function stores it, it is found (see :meth:`call`) and the
        caller's object takes a view of the caller's tensor."""
        known.update(diff)
        self.fwd_only = {id(d) for d in diff} if self.fwd and not any(self.rev) else set()  # (see untracked_stats)
        args = replace_at(tensors, wrt, diff)
        for i, g in enumerate(self.given_ids):
            if i not in wrt and id(t := args[i]) != g and differentiable(t):
                args[i] = wrap_at_top(t)
                known.add(args[i])
        return args

    def call(self, tensors, known: Known | None, stores: bool = False, python: bool = False):
        """Run the region on ``tensors`` (inputs then captured replacements).  ``stores``: a
        recomputation whose stored inputs are kept as the forward's are (the jvp rule's run
        again: its inputs are its own level's, dead after it).  ``python``: the function itself, not its torch calls replayed."""
        n = self.n_in
        subst = {id(o): r for o, r in zip(self.captured, tensors[n:])}
        for i, k in self.aliases:
            subst.setdefault(i, tensors[k])
        if known is None:  # a recomputation: put functional_call's tensors back; the
            # buffers the forward wrote (BatchNorm's statistics) as private copies
            copies: dict = {}
            places = private_copies(self.reach.tensors.values(), self.written, copies)
            if stores:
                given = [t if is_wrapped(t) else None for t in tensors[:n]]
                before = [_py_refs(t) for t in given]
            with self.reach.relocated({**subst, **places} if self.relocate else places), \
                    PrivateWrites(self.written, copies) if self.written else _NULL:
                out = self._call(tensors, known, subst, stores, python)
            if stores:
                self.held_inputs += _stored(given, before, out, counted=False)
            return out
        # Inputs the function stores (``box.append(x)``) are found by their Python references: one more
        # after it than before (with subst's), less the outputs (see connect_side_outputs).  Wrappers of the
        # Function's levels only: the tape holds the plain tensors it reads.
        given = [t if is_wrapped(t) else None for t in tensors[:n]]
        before = [_py_refs(t) for t in given]
        if not self.relocate:
            out = self._call(tensors, known, subst)
        else:
            # (the function calls torch.func itself: a transform it enters wraps what it is handed, and a
            # tensor of a level set aside in this forward (a constant made under the caller's transforms)
            # must reach it as this forward's ops see it, unwrapped: functorch asserts on it otherwise)
            consts = {i: unwrap_all(t) for i, t in self.reach.tensors.items() if i not in subst and is_wrapped(t)}
            with self.reach.relocated({**consts, **subst}):
                out = self._call(tensors, known, subst)
        self.held_inputs = _stored(given, before, out)
        return out

    def _call(self, tensors, known, subst, stores: bool = False, python: bool = False):
        n = self.n_in
        recompute = known is None
        args = [tensors[k] for k in self.expand]  # the same object where the caller passed one twice
        if recompute:
            late, first = self.side_late(), self.nested_side
        else:  # (inside a run again of an enclosing region: what this call's first run left)
            late, first = first_run_of_nested()
            self.late_objs = late
        check = CallTrace(self.trace, self.debug) if recompute else None
        mode = CaptureMode(subst, known, check if recompute else self.trace, self.name, None if recompute else self.produced,
                           inputs=() if recompute else tensors[:n],
                           grab=self.escapes if recompute else None, late=late, first=first)
        mode.levels, mode.where, _ = self.levels, self.debug, mode.hooks_from(tensors, self.callers, self.captured, n)
        if not recompute:  # (at the call: the enclosing regions' own levels aside)
            self.inner_kind = innermost_kind(self.levels)
        mode.inner_kind = self.inner_kind
        mode.tape = None if recompute else self.tape
        # (side outputs no_grad made, see _leaves; in an enclosing region's forward, for its levels)
        mode.every = 0 if recompute else watched(2 if self.vmapped else 1 if self.fwd else 0)
        mode.fwd_only = set() if recompute else self.fwd_only
        mode.counts_inputs = stores  # (a region nested in this run keeps aliases of its inputs, see refs_counted)
        run = self.logical.run if recompute and not python and isinstance(self.logical, LogicalTape) else self.run
        # (a level above a vmap batching its inputs may differentiate its backward: see remat_fn._logical)
        mode.logical = LogicalTape(args, self.tape) if self.logical is True and self.tape is not None and not recompute else None
        with mode:
            try:
                outs, rebuild = run(args)
            except BaseException:
                for h in mode.hooked:  # (put on the caller's tensors by a try that stops)
                    h.remove()
                if not recompute and mode.made:  # (a try that stops: see stale_side_outputs)
                    self.aborted = [r for _, _, r in mode.made if (t := r()) is not None and carries_grad(t)]
                raise
            if mode.logical is not None:  # (the outputs as the function returned them, as a replay will)
                self.logical, mode.logical = mode.logical.finish(outs, rebuild), None
            # A captured tensor returned as is never went through an op.
            outs = tuple(mode._fix(o) for o in outs)
        if not recompute:
            self.grad_left, self.callers = torch.is_grad_enabled(), None
            self.fwd_hits = mode.hits
            # (.data, hooks, autograd inside: see CaptureMode; "autograd": a run again runs under a vjp level, as the forward)
            self.foreign = ("autograd" if mode.autograd else True) if mode.opaque else None
            self.escaped = mode.escaped(outs)
            self.aliased = mode.aliased
            self.nested_side = mode.nested
            return outs, rebuild
        check.finish(self.name)
        if mode.grabbed.keys() != {(c, i) for c, ii in self.escapes.items() for i in ii}:
            raise RecomputeMismatchError(
                f"Recomputing remat({self.name}) did not produce the tensors that left the forward "
                "by a side channel (appended to a list, recorded by a hook). The function must run "
                "the same torch calls in both runs: make control flow depend only on its arguments. "
                "(A side output of a region nested in it, where this recomputation runs that region "
                "as plain code (forward mode, debug=True), is not found either: call the nested "
                "region outside, or without debug=True.)"
            )
        outs = outs + tuple(unwrap_if_dead(mode.grabbed[(c, i)]) for c, ii in self.escapes.items() for i in ii)  # (see RegionState.call)
        out = (outs, rebuild)
        # (a replay of the recorded calls reads the forward's objects: a region nested in it may only have reached one)
        lost = [] if run is not self.run else [o for o in self.captured if id(o) in self.fwd_hits - mode.hits and not self._copied_constant(o)]
        if lost:
            raise RematError(
                f"remat({self.name}): the recomputation did not use the tensor "
                f"{describe(lost[0])} that the forward used and that needs a gradient; its "
                "gradient would be lost. It was probably reached through an object that changed "
                "between forward and backward. Fix: pass the tensor to the function as an "
                "argument instead of reaching it through an attribute."
            )
        return out

    def _copied_constant(self, t) -> bool:
        """True for a tensor the forward wrote in place (the re-run reads its private
        copy, not the Function's input) that no transform active at the call
        differentiates: a BatchNorm's running statistics under ``grad`` of ``grad``, which
        the forward threaded because their levels were set aside there."""
        return (storage_ptr(t) in self.written and not requires_grad_anywhere(t)
                and not needs_grad(t, self.levels))
