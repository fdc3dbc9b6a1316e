"""The public transform: ``remat`` / ``checkpoint``.

Data flows one way: argument validation -> pytree normalisation (statics,
tensor leaves) -> choice of autograd path (:mod:`remat_fn._eager` with
saved-tensor hooks, or :mod:`remat_fn._functional` under ``torch.func``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import optree
import torch

from ._budget import BudgetPlanner
from ._captures import entered
from ._debug import checks
from ._eager import NeedsFunctionPath, eager_call
from ._errors import RematError
from ._functional import functional_call
from ._pytree import flatten_output
from ._rng_state import devices_of
from .policies import everything_saveable, memory_budget, normalize_policy

__all__ = ["remat", "checkpoint", "call_once"]

F = TypeVar("F", bound=Callable[..., Any])

_F = torch._C._functorch
_hooks_enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", lambda: True)
_accelerator: list[bool] = []


def _has_accelerator() -> bool:
    if not _accelerator:
        try:
            _accelerator.append(bool(torch.accelerator.is_available()))
        except Exception:  # pragma: no cover
            _accelerator.append(torch.cuda.is_available())
    return _accelerator[0]


def _name_of(fun: Any) -> str:
    return getattr(fun, "__qualname__", None) or getattr(fun, "__name__", None) or type(fun).__name__


def _normalize_argnums(static_argnums: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(static_argnums, int):
        static_argnums = (static_argnums,)
    try:
        nums = tuple(static_argnums)
    except TypeError:
        raise TypeError(
            f"static_argnums must be an int or a sequence of ints, got {static_argnums!r}"
        ) from None
    for n in nums:
        if not isinstance(n, int) or isinstance(n, bool):
            raise TypeError(f"static_argnums must contain ints, got {n!r}")
    return nums


def _normalize_argnames(static_argnames: str | Sequence[str]) -> frozenset[str]:
    if isinstance(static_argnames, str):
        static_argnames = (static_argnames,)
    names = tuple(static_argnames)
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"static_argnames must contain strings, got {n!r}")
    return frozenset(names)


def remat(
    fun: F | None = None,
    /,
    *,
    policy: Any = None,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    prevent_cse: bool = True,
    preserve_rng_state: bool = True,
    debug: bool = False,
) -> F:
    """Rematerialise ``fun``: keep only its inputs for backward and recompute the rest.

    Works as ``@remat``, ``@remat(policy=...)`` and ``remat(fun, ...)``, on
    functions, bound methods and ``nn.Module``s.  Value and every derivative
    equal those of ``fun`` under eager autograd (``.backward()``,
    ``torch.autograd.grad``, ``create_graph``/``retain_graph``) and under every
    ``torch.func`` transform and nesting (``grad``, ``vjp``, ``jvp``,
    ``jacrev``, ``jacfwd``, ``hessian``, ``vmap``), including gradients of
    tensors ``fun`` closes over.

    **Arguments:**

    - `fun`: the function (or module) to rematerialise.  Inputs and outputs
      are pytrees (optree); tensor leaves are dynamic, other leaves pass
      through unchanged.
    - `policy`: which intermediate values to save (or offload) instead of
      recompute: one of :mod:`remat_fn.policies`, any torch selective-checkpoint
      policy ``policy(ctx, op, *args, **kwargs)``, or a list of aten ops to save.
      ``None`` (the default) is ``nothing_saveable``: only the inputs are kept.
    - `static_argnums` / `static_argnames`: arguments passed through as they
      are, never flattened (tensors there are treated as constants).
    - `prevent_cse`: accepted for JAX parity.  Eager PyTorch has no common
      subexpression elimination to prevent; under ``torch.compile`` the region
      is always traced as torch's checkpoint region, which the compiler
      recomputes as the policy says and does not merge away.
    - `preserve_rng_state`: snapshot the global CPU and device RNG states so
      that random ops (``nn.Dropout``) recompute bit for bit.  A region that
      draws no random numbers keeps no state.
    - `debug`: record op traces so that a :class:`RecomputeMismatchError`
      shows both runs with user source lines.

    **Returns:** a function with the signature of ``fun``.

    >>> import torch, remat_fn
    >>> f = remat_fn.remat(lambda x: torch.sin(x).sin())
    >>> x = torch.tensor([0.5, 1.0])
    >>> torch.allclose(torch.func.grad(lambda x: f(x).sum())(x),
    ...                torch.cos(torch.sin(x)) * torch.cos(x))
    True
    """
    argnums = _normalize_argnums(static_argnums)
    argnames = _normalize_argnames(static_argnames)
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"preserve_rng_state must be a bool, got {preserve_rng_state!r}")
    policy = _resolve_policy(policy)
    opts = dict(policy=policy, static_argnums=argnums, static_argnames=argnames,
                prevent_cse=prevent_cse, preserve_rng_state=preserve_rng_state, debug=debug)
    if fun is None:
        return functools.partial(_make, **opts)  # type: ignore[return-value]
    return _make(fun, **opts)


checkpoint = remat


def _resolve_policy(policy: Any):
    return normalize_policy(policy)


def _make(fun, *, policy, static_argnums, static_argnames, prevent_cse, preserve_rng_state, debug):
    if not callable(fun):
        raise TypeError(
            f"remat expects a callable (function, bound method or nn.Module), got "
            f"{type(fun).__name__}. Use @remat on a function or remat(module)."
        )
    if static_argnums or static_argnames:
        try:
            sig = inspect.signature(fun)
        except (TypeError, ValueError):  # builtins without a signature
            sig = None
        if sig is not None and static_argnames:
            params = sig.parameters
            has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
            for n in static_argnames:
                if n not in params and not has_var_kw:
                    raise ValueError(
                        f"static_argnames names {n!r}, which is not a parameter of "
                        f"{_name_of(fun)}{sig}. Fix the name or remove it from static_argnames."
                    )
    name = _name_of(fun)
    pol = BudgetPlanner(policy) if isinstance(policy, memory_budget) else policy

    if policy is everything_saveable:
        # Saving everything autograd needs is exactly what plain autograd does:
        # remat becomes a no-op, as in JAX (and keeps no more than no remat).
        def wrapper(*args, **kwargs):
            return fun(*args, **kwargs)

        return _finish(wrapper, fun, policy, static_argnums, static_argnames, prevent_cse,
                       preserve_rng_state, debug)

    def wrapper(*args, **kwargs):
        return _run(fun, name, args, kwargs, static_argnums, static_argnames, preserve_rng_state,
                    debug, policy, pol)

    return _finish(wrapper, fun, policy, static_argnums, static_argnames, prevent_cse,
                   preserve_rng_state, debug)


def call_once(fun, args: tuple, kwargs: dict, *, policy: Any = None, preserve_rng_state: bool = True,
              debug: bool = False):
    """``remat(fun, policy=..., ...)(*args, **kwargs)`` without building a wrapper:
    the form of one-shot callers (``remat_fn.compat.checkpoint``), which would
    otherwise pay for a new wrapper (signature checks, ``functools.wraps``) on
    every call."""
    if policy is not None:
        policy = _resolve_policy(policy)
        if policy is everything_saveable:
            return fun(*args, **kwargs)
    pol = BudgetPlanner(policy) if isinstance(policy, memory_budget) else policy
    return _run(fun, _name_of(fun), args, kwargs, (), frozenset(), preserve_rng_state, debug, policy, pol)


def _run(fun, name, args, kwargs, argnums, argnames, preserve_rng_state, debug, policy, pol):
    """One call of a region: under torch.compile, torch's checkpoint region; else a path."""
    if torch.compiler.is_compiling():  # see remat_fn/_compile.py
        from ._compile import compiled_call

        return compiled_call(fun, args, kwargs, policy=policy, preserve_rng_state=preserve_rng_state)
    with entered():
        return _call(fun, name, args, kwargs, argnums, argnames, preserve_rng_state, debug, pol)


