"""What the tape knows of an aten op, and how a recorded op runs.

:func:`op_info` caches, per op, the arguments it writes, whether it draws random
numbers (tagged ``nondeterministic_seeded``, taking a ``Generator``, or a custom op
outside ``aten``/``prims``, which may draw without saying so), whether it is a view
and whether its output shape depends on data.  :func:`draw` runs a random op in the
forward from a private generator copied from its own (which then moves on as if the
op had drawn from it) and :func:`run_recorded` replays it from another private
generator set to that state: the replay draws the forward's bits and never sets a
generator that other threads draw from.  :func:`reenter` runs the replay through the
dispatch modes the user entered around the forward, as the forward's ops ran.  Storage identity (:func:`storage_key`, :func:`has_storage`) covers
``nn.Parameter`` subclasses, wrapper subclasses and empty storages.
"""

from __future__ import annotations

import contextlib
from typing import Any

import optree
import torch

from ._ambient import AMBIENT
from ._functorch import any_batched, unwrap_all
from ._torch_internals import (
    DisableFuncTorch,
    DisableTorchDispatch,
    DisableTorchFunction,
    TorchDispatchMode,
    any_autocast_enabled,
    generator_key,
    schema,
)
from ._torch_internals import mode_stack as _mode_stack

__all__ = [
    "op_info", "storage_key", "simple_args", "generator_of", "default_states", "is_default_generator", "same_state", "user_generator",
    "devices_of", "held_copy",
    "no_autocast", "ALIASING", "SEQ", "draw", "run_recorded", "user_modes", "reenter", "written_tensors", "arg_shapes",
    "arg_meta", "has_storage", "PLAIN", "METADATA_ONLY", "single_output", "placeholder", "private_copies", "DECOMPOSED",
    "copy_before_write", "DETACH", "PrivateWrites", "call_grad_mode", "bookkeeping", "follow", "untracked_stats",
]

_NULL = contextlib.nullcontext()
_SEEDED = torch.Tag.nondeterministic_seeded
_DYNAMIC = tuple(t for t in (getattr(torch.Tag, "dynamic_output_shape", None),
                             getattr(torch.Tag, "data_dependent_output", None)) if t is not None)


