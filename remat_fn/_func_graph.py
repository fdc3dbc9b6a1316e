"""The ``torch.func`` path's Function as plain code: its outputs, and backward from the forward level's graph.

Backward from the graph.  The region's forward runs under a ``vjp`` level of its own (see
:mod:`remat_fn._path_torch_func`).  Where backward can, it differentiates that
level's graph instead of running the function again: what the graph saves is a
handle of the shared :class:`~remat_fn._frame.Frame` (:class:`KeepHandles`),
which the tape replays below every functorch transform (:class:`Unpack`), so the
function's Python runs once, as in eager mode.  The graph's outputs are private
aliases whose memory the Function's outputs take (:func:`release_outputs`).
:func:`outside_reach` tells what outside may differentiate a backward;
:func:`saved_storages` what a graph saved, where no hook can tell.

Outputs that alias an input or each other.  A custom ``autograd.Function``'s outputs are new tensors to autograd, whatever memory
they share.  Plain code's are not: ``x[1]`` is a view of ``x``, and ``h[1:3]`` returned
beside ``h`` is a view of ``h``, so writing into one in place after the region (``a.mul_(2)``)
changes the other *and its gradient*.  :func:`alias_map` finds the outputs that alias an
input or another output, and :func:`rebuild` makes each again, outside the Function, as
the same view (``as_strided``) of the caller's tensor or of the Function's other output,
so that autograd knows what plain autograd knows.

``as_strided`` differentiates through memory: on a base whose elements overlap (an
``expand``ed tensor) its backward spreads a gradient over every element sharing the
memory, which is not what the view op the function ran (``select``) does.  Such bases
are left as the Function returned them.

Under ``vmap`` the Function's forward sees ``BatchedTensor``s (its generated vmap rule
runs it under a vmap level of its own) and the caller gets them back wrapped: sizes,
strides and offset are then the logical ones of one example, which is what ``as_strided``
takes under ``vmap`` (its batching rule prepends the base's batch strides to the strides
given and reads the offset as the physical one of the first example).  So an output is
rebuilt there too, where it and its base are batched alike (the same batch sizes and
strides at every level, :func:`_batching`): each example's view is then the same view of
that example's base.  Left as the Function returned them, such outputs share memory but
not history, and a write into one after the region (``a.mul_(3)``) changed the other's
value but not its gradient (``vmap(grad)``, ``vmap(vjp)``, ``grad`` of a ``vmap``).

An output that is not batched under the ``vmap`` (``torch.tanh(w * 2)`` beside ``h * w``,
``h`` vmapped, ``w`` not) meets a bug of torch's generated vmap rule where something
outside the ``vmap`` differentiates (``grad``/``vjp``/``jacrev`` of a ``vmap``, eager
autograd around one): the rule's backward gets that output's cotangent already summed
over the batch, runs the Function's backward once per example with it, and sums the
input gradients over the batch again (``reductify``), so that term is B times too large.
:func:`batched_outputs` returns such outputs batched (an expanded view, no copy), so
their cotangents arrive per example.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

import torch

from ._func_semantics import ForwardHook
from ._functorch import (
    C,
    batch_layers,
    forward_mode_active,
    grad_wrappers,
    is_grad_kind,
    live_levels,
    rebatch,
    storage_ptr,
    unwrap_all,
    vmap_levels,
    vmap_sizes,
    without_level,
)
from ._offload_buffers import quiet
from ._ops import bookkeeping
from ._record import recording_tapes
from ._torch_internals import (
    TRANSFORMS_FILE,
    DisableFuncTorch,
    dispatch_stack_len,
    function_class,
    function_mode_enabled,
    is_view,
    saved_tensor_attrs,
)
from .memory import COUNTERS, storage_released

__all__ = ["KeepHandles", "Unpack", "alias_output", "detached_alias", "release_outputs", "from_graph", "note_storage",
           "saved_storages", "outside_reach", "foreign_functions", "unread_inputs", "alias_map", "rebuild", "returned",
           "batched_outputs", "distinct_objects", "input_places"]


_NULL = contextlib.nullcontext()
_SAVED_ATTRS: dict[type, tuple[str, ...]] = {}


def saved_storages(outs) -> dict[int, int]:
    """Storages (pointer -> bytes) of the tensors autograd saved in the graph behind ``outs``.

    Saved-tensor hooks are refused under torch.func, so the graph the policy
    forward built (under its vjp level) is walked instead: every node exposes
    what it saved as ``_saved_*`` attributes.
    """
    found: dict[int, int] = {}
    # Python node objects may be made afresh by each ``next_functions`` read and
    # freed after use; holding them keeps their ids from being reused
    seen: dict[int, Any] = {}
    stack = [o.grad_fn for o in outs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        names = _SAVED_ATTRS.get(type(node))
        if names is None:
            names = _SAVED_ATTRS[type(node)] = tuple(
                saved_tensor_attrs(node))
        for a in names:
            try:
                v = getattr(node, a)
            except RuntimeError:  # released, or not a tensor slot
                continue
            for t in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(t, torch.Tensor):
                    note_storage(found, t)
        if hasattr(node, "saved_tensors"):  # custom autograd.Function nodes
            try:
                for t in node.saved_tensors:
                    if isinstance(t, torch.Tensor):
                        note_storage(found, t)
            except RuntimeError:
                pass
        stack.extend(n for n, _ in node.next_functions)
    return found


class KeepHandles(ForwardHook):
    """The pack hook of the forward's level when backward differentiates that level's
    graph: what autograd saves becomes a handle of the hooks path's frame (the tape
    replays it in backward), and its storage is noted (what plain autograd keeps)."""

    __slots__ = ("frame", "noted", "batched")

    def __init__(self, frame, noted, batched: bool = False):
        self.frame = frame
        self.noted = noted
        self.batched = batched  # a vmap wraps the region's inputs (see remat_fn._functorch.vmaps_outermost)

    def __call__(self, t):
        note_storage(self.noted, t)
        h = self.frame.pack(unwrap_all(t))
        if self.batched:  # (the tape holds the batched value below its vmap wrappers)
            layers = batch_layers(t)
            if layers:
                return _Batched(h, layers)
        return h


class _Batched:
    """A handle of a value saved under ``vmap``: the tape replays the tensor below the
    vmap wrappers, which backward, run under the same levels, puts back around it."""

    __slots__ = ("h", "layers")

    def __init__(self, h, layers):
        self.h = h
        self.layers = layers


class Unpack:
    """The unpack hook beside :class:`KeepHandles`: the tape replays plain values, which
    do not depend on the transforms active in backward (a ``vmap`` over cotangents in
    ``jacrev``): it runs below them, as the forward's ops did (a random op drawing the
    forward's numbers is no random op under that vmap)."""

    __slots__ = ("frame",)

    def __init__(self, frame):
        self.frame = frame

    def __call__(self, h):
        batched = type(h) is _Batched
        with DisableFuncTorch():
            t = self.frame.unpack(h.h if batched else h)
        return rebatch(t, h.layers) if batched else t