def _finish(wrapper, fun, policy, static_argnums, static_argnames, prevent_cse, preserve_rng_state, debug):
    try:
        functools.update_wrapper(wrapper, fun)
    except (AttributeError, TypeError):  # pragma: no cover
        pass
    if not hasattr(wrapper, "__wrapped__"):
        wrapper.__wrapped__ = fun  # type: ignore[attr-defined]
    if isinstance(fun, torch.nn.Module):
        wrapper.__name__ = type(fun).__name__
        wrapper.__qualname__ = type(fun).__qualname__
        wrapper.__doc__ = type(fun).__doc__
    wrapper.remat_options = dict(  # type: ignore[attr-defined]
        policy=policy, static_argnums=static_argnums, static_argnames=tuple(static_argnames),
        prevent_cse=prevent_cse, preserve_rng_state=preserve_rng_state, debug=debug,
    )
    return wrapper


def _forward_mode_only_or_nested(stack) -> bool:
    """True when a custom autograd.Function cannot be used safely or usefully.

    torch gives silently zero second-order tangents for any custom
    ``autograd.Function`` under two nested forward-mode levels (``jvp(jvp)``,
    ``jacfwd(jacfwd)``), so there the region runs as plain code (exact, with
    no memory saving).  Forward mode keeps no residuals, so nothing is lost
    when no reverse-mode level is active either.
    """
    n_jvp = 0
    for i in stack:
        if i.key() == _F.TransformType.Jvp:
            n_jvp += 1
    return n_jvp >= 2