# ops that update BatchNorm's running statistics in place although their schema does
# not say so, in training mode (the ``training`` flag is argument 5)
_UNDECLARED = tuple(getattr(getattr(torch.ops.aten, n, None), "default", None)
                    for n in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm"))


def _writes_of(func) -> tuple:
    """(position, name) of the arguments ``func`` writes in place (cached by :func:`op_info`)."""
    args = schema(func).arguments
    if func in _UNDECLARED:
        return ((3, args[3].name), (4, args[4].name))
    return tuple((i, a.name) for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write)


SEQ = (tuple, list)
DETACH = torch.ops.aten.detach.default
# torch.tensor(data), torch.as_tensor, torch.from_numpy: the tensor over the data (numpy's memory, which writes
# from numpy change without a version bump) comes from no op; ``lift_fresh`` is the first op to see it
LIFT_FRESH = torch.ops.aten.lift_fresh.default
# ops whose outputs share their input's memory though their schema says no alias: a write into one writes the input
ALIASING = tuple(getattr(getattr(torch.ops.aten, n), o) for n, o in (
    ("_unsafe_view", "default"), ("unsafe_split", "Tensor"), ("unsafe_split_with_sizes", "default"), ("unsafe_chunk", "default"))
    if hasattr(torch.ops.aten, n))
_INFO: dict[Any, tuple] = {}


def op_info(func) -> tuple:
    """(written positions, draws random numbers, is a view, output shape depends on data,
    takes a storage, the op, (position, name) of its generator argument or None, an op
    outside aten and prims that may draw without saying so: a custom op)"""
    i = _INFO.get(id(func))  # (by id: an op's own hash is Python code; the op is held below)
    if i is None:
        tags = func.tags
        args = schema(func).arguments
        gen = next(((k, a.name) for k, a in enumerate(args) if "Generator" in str(a.type)), None)
        i = _INFO[id(func)] = (_writes_of(func), _SEEDED in tags or gen is not None, func.is_view,
                               any(t in tags for t in _DYNAMIC),
                               any("Storage" in str(a.type) for a in args), func, gen,
                               func.namespace not in ("aten", "prims"))
    return i


def simple_args(args, kwargs) -> bool:
    """No tensor among ``kwargs`` or inside a list argument."""
    for a in args:
        if type(a) in SEQ:
            for e in a:
                if isinstance(e, torch.Tensor):
                    return False
    if kwargs:
        for v in kwargs.values():
            if isinstance(v, torch.Tensor):
                return False
            if type(v) in SEQ:
                for e in v:
                    if isinstance(e, torch.Tensor):
                        return False
    return True


_F = torch.nn.functional
# functions that update BatchNorm's running statistics in training mode: where (position, name)
# running_mean, running_var and the training flag are given, and the flag's default
_NORM_STATS = {
    _F.batch_norm: ((1, "running_mean"), (2, "running_var"), (5, "training"), False),
    _F.instance_norm: ((1, "running_mean"), (2, "running_var"), (5, "use_input_stats"), True),
    torch.batch_norm: ((3, "running_mean"), (4, "running_var"), (5, "training"), False),
    torch.instance_norm: ((3, "running_mean"), (4, "running_var"), (5, "use_input_stats"), True),
}


def untracked_stats(func, args, kwargs, ids: set):
    """``(args, kwargs)`` with a BatchNorm's running statistics detached where they are among
    ``ids`` (the inputs of a forward under forward mode alone, which its vjp level makes require
    grad: plain ``jvp`` gives them a tangent, which the op takes in training mode, where autograd
    refuses ``requires_grad``).  The op writes the same storage; in eval mode they stay (plain code
    refuses their tangent there)."""
    at = _NORM_STATS.get(func)
    if at is None:
        return args, kwargs

    def get(i, name, default=None):
        return args[i] if i < len(args) else kwargs.get(name, default)

    if not get(*at[2], at[3]):
        return args, kwargs
    args, kwargs = list(args), dict(kwargs)
    for i, name in at[:2]:
        t = get(i, name)
        if isinstance(t, torch.Tensor) and id(t) in ids:
            if i < len(args):
                args[i] = t.detach()
            else:
                kwargs[name] = t.detach()
    return args, kwargs


def written_tensors(func, args, kwargs) -> list:
    if func in _UNDECLARED and not (args[5] if len(args) > 5 else kwargs.get("training", True)):
        return []  # (BatchNorm in eval mode reads its statistics: an input like any other)
    out = []
    for i, name in op_info(func)[0]:
        v = args[i] if i < len(args) else kwargs.get(name)
        for t in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


# tensors whose storage can be asked for (a subclass may have none)
PLAIN = (torch.Tensor, torch.nn.Parameter)
_NO_DISPATCH = torch.Tensor.__torch_dispatch__


def has_storage(t: torch.Tensor) -> bool:
    """A tensor whose own storage holds its values: a plain tensor, an ``nn.Parameter``
    (subclasses too) or any subclass without a ``__torch_dispatch__`` of its own."""
    tp = type(t)
    return tp in PLAIN or tp.__torch_dispatch__ is _NO_DISPATCH


def arg_shapes(args, kwargs) -> tuple:
    if simple_args(args, kwargs):
        return tuple(t.shape for t in args if isinstance(t, torch.Tensor))
    return tuple(t.shape for t in optree.tree_leaves((args, kwargs), none_is_leaf=True)
                 if isinstance(t, torch.Tensor))


def storage_key(t: torch.Tensor) -> int:
    """The storage of ``t`` (0: none, or an empty one, which aliases nothing).  A wrapper
    subclass that says what it wraps (``__tensor_flatten__``: DTensor's local shard) has the
    storage of the first tensor it wraps; another wrapper (asking can abort the process)
    none (see Tape.key)."""
    if type(t) not in PLAIN and not has_storage(t):
        flatten = getattr(t, "__tensor_flatten__", None)
        if flatten is None:
            return 0
        try:
            names = flatten()[0]
            return storage_key(getattr(t, names[0])) if names else 0
        except Exception:  # pragma: no cover - a subclass's own protocol failing
            return 0
    try:
        st = t.untyped_storage()
        return st.data_ptr() if st.nbytes() else 0
    except (RuntimeError, NotImplementedError):  # (a storage torch calls invalid: a functorch wrapper's)
        return 0


def storage_id(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage object, which ``t.data = other`` changes and a resize
    does not (its data pointer moves); 0 where ``t`` has no storage of its own to ask (see
    storage_key)."""
    if type(t) not in PLAIN and not has_storage(t):
        return 0
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return 0


def generator_of(func, args, kwargs, pos):
    """The generator an op draws from: its generator argument (``pos``: (position, name)),
    else the default generator of its device."""
    g = kwargs.get("generator")
    if g is None and pos is not None and pos[0] < len(args):
        g = args[pos[0]]
    if g is not None:
        return g
    dev = kwargs.get("device")
    if dev is None:
        for a in args:
            if isinstance(a, torch.Tensor):
                dev = a.device
                break
    dev = torch.device(dev) if dev is not None else torch.device("cpu")
    if dev.type == "cpu":
        return torch.default_generator
    if dev.type == "cuda":
        return torch.cuda.default_generators[dev.index if dev.index is not None else torch.cuda.current_device()]
    return None  # pragma: no cover - other devices: no per-op state (the region snapshot covers them)


def no_autocast():
    """The recorded ops are the ones autocast already chose: replay them as they are."""
    if any_autocast_enabled is not None and not any_autocast_enabled():
        return _NULL
    on = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
    if not on:
        return _NULL
    st = contextlib.ExitStack()
    for d in on:
        st.enter_context(torch.autocast(d, enabled=False))
    return st


def user_modes() -> list:
    """The dispatch modes the user entered that are active now (a fake-quantisation mode, a
    counter): the region records the ops it issues above them, so its replay runs
    through them again (:func:`reenter`), as the forward's ops did."""
    return [m for m in _mode_stack() if not type(m).__module__.startswith(("torch.", "remat_fn."))]


def reenter(modes):
    """Around a replay: the forward's user ``modes`` that are not active now, entered again
    (one active now already sees the replay; entering it twice would act twice)."""
    if not modes:
        return _NULL
    active = _mode_stack()
    missing = [m for m in modes if not any(m is a for a in active)]
    if not missing:
        return _NULL
    st = contextlib.ExitStack()
    for m in missing:
        st.enter_context(m)
    return st


def default_states(devices) -> tuple:
    return tuple(g.get_state() for g in _default_generators(devices))


def same_state(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two generator states (byte tensors) are equal: compared below every mode, a fake tensor mode
    around the region included (where ``torch.equal`` of real tensors raised, from inside a dispatch
    handler: the process aborted), and seen by no torch function mode (no call of the function)."""
    with DisableTorchFunction(), DisableFuncTorch(), DisableTorchDispatch():
        return torch.equal(a, b)


def is_default_generator(g: torch.Generator) -> bool:
    """A device's default generator (one the region's RNG snapshot restores), not the caller's own."""
    k = generator_key(g)
    if k == generator_key(torch.default_generator):
        return True
    return g.device.type != "cpu" and any(k == generator_key(d) for d in getattr(getattr(torch, g.device.type, None), "default_generators", ()))


def _default_generators(devices) -> list:
    out = [torch.default_generator]
    if "cuda" in devices and torch.cuda.is_initialized():
        out.append(torch.cuda.default_generators[torch.cuda.current_device()])
    return out


def devices_of(args, kwargs) -> set:
    return {x.device.type for x in optree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)}


def draw(node, func, args, kwargs):
    """Run ``func`` for ``node`` in the forward.  A random op that takes a generator draws
    from a private one set to its generator's state, which then moves on as if the op had
    drawn from it: the replay starts from exactly the state the op drew from, whatever
    other threads draw meanwhile; so does one of :data:`DECOMPOSED`, as the fill it is.  (Any
    other that takes none runs as it is: its outputs are held, see Tape.after.)"""
    rng = node.rng
    if rng is None:
        return func(*args, **kwargs)
    g = rng[0]
    state = g.get_state()
    node.rng = (g, state)
    if node.probe is not None or (op_info(func)[6] is None and func not in DECOMPOSED):
        return func(*args, **kwargs)
    mine = _private(g, state)
    drawing = AMBIENT.draws
    drawing.append((mine, node))
    try:
        out = _with_generator(node.func, args, kwargs, mine)
    finally:
        drawing.pop()
    end = mine.get_state()
    g.set_state(end)
    if drawing:  # (``g``: the private generator of a nested region's draw, see follow)
        node.rng = (g, node.rng[1], end)
    return out


def user_generator(g: torch.Generator) -> torch.Generator:
    """``g``, or where it is the private generator of a nested region's draw running now (see :func:`draw`),
    the generator that draw stands for: the caller's."""
    stands_for = {generator_key(mine): n for mine, n in AMBIENT.draws}
    while (n := stands_for.pop(generator_key(g), None)) is not None:
        g = n.rng[0]
    return g


def follow(node, args, kwargs) -> None:
    """A recomputation of an enclosing region gave random ``node`` its forward's numbers
    (replayed from its recorded state, or kept) where the op comes from a nested region's
    draw (that region running its forward inside the re-run), from its private generator:
    that region's node (and those of regions between) recorded a state read from the live
    generator, which the replay neither reads nor moves (a second draw would read the first
    one's state again).  They take the state the forward drew from, and the private
    generator moves on as the forward's did."""
    drawing = AMBIENT.draws
    rng = node.rng
    if not drawing or rng is None or len(rng) < 3 or (node.shapes is not None and node.shapes != arg_shapes(args, kwargs)):
        return  # (no nested draw running, or this op ran live, from its live arguments)
    g = generator_of(node.func, args, kwargs, op_info(node.func)[6])
    mine = drawing[-1][0]
    if g is None or g.device != mine.device or not same_state(g.get_state(), mine.get_state()):
        return  # pragma: no cover - defensive: not the nested draw's generator
    for _, n in drawing:
        n.rng = (n.rng[0], rng[1], *n.rng[2:])
    mine.set_state(rng[2])


_A = torch.ops.aten
# random ops that take no generator but are, in ATen, a fill that takes one: run (in the
# forward and the replay) as that fill from a private generator, bit for bit the op itself
DECOMPOSED: dict = {
    _A.rand_like.default: lambda a, k, g: _A.empty_like.default(*a, **k).uniform_(0, 1, generator=g),
    _A.randn_like.default: lambda a, k, g: _A.empty_like.default(*a, **k).normal_(0, 1, generator=g),
    _A.rand.default: lambda a, k, g: _A.empty.memory_format(*a, **k).uniform_(0, 1, generator=g),
    _A.randn.default: lambda a, k, g: _A.empty.memory_format(*a, **k).normal_(0, 1, generator=g),
}


def _private(g, state) -> torch.Generator:
    mine = torch.Generator(device=g.device)
    mine.set_state(state)
    return mine


def _with_generator(func, args, kwargs, g):
    fill = DECOMPOSED.get(func)
    if fill is not None:
        return fill(args, kwargs, g)
    pos, name = op_info(func)[6]
    if pos < len(args):
        args = list(args)
        args[pos] = g
    else:
        kwargs = {**kwargs, name: g}
    return func(*args, **kwargs)


def held_copy(t):
    return t.detach() if isinstance(t, torch.Tensor) else t


def run_recorded(node, args, kwargs):
    """Run ``node``'s op on ``args``; a random op draws the forward's numbers from a
    private generator set to the recorded state (never from one other threads see)."""
    rng = node.rng
    if rng is None:
        return node.func(*args, **kwargs)
    if node.held is not None:  # (copies of what it made; its writes copied into its arguments)
        for n, t in enumerate(written_tensors(node.func, args, kwargs)):
            t.copy_(node.held[-1 - n])
        leaves = [t.clone() if isinstance(t, torch.Tensor) else t for i, t in sorted(node.held.items()) if i >= 0]
        return leaves[0] if single_output(node.func) else tuple(leaves)
    return _with_generator(node.func, args, kwargs, _private(rng[0], rng[1]))


# in-place ops that change only a tensor's sizes and strides, not its data (matmul on
# a 1-D operand ends in squeeze_): a kept value they touch needs no copy
METADATA_ONLY = frozenset(
    p for p in (getattr(torch.ops.aten, n, None) for n in (
        "squeeze_", "unsqueeze_", "transpose_", "t_", "swapdims_", "swapaxes_", "as_strided_", "detach_"))
    if p is not None
)


def arg_meta(args) -> tuple:
    """(shape, dtype) of each tensor among ``args``."""
    return tuple(
        (tuple(a.shape), a.dtype) for a in optree.tree_leaves(args) if isinstance(a, torch.Tensor)
    )


def single_output(func) -> bool:
    """The op returns one tensor."""
    rets = schema(func).returns
    return len(rets) == 1 and str(rets[0].type) == "Tensor"


def placeholder(node, args, kwargs):
    """What a skipped op returns: its written arguments as they are (no write), new
    tensors of the recorded sizes and strides otherwise (never read: see Tape.plan)."""
    multi, metas = node.meta
    written = {n: t for (n, _), t in zip(node.writes, written_tensors(node.func, args, kwargs))} if node.writes else {}
    alias = {}
    if written:
        for i, v in enumerate(node.outs):
            for n, w in node.writes:
                if w is v:
                    alias[i] = written[n]
    leaves = [alias[i] if i in alias else None if m is None else  # (None: a void op's output)
              torch.empty_strided(m[0], m[1], dtype=m[2], device=m[3])
              for i, m in enumerate(metas)]
    return multi(leaves) if multi is not None else leaves[0]


def private_copies(tensors, pre_write: dict, copies: dict) -> dict:
    """``{id(t): copy}`` for the ``tensors`` (what a region reaches) whose storage the
    region's forward wrote: each a plain tensor, with ``t``'s geometry, on a fresh copy
    of the storage as it was before the first write (see ``Tape.pre_write``).  ``copies``:
    storage -> its one copy in this re-run (buffers that share a storage share it; see
    :class:`PrivateWrites`)."""
    out: dict = {}
    for t in tensors:
        if any_batched(t):  # (a per-model slice of stacked buffers under vmap: not rebuilt)
            continue
        b = unwrap_all(t)
        p = storage_key(b) if b.layout == torch.strided else 0
        st = pre_write.get(p)
        if st is not None:
            if p not in copies:
                copies[p] = st.clone()
            out[id(t)] = torch.empty(0, dtype=b.dtype, device=b.device).set_(
                copies[p], b.storage_offset(), b.size(), b.stride())
    return out


def copy_before_write(guard, k, written, env, result) -> list:
    """Node ``k`` writes ``written``: each target saved before it (``pos <= k``) whose tensor
    it writes is handed out as a copy taken now.  Returns the targets still guarded."""
    hit = {p for t in written if (p := storage_key(t))}
    rest = []
    for i, v, pos in guard:
        if pos <= k:
            t = env.get(id(v))
            if t is not None and storage_key(t) in hit:
                result[i] = t.clone()
                continue
        rest.append((i, v, pos))
    return rest


class PrivateWrites(TorchDispatchMode):
    """A re-run of the function reads and writes private copies of the storages its
    forward wrote (``pre_write``: storage -> its contents before the first write), one
    copy per storage per re-run (``copies``), whatever holds the tensor: a module's
    buffer (put in place by :func:`private_copies` already), a list, a tuple or a
    ``functools.partial`` (found here, by storage, below every functorch layer).  So a
    BatchNorm's running statistics are updated once, by the forward."""

    def __init__(self, pre_write: dict, copies: dict):
        super().__init__()
        self.pre_write = pre_write
        self.copies = copies

    def _private(self, x):
        if not isinstance(x, torch.Tensor) or x.layout != torch.strided:
            return x
        p = storage_key(x)
        st = self.pre_write.get(p) if p else None
        if st is None:
            return x
        c = self.copies.get(p)
        if c is None:
            c = self.copies[p] = st.clone()
        return torch.empty(0, dtype=x.dtype, device=x.device).set_(c, x.storage_offset(), x.size(), x.stride())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with DisableTorchFunction():  # (its own tensors are no torch call of the function's: the capture mode's trace)
            if simple_args(args, kwargs):
                args = tuple(self._private(x) for x in args)
            else:
                args, kwargs = optree.tree_map(self._private, (args, kwargs), none_is_leaf=True)
            return func(*args, **kwargs)


def call_grad_mode() -> bool:
    """The grad mode the op being dispatched was called under: ``AMBIENT.call_grad``, set by
    the torch.func path's CaptureMode, above every functorch layer, for the torch call the
    function is making (below them, functorch shows its own level's mode instead, off inside
    the region's Function, where the function's ``no_grad`` and a custom autograd.Function's
    forward cannot be told from the rest); grad mode where none is set."""
    v = AMBIENT.call_grad
    return torch.is_grad_enabled() if v is None else v


@contextlib.contextmanager
def bookkeeping():
    """A tape makes its own copies inside a dispatch handler (a storage's contents before a
    write, a random op's held outputs): an enclosing region's recording lets them through
    (they are no op of its function), the memory meters still see them."""
    AMBIENT.bookkeeping += 1
    try:
        yield
    finally:
        AMBIENT.bookkeeping -= 1
