"""Backward from the forward level's own graph, on the ``torch.func`` path.

The region's forward runs under a ``vjp`` level of its own (see
:mod:`remat_fn._path_torch_func`).  Where backward can, it differentiates that
level's graph instead of running the function again: what the graph saves is a
handle of the shared :class:`~remat_fn._frame.Frame` (:class:`KeepHandles`),
which the tape replays below every functorch transform (:class:`Unpack`), so the
function's Python runs once, as in eager mode.  The graph's outputs are private
aliases whose memory the Function's outputs take (:func:`release_outputs`).
:func:`outside_reach` tells what outside may differentiate a backward;
:func:`saved_storages` what a graph saved, where no hook can tell.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from ._func_semantics import ForwardHook
from ._functorch import batch_layers, forward_mode_active, grad_wrappers, is_grad_kind, live_levels, rebatch, unwrap_all
from ._offload_buffers import quiet
from ._torch_internals import DisableFuncTorch, dispatch_stack_len, function_class, function_mode_enabled, is_view, saved_tensor_attrs
from .memory import storage_released

__all__ = ["KeepHandles", "Unpack", "alias_output", "release_outputs", "from_graph", "note_storage",
           "saved_storages", "outside_reach", "foreign_functions", "unread_inputs"]


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


def release_outputs(douts) -> tuple:
    """The kept graph holds its level's outputs (private aliases, made in the forward's
    ``f``), which autograd never reads: each gives its storage to a detached alias that
    the Function returns (else its node, on what it returns, would hold itself) and
    keeps a one-element stand-in of the same shape, so the graph holds no output's
    memory (a region's output is freed when the caller lets it go, as in plain code)."""
    out = []
    for t in douts:
        out.append(t.detach())  # (an enclosing region's tape records it: its replay makes it)
        t = unwrap_all(t)  # (under vmap: the batched tensor below the wrappers)
        if t.numel() and t.layout == torch.strided and not is_view(t):
            # (bookkeeping, no op of any region: modes stepped aside where there are any)
            with quiet() if dispatch_stack_len() or function_mode_enabled() else _NULL, DisableFuncTorch():
                one = torch.empty(1, dtype=t.dtype, device=t.device)
                t.set_(one.untyped_storage(), 0, t.shape, (0,) * t.dim())
            storage_released(t)  # (for LiveBytes, which no set_ reaches)
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
    for i in wrt:
        k = where.get(i)
        if k is not None:
            result[i + 1] = gin[k]
    return tuple(result)


def note_storage(found: dict[int, int], t: torch.Tensor) -> None:
    try:
        st = unwrap_all(t).untyped_storage()
        found.setdefault(st.data_ptr(), st.nbytes())
    except (RuntimeError, NotImplementedError):  # (no storage, or a wrapper subclass's)
        return


def outside_reach(saved, grads) -> tuple[bool, bool, bool]:
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
    """
    if not torch.is_grad_enabled():
        return False, False, False  # already not recording; nothing to gain
    if forward_mode_active():
        # a live jvp level differentiates it too, wrapping the saved tensors or not: under
        # no_grad torch's backward formulas take branches with no tangent (solve, logdet) or
        # kernels forward AD lacks (silu_backward)
        return False, False, False
    live = live_levels()
    wrappers = []
    tracked = [False, False]
    for k, group in enumerate((saved, grads)):
        for t in group:
            if isinstance(t, torch.Tensor):
                ws, base = grad_wrappers(t)
                tracked[k] = tracked[k] or base.requires_grad
                wrappers.extend(ws)
    if not wrappers:
        return False, *tracked
    alive = [lv for lv, dead in wrappers if not dead and is_grad_kind(live.get(lv))]
    if any(dead for _, dead in wrappers):
        return not alive, *tracked
    this = max(lv for lv, _ in wrappers)
    return all(lv == this for lv in alive), *tracked


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
