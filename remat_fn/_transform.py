"""The public transform: ``remat`` / ``checkpoint``.

Data flows one way.  ``remat(fun, **options)`` validates the options once
(:class:`~remat_fn._region.Options`) and returns a wrapper; each call of the
wrapper becomes a :class:`~remat_fn._region.RegionCall` (function, options,
arguments normalised) that is handed to exactly one autograd path:

- :mod:`remat_fn._path_compile` while ``torch.compile`` traces;
- :mod:`remat_fn._path_torch_func` under ``torch.func`` transforms (and when
  saved-tensor hooks are unavailable);
- :mod:`remat_fn._path_hooks`, plain autograd with saved-tensor hooks,
  otherwise.
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from ._errors import explain_misuse
from ._functorch import nested_forward_mode, transforms_active
from ._hook_targets import claiming
from ._path_compile import run_compiled
from ._path_hooks import NeedsTorchFuncPath, hooks_enabled, run_with_hooks
from ._path_torch_func import run_torch_func
from ._profile import region_name
from ._region import Options, RegionCall, entered, name_of
from ._torch_internals import pop_hooks as _pop_hooks
from ._torch_internals import push_hooks as _push_hooks
from .policies import everything_saveable

__all__ = ["remat", "checkpoint", "call_once", "make_wrapper", "RematFunction"]

F = TypeVar("F", bound=Callable[..., Any])


# keywords of torch.utils.checkpoint.checkpoint that remat does not take
_TORCH_CHECKPOINT_KWARGS = frozenset({"use_reentrant", "context_fn", "determinism_check", "early_stop"})


def _torch_habit(args: tuple, kwargs: dict) -> str | None:
    """The fix for calling ``remat`` as ``torch.utils.checkpoint.checkpoint(fn, *args)``."""
    if len(args) <= 1 and not _TORCH_CHECKPOINT_KWARGS & kwargs.keys():
        return None
    return ("remat(fn) (alias checkpoint, as in JAX) takes only the function and returns a "
            "wrapper to call with the arguments: remat(fn)(*args). For torch.utils.checkpoint's "
            "form checkpoint(fn, *args, use_reentrant=..., ...), use "
            "remat_fn.compat.checkpoint(fn, *args).")


@explain_misuse(_torch_habit)
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
      policy ``policy(ctx, op, *args, **kwargs)``, or a list of aten ops to save
      (or one op, ``torch.ops.aten.mm.default``: a list of one).
      ``None`` (the default) is ``nothing_saveable``: only the inputs are kept.
    - `static_argnums` / `static_argnames`: arguments passed through as they
      are, never flattened (Python values that shape the computation).  A
      tensor there that requires grad gets its gradient as a tensor ``fun``
      closes over does, in eager mode and under ``torch.func``.
    - `prevent_cse`: accepted for JAX parity.  Eager PyTorch has no common
      subexpression elimination to prevent; under ``torch.compile`` the region
      is always traced as torch's checkpoint region, which the compiler
      recomputes as the policy says and does not merge away.
    - `preserve_rng_state`: snapshot the global CPU and device RNG states so
      that random ops (``nn.Dropout``) recompute bit for bit.  A region that
      draws no random numbers keeps no state.
    - `debug`: record op traces so that a :class:`RecomputeMismatchError`
      shows both runs with user source lines.

    **Returns:** a callable with the signature of ``fun`` (a :class:`RematFunction`:
    it binds as a method, and ``copy.deepcopy``/``pickle`` copy ``fun`` with it).

    >>> import torch, remat_fn
    >>> f = remat_fn.remat(lambda x: torch.sin(x).sin())
    >>> x = torch.tensor([0.5, 1.0])
    >>> torch.allclose(torch.func.grad(lambda x: f(x).sum())(x),
    ...                torch.cos(torch.sin(x)) * torch.cos(x))
    True
    """
    opts = Options.create(policy=policy, static_argnums=static_argnums,
                          static_argnames=static_argnames, prevent_cse=prevent_cse,
                          preserve_rng_state=preserve_rng_state, debug=debug)
    if fun is None:
        def decorator(*args, **kwargs):
            if len(args) != 1 or kwargs or not callable(args[0]):
                got = ", ".join([*(type(a).__name__ for a in args), *(f"{k}=..." for k in kwargs)])
                raise TypeError(
                    f"remat(policy=...) returns a decorator: call it on a function first, "
                    f"remat(fn, policy=...)(x, ...) or @remat(policy=...) above a def; it was called "
                    f"with ({got}) instead of one function."
                )
            return make_wrapper(args[0], opts)
        return decorator  # type: ignore[return-value]
    return make_wrapper(fun, opts)


