"""Custom ``autograd.Function``s in a region's recorded forward, as steps of its replay.

Under a transform ``Function.apply`` goes through ``custom_function_call``, which the
region's torch function mode sees (:class:`remat_fn._captures.CaptureMode`).  Each call
becomes one :class:`FunctionStep` of every recording tape: its span of the tape's nodes,
the Values of its arguments and outputs, and what its ``setup_context`` left on the
context object that is plain data (``ctx.scale = 2.0``).

The replay through the transforms (:mod:`remat_fn._replay_live`) applies, for each step,
a subclass of the user's Function (:func:`apply_step`) whose ``forward`` runs the span's
recorded ops and whose ``setup_context`` runs the user's, then puts back those
attributes as the forward left them.  So each transform differentiates the Function by
its own rules (``backward``, ``jvp``, ``vmap``), while what its forward computed and
what its context holds come from the forward, as JAX's ``custom_vjp`` keeps the forward
it traced: a ``forward`` or ``setup_context`` that reads class or global state the region
changes around the call replays as it ran, not under the state backward finds.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import optree
import torch

from ._functorch import forward_mode_active, is_jvp_kind, is_vmap_kind, is_wrapped, live_levels, unwrap_all
from ._record import recording_tapes
from ._torch_internals import any_autocast_enabled, below_transforms, function_class

__all__ = ["FunctionStep", "function_steps", "apply_step", "invisible", "forward_below"]


class FunctionStep:
    """A custom ``autograd.Function`` the region's forward applied, as one step of a replay
    through the transforms: its nodes are the tape's ``[start, end)``; ``flat``/``spec``:
    its arguments (Values for tensors); ``outs``: the Value of each output (None: not a
    tensor, ``consts`` holds it); ``single``: the forward returned one object, not a
    tuple; ``attrs``: what its context held that is plain data (None: no context was found,
    ``setup_context`` alone fills it); ``grad``: the grad mode it was applied under."""

    __slots__ = ("cls", "flat", "spec", "kw", "outs", "writes", "grad", "start", "end", "single", "consts", "attrs")

    def __init__(self, cls, flat, spec, outs, grad: bool, start: int, end: int, out, attrs):
        self.cls, self.flat, self.spec, self.outs, self.grad = cls, flat, spec, outs, grad
        self.kw, self.writes = None, ()
        self.start, self.end, self.attrs = start, end, attrs
        self.single = type(out) is not tuple
        leaves = (out,) if self.single else out
        self.consts = [None if isinstance(o, torch.Tensor) else o for o in leaves]


# arguments a Function's replay may take as they were (values that cannot change after the call)
_CONSTANTS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
              torch.memory_format, torch.Size, slice, type(Ellipsis))


class _Constant:
    """An argument that is a container of constants (``[2.0]``, a shape), handed to the replay's
    Function as one object: functorch's generated vmap rule matches a container argument's
    entries against its one tangent (None) and fails (``flat_bdims must not be None``) when the
    Function's ``jvp`` runs inside another Function's vmap rule, as in a replay under ``hessian``;
    its ``setup_context`` and ``forward`` see the container."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _has_tensor(x: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in optree.tree_leaves(x, none_is_leaf=True))


def _fresh(x):
    """A copy of plain data's containers (their numbers and tensors shared)."""
    t = type(x)
    if t in (list, tuple, set, frozenset):
        return t(_fresh(y) for y in x)
    if t is dict:
        return {k: _fresh(v) for k, v in x.items()}
    return x


def _opened(x):
    return x.value if type(x) is _Constant else x


def _plain_value(x: Any, depth: int = 0) -> bool:
    """``x`` is plain data, put back from the forward as it was: numbers, strings, dtypes,
    shapes, and tuples, lists, dicts and sets of them.  Anything else (an argument, an object
    that may hold one, a closure) comes from the replay's own ``setup_context``; a plain
    tensor that needs no gradient (no transform's wrapper: not an argument) is a constant."""
    if isinstance(x, _CONSTANTS):
        return True
    if isinstance(x, torch.Tensor):  # (a constant setup_context made: torch.tensor(scale))
        return not is_wrapped(x) and not x.requires_grad
    if depth > 8:
        return False
    if type(x) in (tuple, list, set, frozenset):
        return all(_plain_value(y, depth + 1) for y in x)
    if type(x) is dict:
        return all(_plain_value(k, depth + 1) and _plain_value(v, depth + 1) for k, v in x.items())
    return False


