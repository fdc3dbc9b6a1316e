"""Threading closed-over tensors through the ``torch.func`` path.

Under ``torch.func`` the region runs inside an ``autograd.Function`` whose
inputs are fixed when it is applied.  A tensor the function closes over (see
:mod:`remat_fn._closures`) is not an input, so without care its gradient is
silently dropped.  The path passes the ones that need a gradient as extra
inputs, and :class:`CaptureMode` (a ``TorchFunctionMode`` keyed by object
identity) substitutes them by the tensors the ``autograd.Function`` received.
It stops the forward as soon as an op touches a gradient-carrying tensor that
is neither an input, a captured tensor nor made inside the region
(:class:`MissedCapture`), so the caller can thread it and run again.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ._ambient import AMBIENT
from ._capture_ops import ONLY_CPP, ONLY_PY, Produced, carry_grad, in_place, write_below
from ._debug import CallTrace
from ._describe import call_meta, describe, user_frame
from ._errors import mutated_input
from ._function_steps import forward_below, function_steps, invisible
from ._functorch import (
    batched_first,
    carries_grad,
    current_level,
    from_lowered_level,
    grad_mode_at,
    is_vmap_kind,
    is_wrapped,
    needs_grad,
    requires_grad_anywhere,
    storage_ptr,
    transform_autograd,
    transforms_active,
    unwrap_all,
    unwrap_one,
)
from ._hook_targets import REDIRECTED, no_hook, redirect_hook
from ._ops import untracked_stats
from ._record import recording_tapes
from ._region import as_caller, region_depth
from ._torch_internals import (
    DisableTorchFunction,
    custom_function_call,
    use_count,
)
from ._unseen import note_alias

__all__ = ["CaptureMode", "Known", "MissedCapture", "first_run_of_nested", "innermost_kind", "logical_around", "nested_in_forward",
           "note_region_inputs", "refs_counted", "note_region_outputs", "substituted", "swap_view_of", "swap_side_output", "watched"]

_NULL = contextlib.nullcontext()


def note_region_inputs(tensors, holder) -> None:
    """A region nested in a forward keeps these tensors (the tensors it closes over)
    for its backward: ``holder.refs_to(t, cells)`` counts the Python references to ``t``
    it holds after the enclosing forward (see :meth:`CaptureMode.escaped`)."""
    for mode in AMBIENT.captures:
        if mode.made is not None:
            for t in tensors:
                mode.held.setdefault(id(t), []).append(holder)


def substituted(tensors: list) -> list:
    """``tensors`` (a nested region's arguments and the tensors it closes over) as the
    enclosing regions' torch calls see them: a tensor an enclosing region closes over,
    replaced as its :class:`CaptureMode` replaces it in each op (innermost first, as
    each mode hands the call to the next).  A region call goes through no torch
    function: without this, a nested region given a tensor its enclosing region closes
    over (a weight passed on to it) would get the caller's object, which the enclosing
    region's recomputation does not differentiate."""
    done = [False] * len(tensors)  # (replaced by an inner mode: its value, not the outer ones' to replace)
    for mode in reversed(AMBIENT.captures):
        if mode.subst or mode.levels is not None:
            was, done = done, [d or id(t) in mode.subst for t, d in zip(tensors, done)]
            tensors = [mode._fix(t) if d and not w else mode._set_aside(t) for t, d, w in zip(tensors, done, was)]
    return tensors


def nested_in_forward() -> bool:
    """An enclosing region's forward is being recorded on the torch.func path (its
    side-output check will count the Python references to what this call keeps)."""
    return any(mode.made is not None for mode in AMBIENT.captures)


def refs_counted() -> bool:
    """An enclosing region counts the Python references to what this call keeps: its forward
    (side outputs, inputs it stores) or its jvp rule's run again (inputs that run stores)."""
    return any(mode.made is not None or mode.counts_inputs for mode in AMBIENT.captures)


def watched(own: int) -> int:
    """What a forward watches for side outputs (``CaptureMode.every``, see ``_leaves``): ``own``,
    or what an enclosing region's forward watches (a side output of this call is one of its)."""
    return max([own, *(mode.every for mode in AMBIENT.captures if mode.made is not None)])


def swap_side_output(t: torch.Tensor, o: torch.Tensor) -> None:
    """``torch.utils.swap_tensors(t, o)``, where the enclosing regions know ``t`` or ``o`` (by a
    weak reference, which the swap refuses): set aside for the swap, known again after it."""
    held = [(k, [x for x in (t, o) if x in k]) for m in AMBIENT.captures if (k := m.known) is not None]
    for m in AMBIENT.captures:  # (a region nested in theirs swaps: a run again runs it, see remat_fn._logical)
        if m.logical is not None:
            m.logical.fail()
    for k, xs in held:
        for x in xs:
            k.discard(x)
    try:
        torch.utils.swap_tensors(t, o)
    finally:
        for k, xs in held:
            k.update(xs)


def swap_view_of(t: torch.Tensor, x: torch.Tensor, counted: bool = True) -> None:
    """``t``, held by the caller's objects, is a wrapper of the Function's levels (dead after it): an
    input the function stored, or what a run again of the function stored there (see
    RegionState.rerun_objs).  The object takes a view of the caller's ``x`` (plain code stores ``x``
    itself), made as the caller's ops are: an enclosing region's forward records the view, and sees
    the object as the tensor it made.  ``counted``: an enclosing region counts the view among its calls
    (not for what the jvp rule's run again stored: that rule runs where forward mode reaches the call,
    in an enclosing region's run again but not in its forward, which unwraps that level)."""
    mode = AMBIENT.captures[-1] if AMBIENT.captures else None
    with as_caller if counted else _NULL:  # (the caller's op, as an enclosing region's forward sees it)
        v = x.view_as(x)
    made = mode.made if mode is not None else None
    at = [k for k, e in enumerate(made) if e[2]() is v] if made else []
    entries = [made.pop(k)[:2] for k in reversed(at)] if made else []  # (a weak reference refuses the swap)
    swap_side_output(t, v)
    for call, pos in entries:
        made.append((call, pos, weakref.ref(t)))  # type: ignore[union-attr]
    if mode is not None:  # (t holds what v held: a run again grabs it, see _made and _stands_for)
        for d in (mode.subst, mode.grabbed):
            d.update({k: t for k, r in d.items() if r is v})


def note_region_outputs(tensors, first=None, foreign=None, logical=None) -> None:
    """A nested region returned these tensors: for the enclosing region's :class:`CaptureMode` the call is
    one torch call that made them (no torch function sees the ``autograd.Function`` that produced them).
    ``first``: its side outputs as the caller holds them, and its nested regions' (see CaptureMode.first);
    ``foreign``: what it did that no replay stands for (``.data``, ``detach_``, a hook, autograd inside);
    ``logical``: ``(inputs, n_out, its logical tape, options, name, grad mode, runner)`` where the enclosing
    region records one (see LogicalTape.region)."""
    stack = AMBIENT.captures
    if stack:
        stack[-1].region_call(tensors, first, foreign, logical)


def innermost_kind(levels: dict | None):
    """The innermost transform plain code would run a region's function under, called now at ``levels``: the
    innermost of them an enclosing region's function made (a vmap inside it), or where none, that region's
    (its own level, under which its function runs, stands for none: the transforms its call set aside do)."""
    stack = AMBIENT.captures
    enc = stack[-1] if stack else None
    above = [lv for lv in levels or () if enc is None or lv > enc.base]
    if above:
        return levels[max(above)]  # type: ignore[index]
    return enc.inner_kind if enc is not None else None


def logical_around() -> bool:
    """The region being called is nested in one whose forward records its torch calls (see remat_fn._logical):
    it records its own, which stand for its function in a replay of the enclosing one."""
    stack = AMBIENT.captures
    return bool(stack) and stack[-1].logical is not None and region_depth() == stack[-1].depth + 1


def first_run_of_nested() -> tuple[list, dict | None]:
    """For a region starting its forward inside an enclosing region that runs again: its
    ``late`` and ``first`` (see :class:`CaptureMode`), as its first run left them (nothing
    elsewhere)."""
    stack = AMBIENT.captures
    mode = stack[-1] if stack else None
    if mode is None or not mode.first or region_depth() != mode.depth + 1:
        return [], None
    return mode.first.get(mode.calls, ([], None))


class Known:
    """The tensors a region may use freely, by identity.  Kept by ``id`` with a weak reference:
    the id of a tensor that died inside the region comes back for a new tensor (a view
    ``as_subclass`` made, which must be noted as one), and must not make it known."""

    __slots__ = ("_refs",)

    def __init__(self, tensors=()):
        self._refs = {id(t): weakref.ref(t) for t in tensors}

    def __contains__(self, t: torch.Tensor) -> bool:
        r = self._refs.get(id(t))
        return r is not None and r() is t

    def add(self, t: torch.Tensor) -> None:
        self._refs[id(t)] = weakref.ref(t)

    def update(self, tensors) -> None:
        for t in tensors:
            self._refs[id(t)] = weakref.ref(t)

    def discard(self, t: torch.Tensor) -> None:
        self._refs.pop(id(t), None)

    def clear(self) -> None:
        """Forget them (a tensor with a weak reference cannot be swapped, see :meth:`CaptureMode.escaped`)."""
        self._refs.clear()

    def ids(self) -> frozenset[int]:
        """The ids of the known tensors alive now."""
        return frozenset(i for i, r in self._refs.items() if r() is not None)


class MissedCapture(Exception):
    """Internal: the forward touched a gradient-carrying tensor nobody threaded.  ``bypassed``: a tensor it closes over, threaded,
    read where no torch function sees it (``torch.func.grad(g)(w)`` wraps ``w`` itself): the forward runs again with the
    replacements in the closure's places (:attr:`RegionState.relocate`).  ``plain``: see ``_related``."""

    def __init__(self, tensor: torch.Tensor | None, bypassed: bool = False, plain: int | None = None):
        super().__init__(describe(tensor) if tensor is not None else "related inputs")
        self.tensor, self.bypassed, self.plain = tensor, bypassed, plain


class CaptureMode(TorchFunctionMode):
    """Replace captured tensors by identity; optionally police unknown ones.

    Args:
        subst: ``id(original) -> replacement``.
        known: the tensors that may be used freely (:class:`Known`: the region's inputs); tensors produced
            inside the region are added as they appear.  ``None`` disables the safety net (a recomputation).
        trace: the forward's call trace (a list the forward fills, ``where``: with user source
            lines), or a recomputation's :class:`CallTrace` checking it.
        name: the region's name, for error messages.
        inputs: the region's input tensors as the function receives them: an in-place op on one of them,
            or on a view of one, is refused before it writes (recomputing would apply it twice).
        grab: ``{call index: tensor positions}`` of a recomputation: the tensors those calls produce are
            collected in :attr:`grabbed` (the values that left the forward by a side channel, see :meth:`escaped`).
        late: ``(caller's object, (call index, position))`` of the objects holding the
            values that left the first run by a side channel: a run again that reads
            one (``side[0]``, appended earlier in the same run) reads the value it made
            instead.  Also a nested region's forward inside a run again of the region
            enclosing it (see :func:`first_run_of_nested`).
        first: for a run again, ``{call index: (late, first)}`` of the regions nested
            in the first run, which their fresh forwards in this run read.

    In the forward (``known`` given) every tensor a call produces that
    requires grad is remembered by weak reference and call index, so that
    after the function returned :meth:`escaped` tells which of them are still
    alive outside the region: stored in a list, a module attribute or a hook's
    collection (Hugging Face records attentions that way).
    """

    def __init__(self, subst: dict[int, torch.Tensor], known: Known | None,
                 trace: CallTrace | list | None = None, name: str = "fn",
                 produced: set[int] | None = None, inputs: list[torch.Tensor] = (),
                 grab: dict[int, list[int]] | None = None, late=(),
                 first: dict | None = None):
        super().__init__()
        # storages the region's own aten ops made (on a retry, by a dispatch mode below every level): made inside
        self.produced = produced
        self._recorder = Produced(produced) if produced is not None else None
        self.subst = subst
        self.threaded = frozenset(subst)  # the caller's objects its replacements stand for
        self.known = known
        self.hits: set[int] = set()
        self.trace = trace
        self.where = False
        self.name = name
        self.depth = region_depth()
        # (the functorch level the function is called at: a transform it calls itself sits above)
        self.base = current_level()
        self.inner_kind = None  # (the innermost transform plain code would run the function under: see innermost_kind)
        # the region's inputs (and their replacements), which it must not modify
        self.inputs = known.ids() | {id(r) for r in subst.values()} if known is not None else None
        self.input_storages = {p for t in (*inputs, *subst.values()) if (p := storage_ptr(t)) is not None}
        # (an input's own tensor below its level's wrapper, read as a constant: see aliased)
        self.bases, self.aliased = {id(b) for t in inputs if (b := unwrap_all(t)) is not t}, False
        self.calls = 0  # torch calls of this region (not of nested regions), in order
        self.made: list[tuple[int, int, weakref.ref]] | None = [] if known is not None else None
        self.grab = grab
        self.grabbed: dict[tuple[int, int], torch.Tensor] = {}
        self.late: dict[tuple[int, int], list[int]] = {}
        for o, at in late:
            self.late.setdefault(at, []).append(id(o))
        self.first = first
        # in a forward: what the regions nested in it hand a run again of it (see first)
        self.nested: dict[int, tuple] = {}
        self.held: dict[int, list] = {}  # see note_region_inputs
        self.levels: dict | None = None  # where the region was called (set aside in its Function's forward: see needs_grad)
        self.opaque = False  # the function read or wrote ``.data``: an alias no aten op makes (no replay, see _replay_live)
        self.autograd = False  # it called autograd (itself, or a torch.func transform it calls): see RegionState.foreign
        self.every, self.fwd_only = 0, set()  # (see _leaves, untracked_stats)
        self.counts_inputs = False  # a run again that looks for the inputs it stores (see refs_counted)
        self.tape = None  # the region's own tape, in its forward (see _made_inside)
        self.logical = None  # the forward's torch calls, where recorded (see remat_fn._logical)
        self.hook_on, self.hooked = None, []  # (see hooks_from; the handles of the hooks put on the caller's tensors, remat_fn._hook_targets)

    def _fix(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            r = self.subst.get(id(x))
            if r is not None:
                if self._replaced_inside(x):  # (an inner region's value, left alone)
                    return x
                self.hits.add(id(x))
                return r
            known = self.known
            if self.levels is not None and from_lowered_level(x) and not needs_grad(x, self.levels):
                # a constant wrapped at a level set aside here (a BatchNorm's statistics under grad of grad, known once an in-place
                # write returned it): the plain tensor below, as plain code reads it
                return unwrap_all(x)
            if id(x) in self.bases:  # (the function closes over the tensor it is given, differentiated, as a constant:
                self.aliased = True  # the tape sees one tensor, which a replay would differentiate at both reads)
            if known is not None and x not in known and not self._inner(x):
                a = self._alias_of_known(x)
                if a is not None:
                    return a
                # (a view of a tensor it closes over that a transform it calls made, unseen, torch.func.vmap returning it: runs again)
                unseen = (p := storage_ptr(x)) is not None and any(storage_ptr(r) == p for r in self.subst.values())
                if (unseen or not self._made_inside(x)) and needs_grad(x, self.levels):
                    raise MissedCapture(x, bypassed=unseen)
            return x
        tx = type(x)
        if tx is tuple or tx is list:
            return tx([self._fix(v) for v in x])
        if isinstance(x, tuple) and hasattr(tx, "n_fields"):  # torch.return_types
            return tx(tuple(self._fix(v) for v in x))
        if tx is dict:
            return {k: self._fix(v) for k, v in x.items()}
        return x

    def _replaced_inside(self, x: torch.Tensor) -> bool:
        """``x`` is the replacement a region nested in this one's forward made of a tensor this one replaces, the same
        object (its Function's forward sees its input unwrapped): that region's value, not this one's to replace."""
        for mode in reversed(AMBIENT.captures):
            if mode is self or any(v is x for v in mode.subst.values()):
                return mode is not self
        return False

    def _set_aside(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` given to a region nested in this one's forward (see :func:`substituted`): a
        constant wrapped at a level set aside here, as this region's ops read it (:meth:`_fix`)."""
        if (self.known is not None and self.levels is not None and from_lowered_level(x)
                and not needs_grad(x, self.levels)):
            return unwrap_all(x)
        return x

    def _inner(self, x: torch.Tensor) -> bool:
        """True for a wrapper made inside the region (by ``torch.func.grad`` or
        ``vmap`` called by the function) around a tensor the region knows."""
        t = x
        while is_wrapped(t):
            t = unwrap_one(t)
            if id(t) in self.threaded:  # (the tensor itself, not its replacement: see MissedCapture)
                raise MissedCapture(t, bypassed=True)
            if t in self.known or id(t) in self.subst:
                self.known.add(x)
                return True
        return False

    def _alias_of_known(self, x: torch.Tensor):
        """``x``, unknown: a view of a tensor the region knows (or made), made where no torch
        function mode sees it (``as_subclass``), is that tensor's view: known, and the recording
        tapes are told (returns ``x``); a view of a captured tensor, that view of its replacement
        (returned, known).  Anything else: None (a tensor from outside, or not yet threaded)."""
        b = x._base
        if b is None or b.dtype != x.dtype or (b.is_conj(), b.is_neg()) != (x.is_conj(), x.is_neg()):
            return None
        r = self.subst.get(id(b))
        if r is None and b not in self.known and not self._inner(b) and not self._made_inside(b):
            return None
        if r is not None:  # (torch calls inside a mode's handler skip the mode: the tapes record this one)
            if r.storage_offset() != b.storage_offset():
                return None
            r = torch.as_strided(r, x.size(), x.stride(), x.storage_offset())
            b, x = r, torch.Tensor.as_subclass(r, type(x)) if type(x) is not torch.Tensor else r
            if x is r:
                return x
        self.known.add(x)
        px, pb = unwrap_all(x), unwrap_all(b)
        for tape in recording_tapes():
            if tape.reg is not None and tape.value_of(px) is None:
                note_alias(tape, px, pb)
        return x

    def _made_inside(self, x: torch.Tensor) -> bool:
        if self.produced is None:  # (what the region's own tape saw its ops make in its forward: a vmap's output)
            made = self.tape is not None and self.tape.value_of(unwrap_all(x)) is not None
        else:
            made = (ptr := storage_ptr(x)) is not None and ptr in self.produced
        if made:
            self.known.add(x)
        return made

    def __enter__(self):
        if self._recorder is not None:
            self._recorder.__enter__()
        AMBIENT.captures.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            AMBIENT.captures.pop()
            if self._recorder is not None:
                self._recorder.__exit__(*exc)

    def _note(self, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            self.known.add(out)
        elif isinstance(out, (tuple, list)):  # also torch.return_types and namedtuples
            for o in out:
                self._note(o)

    def escaped(self, outs) -> list[tuple[tuple[int, int], torch.Tensor]]:
        """The tensors the forward made that require grad and are still alive beyond
        ``outs`` (held by the caller): they left the region by a side channel.  Returns
        ``((call index, position), tensor)`` pairs and forgets the weak refs
        (a tensor with weak references cannot be swapped, see
        :func:`torch.utils.swap_tensors`)."""
        made, self.made = self.made or [], None
        if self.known is not None:
            self.known.clear()
        # (an output the caller also keeps, ``side.append(h); return h``, is a side output too: its object takes a Function output's content)
        in_outs = collections.Counter(id(o) for o in outs)
        seen: set[int] = set()
        found = []
        with DisableTorchFunction():
            for call, pos, ref in made:
                t = ref()
                if t is None or id(t) in seen or not self._leaves(t):
                    continue
                # Held by Python beyond what remat's own objects hold (``outs``, a nested region's tables of the tensors it
                # closes over): it left by a side channel.  (One autograd holds and nothing in Python does, did not.)
                holders, own = self.held.get(id(t)), in_outs.get(id(t), 0)
                if holders:
                    cells: set = set()
                    own += sum(h.refs_to(t, cells) for h in holders) + len(cells)
                if sys.getrefcount(t) - own > (ONLY_CPP if use_count(t) > 1 else ONLY_PY):
                    seen.add(id(t))
                    found.append(((call, pos), t))
        del made
        return found

    def _made_tensors(self, out, args) -> list[tuple[int, torch.Tensor]]:
        if isinstance(out, torch.Tensor):  # (most calls: one tensor, not an argument returned)
            return [] if any(out is a for a in args) else [(0, out)]
        if not isinstance(out, (tuple, list)):
            return []
        leaves = [o for o in out if isinstance(o, torch.Tensor)]
        arg_ids = {id(a) for a in args if isinstance(a, torch.Tensor)}
        return [(i, t) for i, t in enumerate(leaves) if id(t) not in arg_ids]

    def region_call(self, outs, first=None, foreign=None, logical=None) -> None:
        """A region nested in this one returned ``outs`` (see note_region_outputs)."""
        if region_depth() != self.depth + 1:
            return
        # (a replay of this region would replay the nested one without what it did there: both run again; not where
        # the function called it under a transform of its own, whose backward this region's ops hold, hook included)
        if foreign and current_level() <= self.base:
            self.opaque, self.autograd = True, self.autograd or foreign == "autograd"
        if self.known is not None:
            self._note(outs)
            if first is not None:
                self.nested[self.calls] = first
        if self.logical is not None:
            if logical is None or first is not None or len(outs) != logical[1]:  # (side outputs: a run again finds them)
                self.logical.fail()
            else:
                self.logical.region(logical[0], *logical[2:])
                self.logical.made(list(outs))
        self._made(self.calls, outs, ())
        self.calls += 1

    def _leaves(self, t: torch.Tensor) -> bool:
        """``t`` would be wrong in the caller's hands if it left by a side channel: it carries
        a gradient, or (``every`` 1: under forward mode, where ``no_grad`` stops no tangent) any
        floating tensor, or (2: under ``vmap``, whose levels are set aside here) any tensor."""
        every = self.every
        if carries_grad(t):
            return True
        # (an inference tensor carries no tangent, and is never batched or swapped: plain code's too)
        return every > 0 and not t.is_inference() and (every == 2 or t.is_floating_point() or t.is_complex())

    def _made(self, call, out, args) -> None:
        made = self.made
        if made is not None:
            if isinstance(out, torch.Tensor):  # (most calls)
                if self._leaves(out) and not any(out is a for a in args):
                    made.append((call, 0, weakref.ref(out)))
            else:
                made.extend((call, i, weakref.ref(t)) for i, t in self._made_tensors(out, args)
                            if self._leaves(t))
            if self.late:  # (a nested region's forward in a run again: see first_run_of_nested)
                for i, t in self._made_tensors(out, args):
                    self._stands_for(call, i, t)
        elif self.grab is not None and call in self.grab:
            made = dict(self._made_tensors(out, args))
            for i in self.grab[call]:
                t = made.get(i)
                if t is None:  # (not this run's call: RegionState.call reports the mismatch)
                    continue
                self.grabbed[(call, i)] = t
                self._stands_for(call, i, t)

    def _stands_for(self, call: int, pos: int, t: torch.Tensor) -> None:
        """``t``, made at ``(call, pos)``, is read wherever this run reads a caller's object that
        held the first run's value there (``side[0]``, appended earlier in the same run: see ``late``)."""
        for obj in self.late.get((call, pos), ()):
            self.subst[obj] = t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        logical = self.logical  # (this region's own calls only: not those of a region nested in it)
        if logical is not None and region_depth() != self.depth:
            logical = None
        if func in _DATA:
            if func is _HOOK and ((self.known is None and not requires_grad_anywhere(args[0])) or (batched_first(args[0], self.base)
                                  and (current_level() > self.base or is_vmap_kind(self.inner_kind)))):
                # (a forward-mode recomputation, which differentiates nothing: the hook has nothing to act on; a tensor plain
                # code holds batched, where the innermost transform is a vmap (one the function entered itself, else the
                # call's, see innermost_kind): plain code's hook never fires on it; hostile passes)
                return no_hook()
            if func in REDIRECTED and (h := redirect_hook(self, func, args, kwargs))[0]:
                return h[1]
            if logical is not None:
                logical.fail()
            self.autograd = self.autograd or func in _AUTOGRAD
            if func is _GRAD and self.known is not None and self.hook_on and (owner := _related(self, args, kwargs)) is not None:
                raise MissedCapture(None, plain=owner)
            if not (func is _GRAD and transform_autograd(args, kwargs, self.base)):
                self.opaque = True
            if func == _DATA_GET and not is_wrapped(args[0]) and id(args[0]) in self.subst:  # (a tensor it closes over:
                return self._done(func, func(args[0]), args, None)  # as plain code reads it; one of its calls)
        if func in _METADATA:  # (reads no values: nothing to thread, whatever tensor it is)
            if logical is not None and func in _ALIASES:
                logical.fail()
            return func(*[self.subst.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in args], **(kwargs or {}))
        given = args[0] if args else None  # (before _fix: a constant of a level set aside, unwrapped there)
        if logical is not None:  # (as the function passed them: its replay passes them so again)
            logical.note(func, args, kwargs)
        args = self._fix(args)
        kwargs = self._fix(kwargs) if kwargs else {}
        out = None
        if args and in_place(func) and isinstance(a0 := args[0], torch.Tensor):
            inputs = self.inputs
            if (inputs is not None and id(a0) in inputs) or (self.input_storages and storage_ptr(a0) in self.input_storages):
                raise mutated_input(self.name, a0)
            if isinstance(given, torch.Tensor) and given is not a0 and from_lowered_level(given):
                a0 = given
            # (or a plain constant under the region's own level: a buffer an enclosing region
            # was given, num_batches_tracked.add_(1), which plain code writes at its level)
            if (from_lowered_level(a0) or (self.levels is not None and not is_wrapped(a0) and not a0.requires_grad
                                           and transforms_active())) and not carry_grad(args, kwargs):
                out = write_below(func, a0, args, kwargs)
        if out is None:
            if self.fwd_only:
                args, kwargs = untracked_stats(func, args, kwargs, self.fwd_only)
            grad = AMBIENT.call_grad
            # (what the tape records, see call_grad_mode: under a torch.func transform it calls, as its ops reach this level)
            AMBIENT.call_grad = grad_mode_at(self.base)
            try:
                if func is custom_function_call and invisible(args[0], self.levels):  # (under no_grad)
                    out = forward_below(args, kwargs)
                elif func is custom_function_call and self.known is not None and region_depth() == self.depth:
                    out = function_steps(func, args, kwargs)
                else:
                    out = func(*args, **kwargs)
            finally:
                AMBIENT.call_grad = grad
        return self._done(func, out, args, logical)

    def hooks_from(self, given: list, callers, captured: list, n: int) -> None:
        """``hook_on``: the function's inputs (arguments, closed-over replacements) -> the caller's objects (None: a run again)."""
        self.hook_on = dict(zip(map(id, given), [*(callers or [None] * n), *(captured if callers else [None] * len(captured))]))

    def _done(self, func, out, args, logical):
        """The call ``func(*args)`` returned ``out``: known, counted, traced (in both runs alike)."""
        if self.known is not None:
            self._note(out)
        if region_depth() == self.depth:
            call = self.calls
            self.calls = call + 1
            self._made(call, out, args)
            trace = self.trace
            if trace is not None:
                if self.known is None:
                    trace.step(func, out, self.name)
                elif (meta := call_meta(out)) is not None:
                    trace.append((func, meta, user_frame() if self.where else None))
            if logical is not None:
                if func is custom_function_call:  # (a nested region, a custom Function: Python of their own, which
                    logical.fail()  # reads what a replay cannot hand it as the forward did; a run again runs them)
                else:
                    logical.made(out)
        return out


def _related(mode, args, kwargs, limit: int = 20_000) -> int | None:
    """``torch.autograd.grad(y, x)`` in a forward, another input depending on input ``x`` in the caller's graph (``f(Y, Y[:])``,
    a tied weight; the region's leaves cut that path: half of plain's, silently, a hostile pass): the depth of the region
    whose inputs are so related (or an enclosing one's, ``x`` an input of each between), whose call runs as plain code."""
    targets = kwargs["inputs"] if kwargs and "inputs" in kwargs else args[1] if len(args) > 1 else ()
    targets = [targets] if isinstance(targets, torch.Tensor) else list(targets)
    chain = AMBIENT.captures[: AMBIENT.captures.index(mode) + 1] if mode in AMBIENT.captures else [mode]
    for m in reversed(chain):  # (a tensor it closes over is read as the caller's object here, before _fix)
        callers = {id(c): c for c in (m.hook_on or {}).values() if isinstance(c, torch.Tensor)}
        targets = [t for x in targets if isinstance(t := (m.hook_on or {}).get(id(x), callers.get(id(x))), torch.Tensor)]
        if any(_reaches(c, t, limit) for t in targets for c in callers.values() if c is not t):
            return m.depth
    return None


def _reaches(t: torch.Tensor, target: torch.Tensor, limit: int) -> bool:
    tnode, stack, seen = target.grad_fn, [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        if node is tnode or (tnode is None and getattr(node, "variable", None) is target) or len(seen) > limit:
            return True
        seen.add(id(node))
        stack.extend(n for n, _ in node.next_functions)
    return False


# what the tape cannot replay (no op reaches the dispatcher, or none that says it): ``.data`` (an alias without autograd),
# a hook on a tensor (backward code, not an op), ``detach_`` (below autograd an out-of-place ``detach`` nothing reads),
# autograd called inside (its backward's ops, recorded, are not the graph an outer level differentiates; but a torch.func
# transform's own, which builds a graph, is: see transform_autograd): where something outside differentiates the
# region's backward, the function runs again instead (spec.foreign)
_HOOK, _DATA_GET, _GRAD = torch.Tensor.register_hook, torch.Tensor.data.__get__, torch.autograd.grad
_AUTOGRAD = frozenset({torch.autograd.grad, torch.autograd.backward})
_DATA = frozenset({torch.Tensor.data.__get__, torch.Tensor.data.__set__, _HOOK,
                   torch.Tensor.register_post_accumulate_grad_hook, torch.Tensor.detach_}) | _AUTOGRAD


_T = torch.Tensor
_ALIASES = frozenset({_T._base.__get__, _T.untyped_storage})  # (what a logical tape cannot find again)
_METADATA = frozenset({_T.requires_grad.__get__, _T.grad_fn.__get__, _T.is_leaf.__get__, _T._base.__get__,
                       _T.shape.__get__, _T.dtype.__get__, _T.device.__get__, _T.layout.__get__, _T.ndim.__get__,
                       _T.size, _T.dim, _T.stride, _T.numel, _T.storage_offset, _T.is_floating_point,
                       _T.is_complex, _T.is_contiguous, _T.data_ptr, _T.untyped_storage})