checkpoint = remat


def _check_fun(fun: Any, opts: Options) -> None:
    if not callable(fun):
        raise TypeError(
            f"remat expects a callable (function, bound method or nn.Module), got "
            f"{type(fun).__name__}. Use @remat on a function or remat(module)."
        )
    if not opts.static_argnames:
        return
    try:
        sig = inspect.signature(fun)
    except (TypeError, ValueError):  # builtins without a signature
        return
    params = sig.parameters
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for n in opts.static_argnames:
        if n not in params and not has_var_kw:
            raise ValueError(
                f"static_argnames names {n!r}, which is not a parameter of "
                f"{name_of(fun)}{sig}. Fix the name or remove it from static_argnames."
            )


class RematFunction:
    """What ``remat(fun, ...)`` returns: calls ``fun`` as one rematerialised region.

    A callable object rather than a closure, so that it copies and pickles with
    what it wraps: ``copy.deepcopy`` deep-copies ``fun`` through the memo (a
    module holding ``self.f = remat(self.sub)`` deep-copies into one whose
    ``f`` calls the copy's ``sub``, not the original's), and ``pickle`` /
    ``torch.save`` store ``fun`` and the options and rebuild the wrapper on
    load.  A wrapper that is a module-level name (``@remat`` above a ``def``,
    or a method in a class body) pickles by reference, as functions do.

    It carries ``__name__``, ``__qualname__``, ``__doc__``, ``__module__`` and
    ``__wrapped__`` (so :func:`inspect.signature` shows ``fun``'s signature)
    and ``remat_options``, and binds as a method when it is a class attribute.
    """

    __slots__ = ("__dict__", "__weakref__", "_fun", "_name", "_opts", "_factory")
    _fun: Any
    _name: str
    _opts: Options
    _factory: Callable[..., Any] | None  # rebuilds it on unpickling: factory(fun, **remat_options)
    __wrapped__: Any
    __name__: str
    __qualname__: str
    remat_options: dict[str, Any]

    def __call__(self, *args, **kwargs):
        return run_region(RegionCall(self._fun, self._name, self._opts, args, kwargs))

    def __get__(self, obj, objtype=None):
        return self if obj is None else types.MethodType(self, obj)

    def __repr__(self) -> str:
        return f"<remat_fn.remat of {self._fun!r}>"

    def __copy__(self):
        return self  # as for functions

    def __deepcopy__(self, memo):
        fun = copy.deepcopy(self._fun, memo)
        if fun is self._fun:
            return self  # a plain function: nothing to copy, as for functions
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.__wrapped__ = fun
        new._fun, new._name, new._opts, new._factory = fun, self._name, self._opts, self._factory
        return new

    def __reduce_ex__(self, protocol):
        if _is_global(self):
            return self.__qualname__  # by reference, like a module-level function
        if self._factory is None:
            raise TypeError(
                f"cannot pickle {self!r}: it has outer saved-tensor hooks and no factory to "
                "rebuild it from its options. Fix: build the wrapper again after loading instead "
                "of storing it on the pickled object (copy.deepcopy works), or set its _factory."
            )
        # (a list-of-ops policy, normalised, pickles by op name itself)
        return (_rebuild, (self._factory, self._fun, dict(self.remat_options)))


class _SaveEverything(RematFunction):
    """``remat(fun, policy=everything_saveable)``: saving everything autograd needs is
    exactly what plain autograd does, so the call is plain (as in JAX, it keeps no
    more than no remat); outer hooks (:mod:`remat_fn.distributed`) still store
    what autograd saves."""

    __slots__ = ()

    def __call__(self, *args, **kwargs):
        opts = self._opts
        if opts.outer_hooks is None:
            return self._fun(*args, **kwargs)
        call = RegionCall(self._fun, self._name, opts, args, kwargs)
        return _under(opts.outer_hooks(call), self._fun, *args, **kwargs)


def _rebuild(factory: Callable[..., Any], fun: Any, kwargs: dict) -> Any:
    """Unpickling a :class:`RematFunction`: ``factory(fun, **kwargs)``."""
    return factory(fun, **kwargs)


def _is_global(w: RematFunction) -> bool:
    """``w`` is what its module's ``__qualname__`` names (so pickle can find it)."""
    mod = sys.modules.get(getattr(w, "__module__", None) or "")
    qualname = getattr(w, "__qualname__", "") or ""
    if mod is None or "<locals>" in qualname or not qualname:
        return False
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return False
    return obj is w


