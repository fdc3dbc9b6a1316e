"""One home for what the library needs to know about ``torch.func`` (functorch).

``torch.func`` transforms wrap tensors level by level (``GradTrackingTensor``,
``BatchedTensor``) and keep a stack of active interpreters.  The library looks
below the wrappers (storages, version counters, values to keep), asks which
transforms are active (forward mode changes what can be replayed), and which
grad levels a tensor belongs to; all of that goes through the helpers here
rather than through ``torch._C._functorch`` at each use.
"""

from __future__ import annotations

import torch

from ._torch_internals import (
    DisableFuncTorch,
    DisableTorchDispatch,
    DisableTorchFunction,
    forward_ad_level,
    functorch,
    functorch_active,
    inplace_requires_grad,
    is_view,
)

__all__ = [
    "C", "transforms_active", "transform_stack", "transform_kinds", "is_wrapped", "unwrap_one",
    "unwrap_all", "version_alias",
    "storage_ptr", "needs_grad", "grad_wrappers", "live_levels", "is_grad_kind", "unwrap_if_dead", "grad_tops", "as_given", "rewrapped",
    "differentiable_at_top", "without_level",
    "forward_mode_active", "forward_mode_at", "nested_forward_mode", "carries_grad", "any_batched", "batched_first", "from_lowered_level",
    "requires_grad_anywhere", "outside_innermost",
    "wrapped_innermost", "is_vmap_kind", "is_jvp_kind", "vmap_sizes", "vmap_levels", "differentiated_outside_vmaps",
    "draws_batched", "batch_layers", "apart_inputs", "rebatch", "sum_levels", "grad_on_top", "vmaps_outermost", "current_level", "grad_mode_at",
    "transform_autograd", "above_vmaps", "jvp_innermost",
    "wrap_at_top", "differentiable", "peel_vmaps", "to_physical", "from_physical",
]

C = functorch  # the C++ functorch bindings (checked in remat_fn._torch_internals)
_JVP = C.TransformType.Jvp
_GRAD = C.TransformType.Grad

transforms_active = functorch_active
is_wrapped = C.is_functorch_wrapped_tensor
unwrap_one = C.get_unwrapped  # one level


def unwrap_if_dead(t: torch.Tensor) -> torch.Tensor:
    """``t`` without the wrappers of transforms that have exited (a tensor left over from an
    earlier ``grad``, kept in a list: wrappers of dead levels around a live one), as
    functorch's ops read it.  ``unwrap_if_dead`` of torch strips one."""
    while C.is_functorch_wrapped_tensor(t) and C.is_dead_tensor_wrapper(t):
        t = C.get_unwrapped(t)
    return t


def transform_autograd(args: tuple, kwargs: dict | None, base: int) -> bool:
    """``torch.autograd.grad(*args, **kwargs)`` is a ``torch.func`` transform's, one the region (at
    functorch level ``base``) calls, building a graph: inside the transform's level, or its
    ``vjp_fn`` called after the level exited (the outputs dead wrappers).  Its backward ops then
    reach the region's level as ops of its graph, which a replay of the tape differentiates alike."""
    if not (kwargs or {}).get("create_graph", len(args) > 4 and args[4]):
        return False
    if current_level() > base:
        return True
    outs = args[0] if args else (kwargs or {}).get("outputs")
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return any(isinstance(t, torch.Tensor) and C.is_functorch_wrapped_tensor(t) and C.is_dead_tensor_wrapper(t) for t in outs)


def transform_stack() -> list:
    """The active functorch interpreters, outermost first (empty outside transforms)."""
    return list(C.get_interpreter_stack() or ())


def transform_kinds() -> tuple[str, ...]:
    """The kinds of the active transforms (``"TransformType.Grad"``, ...), outermost first."""
    return tuple(str(i.key()) for i in transform_stack())