def _context_attrs(cls, leaves) -> dict | None:
    """What ``setup_context`` left on the context of the call that made ``leaves`` (its graph
    node, reached through an output) that is plain data (:func:`_plain_value`; the rest comes
    from the replay's own ``setup_context``); None where no output has that node."""
    for o in leaves:
        node = o.grad_fn if isinstance(o, torch.Tensor) else None
        if node is not None and function_class(node) is cls:
            try:
                # (functorch's own bookkeeping of a vmap rule, ``_pt_*``, is the replay's)
                # (a mutable one is copied: each replay's context gets the forward's value, as each
                # forward of plain code makes its own; one backward appending to it leaves the next alone)
                return {k: _fresh(v) for k, v in vars(node).items() if not k.startswith("_pt_") and _plain_value(v)}
            except TypeError:  # pragma: no cover - defensive (a node without a __dict__)
                return None
    return None


def function_steps(func, args, kwargs):
    """Apply a custom Function in a region's forward (``custom_function_call``, under a
    transform), noting its span on every recording tape: a :class:`FunctionStep` where its
    outputs are distinct tensors its forward's ops made and its other arguments constants
    (else its class is marked not replayable: regions holding it run again where a replay
    would be needed)."""
    tapes = [t for t in recording_tapes() if t.reg is not None]
    flat, spec = optree.tree_flatten((args[1:], kwargs), none_is_leaf=True)
    # (its forward's ops replay, its setup_context runs again: an argument that is a Python object
    # of the caller's, which may change after the call, is not replayed; nor, under autocast, its
    # ops, cast as autocast said where the replay does not re-enter it)
    ok_args = not (any_autocast_enabled is None or any_autocast_enabled()) \
        and all(isinstance(x, (torch.Tensor, *_CONSTANTS)) for x in flat)
    reads = [[t.lookup(unwrap_all(x)) if isinstance(x, torch.Tensor) else x for x in flat] if ok_args else None
             for t in tapes]
    starts = [len(t.nodes) for t in tapes]
    grad = torch.is_grad_enabled()
    out = func(*args, **kwargs)
    cls = args[0]
    leaves = out if type(out) is tuple else (out,)
    attrs = _context_attrs(cls, leaves) if ok_args and tapes else None
    for tape, a, vals in zip(tapes, starts, reads):
        b = len(tape.nodes)
        outs = [tape.value_of(unwrap_all(o)) if isinstance(o, torch.Tensor) else None for o in leaves]
        made = [v for v in outs if v is not None]
        ok = ok_args and len({id(v) for v in made}) == len(made) \
            and all(v is not None and a <= v.node < b for o, v in zip(leaves, outs) if isinstance(o, torch.Tensor))
        tape.functions[cls] = ok and tape.functions.get(cls, True)
        if ok:
            tape.spans.append((a, b, FunctionStep(cls, vals, spec, outs, grad, a, b, out, attrs), None))
    return out


def invisible(cls, levels: dict | None) -> bool:
    """A custom Function applied now (under ``no_grad``, in a region called under the
    transforms ``levels``) is its forward, run below every transform (see
    :func:`forward_below`): no forward-mode level, whose tangents ``no_grad`` does not stop,
    and no ``vmap`` level, which would apply the Function's own ``vmap`` rule."""
    if torch.is_grad_enabled() or forward_mode_active() or getattr(cls, "remat_fn_region", False) \
            or getattr(cls, "setup_context", None) is torch.autograd.Function.setup_context:
        return False
    kinds = [*live_levels().values(), *(levels or {}).values()]
    return not any(is_vmap_kind(k) or is_jvp_kind(k) for k in kinds)