def _call(fun, name, args, kwargs, argnums, argnames, preserve_rng_state, debug, pol):
    debug, strict = checks(debug)
    if torch._C._are_functorch_transforms_active():
        if _forward_mode_only_or_nested(_F.get_interpreter_stack()):
            return fun(*args, **kwargs)
        return _functorch_call(fun, name, args, kwargs, argnums, argnames, preserve_rng_state, debug, pol)
    if not torch.is_grad_enabled():
        return fun(*args, **kwargs)  # nothing is saved without grad mode
    if argnums:
        _check_argnums(argnums, len(args), name)
    if not _hooks_enabled():
        # saved-tensor hooks are switched off (e.g. by a failed torch.compile);
        # the autograd.Function path needs none.
        return _functorch_call(fun, name, args, kwargs, argnums, argnames, preserve_rng_state, debug, pol)
    devices = _devices(args, kwargs) if (preserve_rng_state and _has_accelerator()) else []
    if isinstance(pol, BudgetPlanner):
        leaves = optree.tree_leaves((args, kwargs), none_is_leaf=True)
        policy = pol.policy_for(fun, [x for x in leaves if isinstance(x, torch.Tensor)], "eager")
    else:
        policy = pol
    try:
        return eager_call(fun, args, kwargs, name, preserve_rng_state, debug, devices, policy, strict)
    except NeedsFunctionPath:
        # fun calls torch.func.grad/vjp/...: the autograd.Function path needs no hooks
        return _functorch_call(fun, name, args, kwargs, argnums, argnames, preserve_rng_state, debug, pol)


def _devices(args, kwargs):
    leaves = optree.tree_leaves((args, kwargs), none_is_leaf=True)
    return devices_of(x for x in leaves if isinstance(x, torch.Tensor))


def _check_argnums(argnums, nargs, name):
    for n in argnums:
        if not -nargs <= n < nargs:
            raise ValueError(
                f"static_argnums contains {n}, but remat({name}) was called with {nargs} "
                "positional arguments. Fix static_argnums or pass the argument positionally."
            )


def _functorch_call(fun, name, args, kwargs, argnums, argnames, preserve_rng_state, debug, pol):
    nargs = len(args)
    _check_argnums(argnums, nargs, name)
    static_pos = {n % nargs for n in argnums} if nargs else set()
    dyn_args = tuple(a for i, a in enumerate(args) if i not in static_pos)
    static_args = {i: a for i, a in enumerate(args) if i in static_pos}
    dyn_kwargs = {k: v for k, v in kwargs.items() if k not in argnames}
    static_kwargs = {k: v for k, v in kwargs.items() if k in argnames}

    leaves, treedef = optree.tree_flatten((dyn_args, dyn_kwargs), none_is_leaf=True)
    tpos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    inputs = [leaves[i] for i in tpos]
    for a in (*static_args.values(), *static_kwargs.values()):
        for x in optree.tree_leaves(a, none_is_leaf=True):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                raise RematError(
                    f"remat({name}) got a tensor {tuple(x.shape)} that requires grad in a static "
                    "argument; static arguments are constants and get no gradient. Fix: remove "
                    "it from static_argnums/static_argnames."
                )

    def run(tensors):
        lv = list(leaves)
        for i, t in zip(tpos, tensors):
            lv[i] = t
        a, kw = optree.tree_unflatten(treedef, lv)
        if static_pos:
            it = iter(a)
            a = tuple(static_args[i] if i in static_pos else next(it) for i in range(nargs))
        if static_kwargs:
            kw = {**kw, **static_kwargs}
        out = fun(*a, **kw)
        oleaves, odef = flatten_output(out, name)
        opos = [i for i, x in enumerate(oleaves) if isinstance(x, torch.Tensor)]
        outs = tuple(oleaves[i] for i in opos)
        template = [None if isinstance(x, torch.Tensor) else x for x in oleaves]  # no tensor refs

        def rebuild(out_tensors):
            ol = list(template)
            for i, t in zip(opos, out_tensors):
                ol[i] = t
            return optree.tree_unflatten(odef, ol)

        return outs, rebuild

    devices = devices_of(inputs) if (preserve_rng_state and _has_accelerator()) else []
    others = [x for x in leaves if not isinstance(x, torch.Tensor)]
    roots = (fun, others, static_args, static_kwargs) if (others or static_args or static_kwargs) else fun
    outs, rebuild = functional_call(
        run, inputs, {id(t) for t in inputs}, roots, name, preserve_rng_state, debug, devices, pol
    )
    return rebuild(outs)