def unwrap_all(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor below every functorch wrapper around ``t``."""
    while C.is_functorch_wrapped_tensor(t):
        t = C.get_unwrapped(t)
    return t


def version_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor sharing ``t``'s version counter (and storage) that is not ``t``'s Python
    object: the plain tensor below its wrappers, or an alias of a plain ``t`` that no
    mode or transform sees made.  Holding it keeps no Python reference to ``t``."""
    u = unwrap_all(t)
    if u is not t:
        return u
    with DisableTorchFunction(), DisableTorchDispatch(), DisableFuncTorch():
        return torch.Tensor.detach(t)


def storage_ptr(t: torch.Tensor) -> int | None:
    """The address of the storage behind ``t`` (below functorch wrappers); ``None``
    for a tensor without one (sparse, a wrapper whose level is live) or with an empty one."""
    try:
        st = unwrap_all(t).untyped_storage()
        # (every empty storage has data pointer 0: none of them is another's alias)
        return st.data_ptr() if st.nbytes() else None
    except (RuntimeError, NotImplementedError):  # (a wrapper subclass's storage has no data)
        return None


def needs_grad(t: torch.Tensor, levels: dict | None = None) -> bool:
    """True if some autograd level (functorch or eager) may want ``t``'s gradient.

    ``levels``: the transforms (``level -> kind``, see :func:`live_levels`) active
    where the region was called; inside a custom ``autograd.Function``'s forward
    torch sets those levels aside, and their wrappers are judged by them."""
    if not differentiable(t):
        return False
    t = unwrap_if_dead(t)  # left over from a transform that has exited
    if t.requires_grad:
        return True
    kinds = None
    while C.is_functorch_wrapped_tensor(t):
        if C.is_gradtrackingtensor(t):
            # A grad level differentiates what requires grad at its level: a tensor
            # passed or made there without it (a BatchNorm buffer given to
            # functional_call, a constant) is a constant to it.  A forward-mode
            # level's wrapper may carry a tangent.
            if kinds is None:
                kinds = live_levels() if levels is None else {**live_levels(), **levels}
            if kinds.get(C.maybe_get_level(t)) != _GRAD:
                return True
        t = C.get_unwrapped(t)
        if t.requires_grad:
            return True
    return False


def any_batched(t: torch.Tensor) -> bool:
    """True if a ``vmap`` level wraps ``t`` (at any depth)."""
    while C.is_functorch_wrapped_tensor(t):
        if C.is_batchedtensor(t):
            return True
        t = C.get_unwrapped(t)
    return False


def batched_first(t: torch.Tensor, skip: int) -> bool:
    """The first functorch wrapper of ``t`` other than those of level ``skip`` (the level a region runs its
    function under, its own) is a vmap's: plain code holds a batched tensor there."""
    while C.is_functorch_wrapped_tensor(t):
        if C.maybe_get_level(t) != skip:
            return bool(C.is_batchedtensor(t))
        t = C.get_unwrapped(t)
    return False


def batch_layers(t: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """The ``(level, bdim)`` of each ``vmap`` wrapper around ``t``, innermost first
    (other wrappers skipped)."""
    out = []
    while C.is_functorch_wrapped_tensor(t):
        if C.is_batchedtensor(t):
            out.append((C.maybe_get_level(t), C.maybe_get_bdim(t)))
        t = C.get_unwrapped(t)
    return tuple(reversed(out))


def apart_inputs(levels: dict, inputs) -> list[bool] | None:
    """Under a vmap outside a grad level (``vmap(grad(vmap(f)))``, ``levels``: where the region is
    called) whose examples' gradients stay apart: for each of the region's ``inputs``, whether it is
    batched at every such vmap level that batches any of them (a replay below those levels keeps
    its gradient apart too); None where no vmap batching them sits outside a grad level."""
    grads = [lv for lv, kind in levels.items() if not is_vmap_kind(kind)]
    if not grads:
        return None
    lays = [{lv for lv, _ in batch_layers(t)} for t in inputs]
    apart = {lv for s in lays for lv in s if lv < max(grads)}
    return [apart <= s for s in lays] if apart else None


def vmaps_outermost(levels: dict) -> bool:
    """Every active ``vmap`` sits outside every other active transform (``vmap(grad(f))``,
    per-sample gradients): the region's forward and its backward then run under the same
    vmap levels.  Otherwise (``grad(vmap(f))``, ``jvp(vmap(f))``, eager autograd around ``vmap(f)``)
    the Function runs under the vmap rule torch generates for it, its rules under vmap levels of
    their own."""
    kinds = [levels[k] for k in sorted(levels)]
    n = sum(1 for k in kinds if is_vmap_kind(k))
    return n < len(kinds) and all(is_vmap_kind(k) for k in kinds[:n])


def jvp_innermost(levels: dict | None) -> bool:
    """The innermost of the transforms active at a call (``levels``) is a ``jvp``: what ``.data``
    strips there (only that level's wrapper)."""
    return bool(levels) and is_jvp_kind(levels[max(levels)])


def outside_innermost(levels: dict | None, level: int) -> bool:
    """``level`` (where functorch applied the region's Function: it applies it at each level) lies outside
    the innermost differentiating level active at the call (``levels``): plain code's ``detach_``, ``.data``
    or hook inside acted at that innermost level alone (the levels outside differentiate through it)."""
    inner = [lv for lv, kind in (levels or {}).items() if not is_vmap_kind(kind)]
    return bool(inner) and level < max(inner)


def grad_tops(tensors) -> list[int]:
    """The level of each tensor's innermost grad-tracking wrapper (0: none), at a call."""
    return [max((lv for lv, _ in grad_wrappers(t)[0]), default=0) if isinstance(t, torch.Tensor) else 0 for t in tensors]


def wrapped_innermost(levels: dict | None, tops: list[int]) -> list[bool]:
    """Which tensors (their ``grad_tops`` at the call) the innermost differentiating level active at a call
    (``levels``) wraps: what its ``.data`` or ``detach_`` strips from them there (see :func:`outside_innermost`)."""
    top = max((lv for lv, kind in (levels or {}).items() if not is_vmap_kind(kind)), default=None)
    return [top is not None and lv == top for lv in tops]


def rewrapped(t):
    """``t``, an input the call's innermost grad level wrapped without differentiating it (``w`` in ``jacrev(f)(X, w)``,
    ``grad(f)(X, w)``: functorch wraps every argument), in a run again whose own vjp level stands for that level: wrapped
    there too, so that ``.data`` strips the run's wrapper, as plain code's strips the call's, and the levels outside
    differentiate through it.  Where the call's wrapper is gone (``jacrev``'s ``vjp_fn`` runs after its level exited)
    ``.data`` stripped the outer level's (2.2 off under ``grad`` around ``jacrev``); where it is alive, a region nested
    in the run saw ``w`` wrapped below the run's level, not at the innermost (9.8 off)."""
    return wrap_at_top(unwrap_if_dead(t)) if isinstance(t, torch.Tensor) and grad_on_top() else t


def without_level(t, level: int):
    """``t`` without its wrapper of grad ``level`` where that is its outermost one (None stays None)."""
    if t is not None and C.is_gradtrackingtensor(t) and C.maybe_get_level(t) == level:
        return C.get_unwrapped(t)
    return t


def differentiable_at_top(t):
    """``t`` wrapped at the innermost live transform, a grad level, requiring grad there (as ``torch.func.vjp`` makes its
    primals), for ``torch.autograd.grad`` of it inside a run again whose level stands for one that differentiated it."""
    if not grad_on_top():
        return t
    with inplace_requires_grad(True):
        return wrap_at_top(unwrap_if_dead(t)).requires_grad_()


def as_given(t: torch.Tensor | None, top: int) -> torch.Tensor | None:
    """A custom Function's saved input as plain code held it at the call (its innermost grad wrapper at level
    ``top``): functorch hands it back wrapped at the Function's level too, without a gradient, where the call's
    input had no wrapper of that level (a tensor the inner ``grad`` does not differentiate), so that ``.data`` or
    ``detach_`` in a run again stripped that wrapper instead of plain code's (4.8 off under ``grad`` of ``grad``)."""
    while t is not None and C.is_gradtrackingtensor(t) and (lv := C.maybe_get_level(t)) > top and not t.requires_grad \
            and not C.is_dead_tensor_wrapper(t) and is_grad_kind(live_levels().get(lv)):  # (a jvp level's: kept, its ops
        t = C.get_unwrapped(t)  # run at that level as plain code's do there)
    return t


def above_vmaps(levels: dict | None, inputs) -> bool:
    """Two differentiating transforms are active (``levels``: where the region is called), one of
    them inside a vmap that batches the region's ``inputs`` (``vmap(hessian(f))``,
    ``vmap(grad(grad(f)))``, MAML's ``grad(vmap(grad(f)))``): it may differentiate the region's
    backward above that vmap, where the ops as vmap batched them cannot be replayed (see
    remat_fn._logical).  Not ``hessian(vmap(f))``: the vmap inside every differentiating level."""
    if not levels or sum(not is_vmap_kind(k) for k in levels.values()) < 2:
        return False
    outer = min((lv for t in inputs for lv, _ in batch_layers(t)), default=None)
    return outer is not None and any(lv > outer and not is_vmap_kind(k) for lv, k in levels.items())


def rebatch(t: torch.Tensor, layers) -> torch.Tensor:
    """``t`` wrapped in the vmap levels :func:`batch_layers` found, then at the innermost
    live transform, a grad level (see :func:`grad_on_top`): autograd shallow-copies what an
    unpack hook returns, which a ``BatchedTensor`` refuses and a grad wrapper allows."""
    for level, bdim in layers:
        t = C._add_batch_dim(t, bdim, level)
    return wrap_at_top(t)


def peel_vmaps(t: torch.Tensor, below: bool | None = None, above: int | None = None):
    """``(plain tensor, [(level, bdim)] innermost first, [levels of the other wrappers above
    them]``) for ``t`` (a tensor in a custom Function's jvp rule under ``vmap`` levels only, the
    rule's own level above them: the innermost active one, or one above it), or None where
    another level wraps it (a ``grad`` between the vmaps and the jvp, which the replay on the
    plain tensors would cut off: ``vmap(grad(jvp))``).  ``above``: only the vmap wrappers of
    levels above it are taken off (the tensor left is wrapped at the levels that differentiate
    a backward, ``hessian(vmap(f))``); None where a wrapper above it is not a vmap's."""
    if above is not None:
        layers = []
        while C.is_functorch_wrapped_tensor(t) and (C.maybe_get_level(t) > above or C.is_dead_tensor_wrapper(t)):
            if C.is_batchedtensor(t):
                layers.append((C.maybe_get_level(t), C.maybe_get_bdim(t)))
            elif not C.is_dead_tensor_wrapper(t):  # (a level that has exited: its wrapper, as functorch reads it, goes)
                return None
            t = C.get_unwrapped(t)
        return t, layers[::-1], []
    top = []
    own = current_level()
    # (a jvp level's wrapper below the rule's own level, ``jvp(vmap(f))``, where no grad level is
    # active: the rule's ops are lifted to it, and no level differentiates the rule; ``below``: no
    # level differentiates it, said by the caller, a backward's wrappers of its grad level too)
    fwd_only = all(is_vmap_kind(k) or is_jvp_kind(k) for k in live_levels().values()) if below is None else below
    while C.is_functorch_wrapped_tensor(t) and not C.is_batchedtensor(t):
        if C.maybe_get_level(t) < own and not fwd_only:
            return None
        top.append(C.maybe_get_level(t))
        t = C.get_unwrapped(t)
    layers = []
    while C.is_functorch_wrapped_tensor(t):
        if not C.is_batchedtensor(t):
            if not fwd_only:
                return None
        else:
            layers.append((C.maybe_get_level(t), C.maybe_get_bdim(t)))
        t = C.get_unwrapped(t)
    return t, layers[::-1], top


def _labels(n: int, layers) -> list:
    """The dims of a tensor below vmap wrappers ``layers`` (innermost first), named: ``k`` for
    logical dim ``k`` (of ``n``), ``(level,)`` for a level's batch dim."""
    names: list = list(range(n))
    for level, bdim in reversed(layers):
        names.insert(bdim, (level,))
    return names


def sum_levels(peeled, levels: set):
    """``peeled`` (see :func:`peel_vmaps`) summed over the batch dims of ``levels``: the cotangent of a
    result none of those levels batches (reverse mode: each example's cotangent adds up)."""
    x, have, top = peeled
    names = _labels(x.dim() - len(have), have)
    drop = [names.index((lv,)) for lv, _ in have if lv in levels]
    if not drop:
        return peeled
    names = [d for d in names if not (type(d) is tuple and d[0] in levels)]
    kept = []
    for lv, _ in have:  # (innermost first: each batch dim where it is once the inner ones are gone)
        if lv not in levels:
            kept.append((lv, names.index((lv,))))
            names.remove((lv,))
    return x.sum(drop), kept, top


def to_physical(peeled, layers, sizes: dict[int, int], extra: list[int]) -> torch.Tensor | None:
    """A tensor (``peeled``: what :func:`peel_vmaps` made of it) as the plain tensor a recorded forward
    batched at ``layers`` (``(level, bdim)`` innermost first, at live levels) read: their batch dims
    where ``layers`` puts them (expanded where it is not batched at one), then the batch dims of the
    levels ``extra`` (ascending, above every level of ``layers``: its other vmap levels, expanded
    where it is not batched at one).  None where it has another level."""
    x, have, _ = peeled
    want = [level for level, _ in layers]
    if any(level not in want and level not in extra for level, _ in have):
        return None
    n = x.dim() - len(have)
    names = _labels(n, have)
    missing = [level for level in (*want, *extra) if level not in {lv for lv, _ in have}]
    for level in missing:
        x = x.unsqueeze(-1)
        names.append((level,))
    target = [*_labels(n, layers), *((level,) for level in extra)]
    x = x.permute([names.index(d) for d in target])
    if missing:
        x = x.expand([sizes[d[0]] if isinstance(d, tuple) and d[0] in missing else -1 for d in target])
    if missing or target != names:
        x = x.contiguous()
    return x


def from_physical(y: torch.Tensor, layers, n_logical: int, extra: list[int], below: bool | None = None,
                  above: int | None = None) -> torch.Tensor | None:
    """The inverse of :func:`to_physical` for a result ``y``: a plain tensor batched at ``layers``
    (innermost first) of ``n_logical`` logical dims, then at ``extra`` (its last dims); wrapped at
    ``layers`` and then at ``extra``.  None where ``y`` is not so (``below``, ``above``: see peel_vmaps)."""
    got = peel_vmaps(y, below, above)  # (below the wrappers of the rule's own levels)
    if got is None or got[1] or got[0].dim() != n_logical + len(layers) + len(extra):
        return None
    y = got[0]
    # (wrappers nest outward by level: each goes on in ascending level order, an extra level outside
    # the others, ``jacfwd(vmap(f))``'s basis, or between them, ``vmap(jacrev(vmap(f)))``'s, among them;
    # the extra levels' dims are the last ones, in order, and a layer's bdim counts from the front)
    left = len(extra)
    for level, bdim in sorted([*layers, *((level, None) for level in extra)], key=lambda lb: lb[0]):
        if bdim is None:
            y = C._add_batch_dim(y, y.dim() - left, level)
            left -= 1
        else:
            y = C._add_batch_dim(y, bdim, level)
    return y


def wrap_at_top(t: torch.Tensor) -> torch.Tensor:
    """``t`` wrapped at the innermost live transform, a grad level, without requiring grad there."""
    return C._wrap_for_grad(t, C.get_interpreter_stack()[-1].level())


def differentiable(t: torch.Tensor) -> bool:
    """A dtype autograd differentiates (floating or complex)."""
    return t.is_floating_point() or t.is_complex()


def grad_on_top() -> bool:
    """The innermost active transform is a grad level (a backward under ``vmap(grad)``)."""
    stack = C.get_interpreter_stack()
    return bool(stack) and stack[-1].key() == _GRAD


def vmap_levels(t: torch.Tensor) -> list[int]:
    """The levels of the ``vmap`` wrappers around ``t``, outermost first."""
    return [level for level, _ in reversed(batch_layers(t))]


def grad_wrappers(t: torch.Tensor) -> tuple[list[tuple[int, bool]], torch.Tensor]:
    """``(level, dead)`` of every grad-tracking wrapper around ``t`` (outermost
    first), and the plain tensor below them."""
    out = []
    while C.is_functorch_wrapped_tensor(t):
        if C.is_gradtrackingtensor(t):
            out.append((C.maybe_get_level(t), bool(C.is_dead_tensor_wrapper(t))))
        t = C.get_unwrapped(t)
    return out, t


def live_levels() -> dict[int, object]:
    """``level -> transform kind`` of the active interpreters."""
    return {i.level(): i.key() for i in transform_stack()}


def current_level() -> int:
    """The innermost active functorch level (0 outside every transform)."""
    return C.maybe_current_level() or 0


def grad_mode_at(level: int) -> bool:
    """The grad mode an op called now runs under at functorch ``level`` and below (see
    :func:`current_level`).  A ``grad`` or ``vjp`` level turns grad on for its own ops and
    lowers each op to the levels below it under the mode it was entered in: an op inside
    ``grad`` called under ``no_grad`` records nothing at the levels outside."""
    mode = torch.is_grad_enabled()
    if current_level() <= level:
        return mode
    for i in reversed(transform_stack()):
        if i.level() <= level:
            break
        if i.key() == _GRAD:
            mode = C.CGradInterpreterPtr(i).prevGradMode()
    return mode


def is_grad_kind(kind) -> bool:
    return kind == _GRAD


def is_vmap_kind(kind) -> bool:
    return kind == C.TransformType.Vmap


def is_jvp_kind(kind) -> bool:
    return kind == _JVP


def vmap_sizes() -> list[tuple[int, int]]:
    """``(level, batch size)`` of each active ``vmap`` level, outermost first."""
    return [(i.level(), C.CVmapInterpreterPtr(i).batchSize()) for i in transform_stack() if is_vmap_kind(i.key())]


def draws_batched() -> bool:
    """True where an active ``vmap`` batches random draws (``randomness='different'``): a
    draw there is batched even where nothing it reads is."""
    return any(is_vmap_kind(i.key()) and C.CVmapInterpreterPtr(i).randomness() == C.RandomnessType.Different
               for i in transform_stack())


def differentiated_outside_vmaps(levels: dict, eager: bool) -> list[bool]:
    """For each ``vmap`` level among ``levels`` (``level -> kind``, see :func:`live_levels`),
    outermost first: whether a grad level outside it differentiates through it (or eager
    autograd does: ``eager``).  There a custom ``autograd.Function``'s generated vmap rule
    runs its backward once per example (see ``remat_fn._func_graph.batched_outputs``)."""
    out, outside = [], eager
    for _, kind in sorted(levels.items(), key=lambda lk: lk[0]):
        if is_vmap_kind(kind):
            out.append(outside)
        elif kind == _GRAD:
            outside = True
    return out


def forward_mode_active() -> bool:
    """True when forward-mode AD (a functorch jvp level or an eager dual level) is on.

    Forward-mode tangent computations run as extra aten ops below the AD layer,
    interleaved with the region's own ops, so op-position caching cannot be
    replayed reliably there; such recomputations simply recompute everything.
    """
    if forward_ad_level() >= 0:
        return True
    return functorch_active() and any(i.key() == _JVP for i in transform_stack())


def forward_mode_at(levels: dict) -> bool:
    """Forward-mode AD differentiates a call made under ``levels`` (see :func:`live_levels`): a
    functorch ``jvp`` level among them, or, with none active, an eager dual level.  (Inside a
    custom Function's forward, where torch set the caller's levels aside, the dual level
    functorch's ``jvp`` runs on stays on: no tangent reaches that forward.)"""
    if levels:
        return any(is_jvp_kind(k) for k in levels.values())
    return forward_ad_level() >= 0


def nested_forward_mode() -> bool:
    """True under two or more nested forward-mode levels (``jvp(jvp)``, ``jacfwd(jacfwd)``).

    torch gives silently zero second-order tangents for any custom
    ``autograd.Function`` there, so a region runs as plain code (exact, with no
    memory saving); forward mode keeps no residuals, so little is lost.
    """
    return sum(1 for i in transform_stack() if i.key() == _JVP) >= 2


def carries_grad(t: torch.Tensor) -> bool:
    """True if ``t`` carries a gradient, as ``requires_grad`` tells in plain code.

    Under a functorch grad level the wrapper of a view made under
    ``torch.no_grad()`` reports ``requires_grad=True`` although it has no
    history (in plain code such a view does not require grad): a view without
    a ``grad_fn`` carries none.
    """
    if not t.requires_grad:
        return False
    try:
        return t.grad_fn is not None or not is_view(t)
    except RuntimeError:  # (a no_grad view written in place: autograd refuses it a history)
        return False


def from_lowered_level(t: torch.Tensor) -> bool:
    """True for a live grad-tracking wrapper (no ``vmap`` level below it) of a level that is not the innermost one now: a
    transform's level set aside while a custom ``autograd.Function``'s forward runs
    below it (``grad`` of ``grad``: the region's forward runs under a level of its own
    below both grads, so the buffers ``functional_call`` passed are wrapped at levels
    functorch now counts as captured)."""
    if not C.is_gradtrackingtensor(t) or C.is_dead_tensor_wrapper(t) or any_batched(t):
        return False
    stack = C.get_interpreter_stack()
    return not stack or C.maybe_get_level(t) != stack[-1].level()


def requires_grad_anywhere(t: torch.Tensor) -> bool:
    """True if ``t`` or any functorch wrapper between it and the plain tensor requires grad."""
    while True:
        if t.requires_grad:
            return True
        if not C.is_functorch_wrapped_tensor(t):
            return False
        t = C.get_unwrapped(t)