def forward_below(args, kwargs):
    """``custom_function_call(cls, *args, **kwargs)`` under ``no_grad``, as torch documents
    ``no_grad`` under ``torch.func``: invisible to every grad level, an op's result and a
    custom Function's alike.  (functorch's own ``custom_function_call`` re-enables grad for
    the levels below the innermost: ``grad`` of ``grad`` differentiates the Function's output
    at the outer level, where it differentiates no op run under ``no_grad``.)  Its forward runs
    on the plain tensors below every transform, as ``Function.apply`` runs it, and its outputs
    are constants of every level."""
    cls, rest = args[0], optree.tree_map(lambda x: unwrap_all(x) if isinstance(x, torch.Tensor) else x, (args[1:], kwargs),
                                         none_is_leaf=True)
    with below_transforms():
        out = cls.forward(*rest[0], **rest[1])
        # (an output that is an argument, returned as it came: an alias of it, a constant as well)
        return optree.tree_map(lambda o: o.detach() if isinstance(o, torch.Tensor) else o, out, none_is_leaf=True)


# The step being applied (per thread): its forward and its context's attributes, read by the
# replaying subclass's forward and setup_context, which run inside apply (also under vmap's
# generated rule and forward mode's jvp)
_CURRENT = threading.local()
_CACHE = "_remat_fn_replaying"  # on the user's class (it dies with it): (subclass, its forward's signature)


def _current() -> list:
    stack = getattr(_CURRENT, "stack", None)
    if stack is None:
        stack = _CURRENT.stack = []
    return stack


def _replaying(cls) -> tuple[type, inspect.Signature]:
    got = cls.__dict__.get(_CACHE)
    if got is None:

        def forward(*args):
            return _current()[-1][0](args)

        def setup_context(ctx, inputs, output):
            cls.setup_context(ctx, tuple(_opened(x) for x in inputs), output)
            attrs = _current()[-1][1]
            for k, v in (attrs or {}).items():  # (as the forward left them)
                setattr(ctx, k, _fresh(v))

        sub = type(cls)(f"{cls.__name__}_replay", (cls,), {
            "forward": staticmethod(forward), "setup_context": staticmethod(setup_context), "__module__": cls.__module__,
            "__qualname__": f"{cls.__qualname__}_replay", "remat_fn_replay_of": cls})
        got = (sub, inspect.signature(cls.forward))
        setattr(cls, _CACHE, got)
    return got


def apply_step(fn: FunctionStep, args, kwargs, forward: Callable[[dict], list]):
    """Apply the Function of step ``fn`` to the replayed ``args``/``kwargs``: its forward is
    ``forward(env)`` (``env``: ``id`` of an argument's Value -> the tensor the forward got),
    returning the output tensors in the order of ``fn.outs``; its rules are the user's class's."""
    sub, sig = _replaying(fn.cls)
    bound = sig.bind(*args, **kwargs)  # (as Function.apply binds them: positional, defaults filled)
    bound.apply_defaults()
    pos = tuple(_Constant(x) if type(x) in (list, tuple, dict, torch.Size) and not _has_tensor(x) else x for x in bound.args)
    given = optree.tree_leaves((args, kwargs), none_is_leaf=True)
    value = {id(x): v for x, v in zip(given, fn.flat) if isinstance(x, torch.Tensor)}
    where = [value.get(id(x)) if isinstance(x, torch.Tensor) else None for x in optree.tree_leaves(pos, none_is_leaf=True)]

    def run(uargs):
        got = optree.tree_leaves(uargs, none_is_leaf=True)
        made = iter(forward({id(v): t for v, t in zip(where, got) if v is not None}))
        leaves = [next(made) if v is not None else c for v, c in zip(fn.outs, fn.consts)]
        return leaves[0] if fn.single else tuple(leaves)

    stack = _current()
    stack.append((run, fn.attrs))
    try:
        with torch.set_grad_enabled(fn.grad):
            return sub.apply(*pos)
    finally:
        stack.pop()