def make_wrapper(fun: Any, opts: Options) -> Any:
    """The :class:`RematFunction` ``remat(fun, ...)`` returns, for validated ``opts``."""
    _check_fun(fun, opts)
    cls = _SaveEverything if opts.policy is everything_saveable else RematFunction
    wrapper = object.__new__(cls)
    # copy fun's attributes as functools.wraps does, but not a module's state (its
    # parameters dict) or another wrapper's internals
    copies_dict = not isinstance(fun, (torch.nn.Module, RematFunction))
    try:
        functools.update_wrapper(wrapper, fun, updated=("__dict__",) if copies_dict else ())
    except (AttributeError, TypeError):  # pragma: no cover
        pass
    wrapper.__wrapped__ = fun
    if isinstance(fun, torch.nn.Module):
        wrapper.__name__ = type(fun).__name__
        wrapper.__qualname__ = type(fun).__qualname__
        wrapper.__doc__ = type(fun).__doc__
        wrapper.__module__ = type(fun).__module__
    wrapper._fun = fun
    wrapper._name = region_name(name_of(fun), opts.policy)  # (profile() rows: by name and policy)
    wrapper._opts = opts
    # what pickling rebuilds it with (None: it cannot be rebuilt from its public options)
    wrapper._factory = remat if opts.outer_hooks is None else None
    wrapper.remat_options = opts.public()  # type: ignore[attr-defined]
    return wrapper


def call_once(fun, args: tuple, kwargs: dict, *, policy: Any = None, preserve_rng_state: bool = True,
              debug: bool = False):
    """``remat(fun, policy=..., ...)(*args, **kwargs)`` without building a wrapper:
    the form of one-shot callers (``remat_fn.compat.checkpoint``, the forward of
    ``remat_fn.nn.remat_module``), which would otherwise pay for a new wrapper
    (signature checks, ``functools.wraps``) on every call."""
    if torch.compiler.is_compiling():
        # Dynamo cannot trace into the options cache (a C function): while it
        # traces, the options are built afresh, which it traces like any Python
        opts = Options.create(policy=policy, preserve_rng_state=preserve_rng_state, debug=debug)
        if opts.policy is everything_saveable:
            return fun(*args, **kwargs)
        return run_compiled(RegionCall(fun, name_of(fun), opts, args, kwargs))
    opts = _opts_for(policy, preserve_rng_state, debug)
    if opts.policy is everything_saveable:
        return fun(*args, **kwargs)
    return run_region(RegionCall(fun, region_name(name_of(fun), opts.policy), opts, args, kwargs))


@functools.lru_cache(maxsize=256)
def _cached_opts(policy: Any, preserve_rng_state: bool, debug: bool) -> Options:
    return Options.create(policy=policy, preserve_rng_state=preserve_rng_state, debug=debug)


def _opts_for(policy: Any, preserve_rng_state: bool, debug: bool) -> Options:
    try:
        return _cached_opts(policy, preserve_rng_state, debug)
    except TypeError:  # an unhashable policy (a list of ops, a stateful object)
        return Options.create(policy=policy, preserve_rng_state=preserve_rng_state, debug=debug)


def run_region(call: RegionCall) -> Any:
    """One call of a region, on the path that fits where it is called."""
    if torch.compiler.is_compiling():
        return run_compiled(call)
    with entered():
        if transforms_active():
            if nested_forward_mode():
                return call.fun(*call.args, **call.kwargs)
            return run_torch_func(call)
        if not torch.is_grad_enabled():
            return call.fun(*call.args, **call.kwargs)  # nothing is saved without grad mode
        call.check_argnums()
        if not hooks_enabled():
            # saved-tensor hooks are switched off (e.g. by a failed torch.compile);
            # the autograd.Function path needs none.
            return run_torch_func(call)
        if call.calls_torch_func:
            return run_torch_func(call, calls_torch_func=True)
        outer = call.opts.outer_hooks(call) if call.opts.outer_hooks is not None else None
        try:
            return _under(outer, run_with_hooks, call)
        except NeedsTorchFuncPath as e:
            # fun calls torch.func.grad/vjp/...: the autograd.Function path needs no hooks (the
            # try's writes into tensors from outside were put back, see run_with_hooks)
            call.note_torch_func()
            with claiming(e.tensors, e.first_hook):
                return run_torch_func(call, calls_torch_func=True)


def _under(hooks, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with the saved-tensor ``hooks`` pair pushed (none: as is)."""
    if hooks is None:
        return fn(*args, **kwargs)
    _push_hooks(*hooks)
    try:
        return fn(*args, **kwargs)
    finally:
        _pop_hooks()