_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default


def alias_output(t: torch.Tensor) -> torch.Tensor:
    """A private alias of an output of the forward's level, differentiable, and no view
    (a view would hold its base, the output itself): see release_outputs."""
    return _UNSAFE_VIEW(t, t.shape) if t.layout == torch.strided else t


def detached_alias(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()``, for the Function to return in ``t``'s place: no op of the function, so an
    enclosing region's tape reads it as ``t`` itself (a recorded detach cut that region's replay's
    gradient through this region's output: a region calling ``torch.func.grad`` over another,
    0.18 to 58.6 off under every composition, silently, until this)."""
    with bookkeeping():
        d = t.detach()
    for tape in recording_tapes():
        tape.alias(unwrap_all(d), unwrap_all(t))
    return d


def release_outputs(douts) -> tuple:
    """The kept graph holds its level's outputs (private aliases, made in the forward's
    ``f``), which autograd never reads: each gives its storage to a detached alias that
    the Function returns (else its node, on what it returns, would hold itself) and
    keeps a one-element stand-in of the same shape, so the graph holds no output's
    memory (a region's output is freed when the caller lets it go, as in plain code)."""
    out = []
    for t in douts:
        out.append(detached_alias(t))
        t = unwrap_all(t)  # (under vmap: the batched tensor below the wrappers)
        if t.numel() and t.layout == torch.strided and not is_view(t) and type(t) is torch.Tensor:  # (not a FakeTensor's)
            # (bookkeeping, no op of any region: modes stepped aside where there are any)
            with quiet() if dispatch_stack_len() or function_mode_enabled() else _NULL, DisableFuncTorch():
                one = torch.empty(1, dtype=t.dtype, device=t.device)
                t.set_(one.untyped_storage(), 0, t.shape, (0,) * t.dim())
            if COUNTERS:  # (for LiveBytes, which no set_ reaches)
                storage_released(t)
    return tuple(out)


def from_graph(spec, tensors, wrt, grads, linear: bool = False) -> tuple:
    """Backward through the forward level's graph: its saved tensors come back from the
    tape's replay, so the function does not run again (its Python side effects happen
    once).  Only where nothing outside differentiates this backward: no other grad level
    (see outside_reach) and no forward-mode level (``hessian``: the replayed values
    carry no tangents); there remat_fn._replay_live replays the recorded forward.  ``linear``:
    eager autograd reaches the cotangents only (the saved tensors it never does, see
    outside_reach): differentiated with grad mode on, the result linear in them."""
    cot: list = [None] * len(spec.dmeta)
    for g, p in zip(grads, spec.dpos):
        if g is not None and p is not None:
            cot[p] = g
    for p, m in enumerate(spec.dmeta):  # (outputs no gradient reached: zeros)
        if cot[p] is None:
            cot[p] = torch.zeros(m[0], dtype=m[1], device=m[2])
    start = time.perf_counter()
    spec.frame.consumed = set()  # (a new backward pass through the graph)
    with contextlib.nullcontext() if linear else torch.no_grad():
        gin = spec.graph(tuple(cot))
    if spec.prof is not None:
        spec.prof.record_recompute(spec.name, time.perf_counter() - start)
    result: list[Any] = [None] * (len(tensors) + 1)
    where = {i: k for k, i in enumerate(spec.wrt)}
    unused = spec.unused  # (no output computed from it in grad mode: None, as plain autograd leaves it)
    for i in wrt:
        k = where.get(i)
        if k is not None and not (unused is not None and unused[i]):
            result[i + 1] = gin[k]
    return tuple(result)


def note_storage(found: dict[int, int], t: torch.Tensor) -> None:
    try:
        st = unwrap_all(t).untyped_storage()
        found.setdefault(st.data_ptr(), st.nbytes())
    except (RuntimeError, NotImplementedError):  # (no storage, or a wrapper subclass's)
        return


def outside_reach(saved, grads, tensors) -> tuple[bool, bool, bool, tuple, list]:
    """What besides its own grad level may differentiate a backward's result, from one walk
    over the ``saved`` tensors and the cotangents ``grads``: ``(levels_clear, saved_tracked,
    cots_tracked)``.

    The backward being run belongs to one grad level: a dead one when it is a
    ``vjp``/``jacrev`` ``vjp_fn`` called after its level exited, otherwise the
    innermost live grad level wrapping the saved tensors.  ``levels_clear``: no *other*
    live grad or jvp level wraps the saved tensors or the cotangents, and no forward-mode
    level is live.  ``saved_tracked`` / ``cots_tracked``: a saved tensor's / a cotangent's
    plain tensor requires grad (eager autograd outside).  Nothing outside differentiates
    the result (the graph may be dropped) where all three say so; eager autograd reaches
    the cotangents only (``from_graph(linear=True)``) where the saved tensors are untracked.
    Last, ``grads`` and the backward's input ``tensors``: as given, or without the backward's
    own level's wrappers where only forward mode differentiates its result besides that level
    (see below).
    """
    if not torch.is_grad_enabled():
        return False, False, False, grads, tensors  # already not recording; nothing to gain
    live = live_levels()
    wrappers = []
    tracked = [False, False]
    for k, group in enumerate((saved, grads)):
        for t in group:
            if isinstance(t, torch.Tensor):
                ws, base = grad_wrappers(t)
                tracked[k] = tracked[k] or base.requires_grad
                wrappers.extend(ws)
    if forward_mode_active():
        # a live jvp level differentiates it too, wrapping the saved tensors or not: under
        # no_grad torch's backward formulas take branches with no tangent (solve, logdet) or
        # kernels forward AD lacks (silu_backward).  Where no other reverse level does (nor eager
        # autograd: one live grad level wraps them, none dead), the level's engine records the
        # backward all the same (torch.func runs it with create_graph=True), holding every replayed
        # activation and the backward's intermediates until that level's backward ends (a
        # Hessian-vector product kept more than plain code, 53.5 against 45.5 MiB): computed on
        # cotangents and inputs without that level's wrappers, grad mode on, nothing records it
        levels = {lv for lv, _ in wrappers if is_grad_kind(live.get(lv))}
        if any(tracked) or any(dead for _, dead in wrappers) or len(levels) != 1 or _autograd_of_user():
            return False, False, False, grads, tensors
        lv = levels.pop()
        return False, False, False, tuple(without_level(g, lv) for g in grads), [without_level(t, lv) for t in tensors]
    if not wrappers:
        return False, *tracked, grads, tensors
    alive = [lv for lv, dead in wrappers if not dead and is_grad_kind(live.get(lv))]
    if any(dead for _, dead in wrappers):
        return not alive, *tracked, grads, tensors
    this = max(lv for lv, _ in wrappers)
    # (``torch.autograd.grad(..., create_graph=True)`` of the user's, inside the transform: its own level differentiates it)
    return all(lv == this for lv in alive) and not _autograd_of_user(), *tracked, grads, tensors


_AUTOGRAD_GRAD = torch.autograd.grad.__code__


def _autograd_of_user() -> bool:
    """The ``torch.autograd.grad`` running this backward (grad mode on: ``create_graph=True``) was called by the
    user's code inside a transform, not by the transform's own ``grad``/``vjp_fn``: the level differentiates its
    result then (``cos(x)`` for ``cos(x) - x sin(x)`` under ``grad``, silently, until this; a hostile pass).  Where
    autograd's engine runs backward on a thread of its own (CUDA), no Python frame tells: the transform's is assumed."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code is _AUTOGRAD_GRAD:
            return f.f_back is not None and f.f_back.f_code.co_filename != TRANSFORMS_FILE
        f = f.f_back
    return False


def unread_inputs(tape, tensors, returned: set[int]) -> list[bool]:
    """For each of the Function's inputs: whether no op of the region read it, as the ``tape``
    holds them (before it lets go, see Tape.release), nor did the function return it (ids in
    ``returned``): a tensor the closure reaches but the function never touches (a module's own
    parameters under ``functional_call``, which may share memory with the tensors it swaps in:
    told apart by identity, as autograd tells them).  Only for a region whose backward runs no
    code of the user's (no custom Function, no hook: what it reads there no op shows)."""
    reg = tape.reg or {}
    return [(i := id(unwrap_all(t))) not in reg and i not in returned for t in tensors]


def foreign_functions(roots, own, steps=None) -> bool:
    """True when the graph behind ``roots`` holds a custom ``autograd.Function`` other than
    the regions' own (class ``own``) and those whose every call the tape holds as one step
    (``steps``: ``Tape.functions``, see remat_fn._replay_live): the recorded ops of its forward are not what
    autograd differentiates through it (its ``backward`` and ``jvp`` are), so no replay of
    them can stand in."""
    seen: dict[int, Any] = {}  # (holding the nodes: a Python node made on access keeps its id)
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        custom = isinstance(node, torch.autograd.function.BackwardCFunction)
        cls = function_class(node) if custom else None
        if custom and cls is not own and not (steps and steps.get(cls)):
            return True
        try:
            nexts = node.next_functions
        except RuntimeError:
            # (torch 2.12 refuses it on a nested region's own node under forward mode, reached through
            # that region's side output: what lies behind it, that region's call checked for itself)
            if cls is own:
                continue
            raise
        stack.extend(n for n, _ in nexts)
    return False


# -- outputs that alias an input or each other ---------------------------------
def _batching(t: torch.Tensor) -> tuple | None:
    """How functorch wraps ``t``: ``(level, batch size, batch stride)`` of each ``vmap``
    level, outermost wrapper first (``()`` for a plain tensor); ``None`` where a wrapper
    is not a ``vmap`` one (a live grad level: the Function's forward runs below them)."""
    out = []
    while C.is_functorch_wrapped_tensor(t):
        if not C.is_batchedtensor(t):
            return None
        level, bdim = C.maybe_get_level(t), C.maybe_get_bdim(t)
        t = C.get_unwrapped(t)
        out.append((level, t.shape[bdim], t.stride(bdim)))
    return tuple(out)


def _plain(t) -> bool:
    """A strided tensor whose view can be rebuilt with ``as_strided`` (plain, or batched)."""
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and t.numel() > 0 and _batching(t) is not None


def overlaps(t: torch.Tensor) -> bool:
    """True where two elements of ``t`` may share memory (conservative: a layout it cannot
    tell counts as overlapping)."""
    reach = 0
    t = unwrap_all(t)  # (under vmap: the examples must not share memory either)
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The storage elements ``t`` spans: ``[first, last]``."""
    lo = hi = t.storage_offset()
    for size, stride in zip(t.shape, t.stride()):
        if stride >= 0:
            hi += (size - 1) * stride
        else:
            lo += (size - 1) * stride
    return lo, hi


def _covers(base: torch.Tensor, t: torch.Tensor) -> bool:
    """Every element of ``t`` is an element of ``base`` (``base.as_strided`` can make ``t``, and
    a gradient through it reaches ``base``): inside its extent, where it has no holes, else
    checked element by element (small tensors; a larger one with holes counts as not covering:
    ``u[::2]`` does not cover ``u[:2]``)."""
    if not _alike(base, t):
        return False
    (a, b), (c, d) = _extent(base), _extent(t)
    if not (a <= c and d <= b):
        return False
    if b - a + 1 == base.numel() and not overlaps(base):
        return True
    if base.numel() > 1 << 16:
        return False
    return _positions(t) <= _positions(base)


def _positions(t: torch.Tensor) -> set[int]:
    """The storage elements of ``t`` (Python integers: no op an enclosing region would record)."""
    pos = [t.storage_offset()]
    for size, stride in zip(t.shape, t.stride()):
        pos = [p + i * stride for p in pos for i in range(size)]
    return set(pos)


def _alike(base: torch.Tensor, t: torch.Tensor) -> bool:
    """``t`` can be made as ``base.as_strided(...)``: same dtype and device, batched alike, and
    conjugated and negated alike (``z.conj()``, ``.mH``: a lazy bit as_strided does not carry)."""
    return base.dtype == t.dtype and base.device == t.device and _batching(base) == _batching(t) \
        and base.is_conj() == t.is_conj() and base.is_neg() == t.is_neg()


def alias_map(outs, tensors, diff, own: dict | None = None) -> dict[int, tuple]:
    """``{i: (kind, j, size, stride, offset)}``: output ``i`` is a view of input ``j``
    (``kind == "in"``) or of output ``j`` (``"out"``).  ``diff``: which outputs are
    differentiable (a view of another output is rebuilt only where both agree).  ``own``:
    ``{i: j}``, output ``i`` is input ``j`` or a view of it (:func:`input_places`), where other
    inputs share its memory."""
    own = own or {}
    found: dict[int, tuple] = {}
    storages: dict[int, list[int]] = {}
    for j, t in enumerate(tensors):
        if _plain(t) and (p := storage_ptr(t)) is not None and not overlaps(t):
            storages.setdefault(p, []).append(j)
    ids = {id(t) for t in tensors}
    by_storage: dict[int, list[int]] = {}
    for i, o in enumerate(outs):
        if id(o) in ids or not _plain(o):
            continue  # an input returned as is stays inside (see the Function's forward)
        p = storage_ptr(o)
        if p is None:
            continue
        # (the input it is a view of: one that covers it, not the first on its storage: w[1] of
        # arguments w[0], w[1] is no view of w[0], whose gradient it would take)
        eligible = storages.get(p, ())
        j = own.get(i)
        if j not in eligible or not _covers(tensors[j], o):
            j = next((j for j in eligible if _covers(tensors[j], o)), None)
        if j is not None:
            found[i] = ("in", j, tuple(o.shape), o.stride(), o.storage_offset())
        else:
            by_storage.setdefault(p, []).append(i)
    for group in by_storage.values():
        if len(group) < 2:
            continue
        # the base: an output that covers the memory of the others and does not overlap itself
        for j in sorted(group, key=lambda k: -outs[k].numel()):
            if overlaps(outs[j]):
                continue
            for i in group:
                o = outs[i]
                if i != j and diff[i] == diff[j] and _covers(outs[j], o):
                    found[i] = ("out", j, tuple(o.shape), o.stride(), o.storage_offset())
            break
    return found


def returned(outs, tensors) -> tuple:
    """The Function's forward's ``outs`` as it returns them.  An output that *is* an input
    would be aliased by autograd: a view of it.  (Below the wrappers: vmap's generated rule
    unwraps them, so an output that wraps an input's tensor, ``x.t()`` of a vmapped vector,
    is that input there.)  One that is a view of a tensor made inside (``h[1:]``, under
    vmap, where the forward's level's outputs are not private aliases) becomes a private
    alias that is no view: autograd refuses writes into a custom Function's view outputs
    ("Output 0 of Vmapped_RematFunction is a view and is being modified inplace"), which
    plain code makes (eager autograd around a vmap).  The outputs that are views of each
    other are views again after the Function (:func:`rebuild`)."""
    inputs = {id(unwrap_all(t)) for t in tensors}
    storages = {storage_ptr(t) for t in tensors}

    def one(o):
        if not isinstance(o, torch.Tensor):
            return o
        if id(unwrap_all(o)) in inputs:
            return o.view_as(o)
        return alias_output(o) if is_view(unwrap_all(o)) and storage_ptr(o) not in storages else o

    return tuple(one(o) for o in outs)


def rebuild(outs: list, views: dict[int, tuple], inputs, diff, n: int, fwd_diff=()) -> None:
    """Make the outputs ``views`` names (among the first ``n``) again as views of the
    caller's input or of another (final) output, in place in ``outs``.  ``fwd_diff``: the
    outputs forward mode differentiates (a view made under no_grad keeps its tangent)."""
    for i, (kind, j, size, stride, offset) in views.items():
        if i >= n or (kind == "out" and (j >= n or j in views)):
            continue
        if kind == "in" and not diff[i] and fwd_diff and fwd_diff[i]:
            with torch.no_grad():  # (no gradient, as plain code's view made under no_grad; its tangent)
                outs[i] = inputs[j].as_strided(size, stride, offset)
            continue
        if kind == "in":
            base = inputs[j] if diff[i] else inputs[j].detach()
        else:
            base = outs[j]
        # (a differentiable output of a region called under no_grad: the input it returned, or a view the
        # function made under its own enable_grad: differentiated as in plain code)
        with torch.enable_grad() if diff[i] else contextlib.nullcontext():
            outs[i] = base.as_strided(size, stride, offset)


def batched_outputs(outs: tuple, tensors, diff, widen: list[bool], views: dict[int, tuple]) -> tuple:
    """The Function's forward's ``outs`` (run under its generated vmap rule) with each
    differentiable output batched at every ``vmap`` level where ``widen`` says something
    outside differentiates (see :func:`remat_fn._functorch.differentiated_outside_vmaps`)
    and an input or output is batched (where none is, the rule's backward runs once, on the
    whole cotangent, and sums nothing): one not batched there becomes an expanded view
    batched there.  Views among them
    (``views``, see :func:`alias_map`) stay views of an input (rebuilt from it after the
    Function, unbatched as in plain code); views of an expanded output are dropped (its
    elements overlap: ``as_strided`` would spread their gradient)."""
    stack = vmap_sizes()
    if len(stack) != len(widen):  # (not expected: each vmap level runs the generated rule)
        widen = [any(widen)] * len(stack)
    batched = {level for t in (*tensors, *outs) if isinstance(t, torch.Tensor) for level in vmap_levels(t)}
    levels = [(level, size, w and level in batched) for (level, size), w in zip(stack, widen)]
    out, changed = [], set()
    for i, (o, d) in enumerate(zip(outs, diff)):
        b = _batched_at(o, levels) if d and isinstance(o, torch.Tensor) else o
        if b is not o:
            changed.add(i)
        out.append(b)
    for i in [i for i, (kind, j, *_) in views.items() if kind == "out" and (i in changed or j in changed)]:
        del views[i]
    return tuple(out)


def _batched_at(t: torch.Tensor, levels: list) -> torch.Tensor:
    """``t`` batched at each of ``levels`` (``(level, batch size, widen)``, outermost first)
    where ``widen`` is set: expanded along a new batch dimension where it is not."""
    if not levels:
        return t
    level, size, widen = levels[-1]
    if C.is_batchedtensor(t) and C.maybe_get_level(t) == level:
        inner = C.get_unwrapped(t)
        below = _batched_at(inner, levels[:-1])
        return t if below is inner else C._add_batch_dim(below, C.maybe_get_bdim(t), level)
    below = _batched_at(t, levels[:-1])
    if not widen:
        return below
    return C._add_batch_dim(below.expand(size, *below.shape), 0, level)


def distinct_objects(closed: list, inputs: list) -> list:
    """The tensors the region closes over as the Function gets them (``closed``), each an object of its own
    below every wrapper.  A weight closed over and the argument a transform made of it (``grad(f)(u)``, ``f``
    closing over ``u`` that an outer level or eager autograd differentiates) reach the Function as one tensor
    once unwrapped, at the transform's level and below: the tape read both as that tensor, so a replay took
    the closed-over one for the argument (``u * w`` differentiated as ``w * w``: 0.90 off under ``grad`` of
    ``grad`` and eager autograd around ``grad``), and one returned as is became the argument (67.9 off).  Such
    a tensor is handed over as a view of itself, made at the caller's levels (an op of an enclosing region).
    Not under forward mode (the caller's choice): there, with a region nested in this one closing over the
    tensor too, the gradient and its tangent came out doubled (``jvp`` of ``grad``; found by a hostile pass,
    cause not found); ``jvp``, ``jacfwd`` and ``hessian`` of ``grad`` measure exact without it."""
    bottoms = {id(unwrap_all(t)) for t in inputs}
    out = list(closed)
    for j, t in enumerate(closed):
        b = id(unwrap_all(t))
        if b in bottoms:
            out[j] = t.view_as(t)
        bottoms.add(b)
    return out


def input_places(tape, outs, tensors) -> dict[int, int]:
    """``{i: j}``: the function's output ``i`` (``outs``, the forward level's) is the Function's input ``j``
    (``tensors``), or a view of it through the ops the tape recorded (views of inputs over one memory are
    told apart by what the function made them from, not by the memory: see :func:`distinct_objects`)."""
    place = {id(t): j for j, t in enumerate(tensors)}
    found = {}
    for i, t in enumerate(outs):
        if not isinstance(t, torch.Tensor):
            continue
        b = unwrap_all(t)
        j = place.get(id(b))
        v = tape.value_of(b) if j is None and tape is not None else None
        while v is not None and v.node >= 0:
            n = tape.nodes[v.node]
            v = n.reads[0] if n.func.is_view and n.reads else None
        if v is not None:
            j = place.get(id(v.t))
        if j is not None:
            found[i] = j
    return found
