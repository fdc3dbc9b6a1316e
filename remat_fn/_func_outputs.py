"""Outputs of the ``torch.func`` path's Function that alias an input or each other.

A custom ``autograd.Function``'s outputs are new tensors to autograd, whatever memory
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

import torch

from ._func_graph import alias_output
from ._functorch import C, storage_ptr, unwrap_all, vmap_levels, vmap_sizes
from ._torch_internals import is_view

__all__ = ["alias_map", "rebuild", "returned", "batched_outputs"]


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


def alias_map(outs, tensors, diff) -> dict[int, tuple]:
    """``{i: (kind, j, size, stride, offset)}``: output ``i`` is a view of input ``j``
    (``kind == "in"``) or of output ``j`` (``"out"``).  ``diff``: which outputs are
    differentiable (a view of another output is rebuilt only where both agree)."""
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
        j = next((j for j in storages.get(p, ()) if _covers(tensors[j], o)), None)
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
