"""One call of a region, normalised once: what every autograd path receives.

The public layer (:mod:`remat_fn._transform`) validates ``remat``'s keyword
options once, when the wrapper is built (:class:`Options`), and turns each call
into a :class:`RegionCall`: the function, its name, the options, the
arguments split into static and dynamic parts, the dynamic pytree flattened
with its tensor leaves picked out, and the ``run``/``rebuild`` pair that calls
the function on replacement tensors.  The autograd paths
(:mod:`remat_fn._path_hooks`, :mod:`remat_fn._path_torch_func`,
:mod:`remat_fn._path_compile`) and :mod:`remat_fn.distributed` read it; none of
them splits or flattens arguments again.

Flattening is lazy: the saved-tensor-hooks path calls the function on the
original arguments and flattens only when it needs the tensors (accelerator
RNG devices, a ``memory_budget`` plan), so a plain eager call pays for none.

The state a call ran under that a recomputation re-enters is here too, for both paths:
the global generators' states (:class:`RNGSnapshot`, ``preserve_rng_state=True``) and
the autocast state and default device (:class:`AutocastState`).

RNG: the region's forward draws from torch's global generators (CPU, plus one per
accelerator device).  To recompute bitwise-identically their states are snapshotted
before the forward and restored around the recomputation, the caller's current states
put back afterwards.  A snapshot the forward did not advance is dropped at the end of
the forward (:meth:`RNGSnapshot.finish`), so a region that draws no random numbers keeps
no state and its recomputation touches no generator.  Accelerator states go through
:func:`torch.get_device_module`, so CUDA (and any backend with the same
``get_rng_state``/``set_rng_state`` API) is covered; only the CPU path is exercised on
this project's CI machines.

Autocast: like ``torch.utils.checkpoint`` (``_get_autocast_kwargs``), a region records at
forward whether autocast is enabled, its dtype for every device type that has autocast
(CPU, CUDA and the current accelerator), and the cache flag; the recomputation runs
under exactly that state, whatever the state is when backward runs (usually outside any
``torch.autocast`` block): without this a region called under
``torch.autocast("cpu", dtype=torch.bfloat16)`` recomputes in float32.  The state is set
with torch's own setters, as ``torch.autocast.__enter__`` does, so the same code path
serves every device type; on a machine without CUDA the CUDA flags are still recorded
and restored.  The default device of a ``with torch.device(...)`` block is recorded and
re-entered the same way, so tensors the function creates without a device land where
they did in the forward.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import optree
import torch

from ._ambient import AMBIENT, SWITCHES
from ._budget import BudgetPlanner
from ._ops import is_default_generator, same_state
from ._pytree import flatten_output
from .policies import memory_budget, normalize_policy

__all__ = ["Options", "RegionCall", "as_caller", "entered", "region_depth", "name_of", "RNGSnapshot", "AutocastState",
           "devices_of"]

_accelerator: list[bool] = []
# region functions (the very objects) that called a torch.func transform, which refuses the
# hooks path's saved-tensor hooks: their later calls start on the torch.func path
_CALLS_TORCH_FUNC: weakref.WeakSet = weakref.WeakSet()


def _has_accelerator() -> bool:
    if not _accelerator:
        try:
            _accelerator.append(bool(torch.accelerator.is_available()))
        except Exception:  # pragma: no cover - torch without torch.accelerator
            _accelerator.append(torch.cuda.is_available())
    return _accelerator[0]


def name_of(fun: Any) -> str:
    # remat_module's forward binds the module with functools.partial (Dynamo on
    # torch 2.12 cannot trace function.__get__): the region is named after the method
    while isinstance(fun, functools.partial):
        fun = fun.func
    return getattr(fun, "__qualname__", None) or getattr(fun, "__name__", None) or type(fun).__name__


def _argnums(static_argnums: int | Sequence[int]) -> tuple[int, ...]:
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


def _argnames(static_argnames: str | Sequence[str]) -> frozenset[str]:
    if isinstance(static_argnames, str):
        static_argnames = (static_argnames,)
    names = tuple(static_argnames)
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"static_argnames must contain strings, got {n!r}")
    return frozenset(names)


# (pack, unpack) saved-tensor hooks to push around a region's eager call, or None
OuterHooks = Callable[["RegionCall"], "tuple[Callable, Callable] | None"]


@dataclasses.dataclass(frozen=True)
class Options:
    """``remat``'s keyword options, validated (see :meth:`create`)."""

    policy: Any = None  # normalised: None (nothing_saveable), a callable, or memory_budget
    static_argnums: tuple[int, ...] = ()
    static_argnames: frozenset[str] = frozenset()
    prevent_cse: bool = True
    preserve_rng_state: bool = True
    debug: bool = False
    planner: BudgetPlanner | None = None  # set for memory_budget policies
    outer_hooks: OuterHooks | None = None  # remat_fn.distributed's partitioning hooks

    @classmethod
    def create(cls, *, policy: Any = None, static_argnums: int | Sequence[int] = (),
               static_argnames: str | Sequence[str] = (), prevent_cse: bool = True,
               preserve_rng_state: bool = True, debug: bool = False,
               outer_hooks: OuterHooks | None = None) -> Options:
        if not isinstance(preserve_rng_state, bool):
            raise TypeError(f"preserve_rng_state must be a bool, got {preserve_rng_state!r}")
        policy = normalize_policy(policy)
        return cls(policy=policy, static_argnums=_argnums(static_argnums),
                   static_argnames=_argnames(static_argnames), prevent_cse=prevent_cse,
                   preserve_rng_state=preserve_rng_state, debug=debug,
                   planner=BudgetPlanner(policy) if isinstance(policy, memory_budget) else None,
                   outer_hooks=outer_hooks)

    def flat(self) -> Options:
        """These options for the region's function as a replay runs it: on its tensors, flat (no static arguments)."""
        if not self.static_argnums and not self.static_argnames:
            return self
        return dataclasses.replace(self, static_argnums=(), static_argnames=frozenset())

    def public(self) -> dict[str, Any]:
        """The options as ``remat(...)`` takes them (``wrapper.remat_options``)."""
        return dict(policy=self.policy, static_argnums=self.static_argnums,
                    static_argnames=tuple(self.static_argnames), prevent_cse=self.prevent_cse,
                    preserve_rng_state=self.preserve_rng_state, debug=self.debug)


class RegionCall:
    """One call of a region: the function, its options and its arguments, normalised.

    ``debug``/``strict`` are the recompute checks in force for this call (the
    region's ``debug=`` and the global switches, see :mod:`remat_fn._debug`).
    The dynamic arguments, flattened on first use: ``leaves``/``treedef`` of
    ``(dynamic args, dynamic kwargs)``, ``inputs`` their tensor leaves.
    """

    __slots__ = ("fun", "name", "opts", "args", "kwargs", "_checks",
                 "_static_pos", "_static_args", "_static_kwargs", "_leaves", "_treedef", "_tpos")

    def __init__(self, fun: Any, name: str, opts: Options, args: tuple, kwargs: dict):
        self.fun = fun
        self.name = name
        self.opts = opts
        self.args = args
        self.kwargs = kwargs
        self._checks: tuple[bool, bool] | None = None
        self._leaves: list | None = None

    @property
    def debug(self) -> bool:
        """Record op traces for this call (``debug=`` or the global switch)."""
        if self._checks is None:
            self._checks = self._read_checks()
        return self._checks[0]

    @property
    def strict(self) -> bool:
        """Run recomputations whole and check them completely (no early stop)."""
        if self._checks is None:
            self._checks = self._read_checks()
        return self._checks[1]

    def _read_checks(self) -> tuple[bool, bool]:
        g = SWITCHES.debug  # (remat_fn.set_debug_enabled: over every region's debug=)
        debug = g if g is not None else bool(self.opts.debug)
        return debug, debug or not AMBIENT.early_stop

    @property
    def calls_torch_func(self) -> bool:
        """The function called a ``torch.func`` transform before (see :meth:`note_torch_func`)."""
        try:
            return self.fun in _CALLS_TORCH_FUNC
        except TypeError:  # (an object weak references cannot reach)
            return False

    def note_torch_func(self) -> None:
        """The function calls a ``torch.func`` transform: its later calls skip the try on the
        saved-tensor-hooks path (its Python would run twice per forward).  Only the same
        object: a lambda made per call, or a bound method, is tried each time."""
        try:
            _CALLS_TORCH_FUNC.add(self.fun)
        except TypeError:
            pass

    # -- arguments -----------------------------------------------------------
    def check_argnums(self) -> None:
        nargs = len(self.args)
        for n in self.opts.static_argnums:
            if not -nargs <= n < nargs:
                raise ValueError(
                    f"static_argnums contains {n}, but remat({self.name}) was called with {nargs} "
                    "positional arguments. Fix static_argnums or pass the argument positionally."
                )

    def _flatten(self) -> None:
        self.check_argnums()
        args, kwargs, opts = self.args, self.kwargs, self.opts
        nargs = len(args)
        pos = {n % nargs for n in opts.static_argnums} if nargs else set()
        names = opts.static_argnames
        self._static_pos = pos
        self._static_args = {i: a for i, a in enumerate(args) if i in pos}
        self._static_kwargs = {k: v for k, v in kwargs.items() if k in names}
        dyn_args = tuple(a for i, a in enumerate(args) if i not in pos) if pos else args
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in names} if names else kwargs
        leaves, self._treedef = optree.tree_flatten((dyn_args, dyn_kwargs), none_is_leaf=True)
        self._tpos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self._leaves = leaves

    @property
    def inputs(self) -> list[torch.Tensor]:
        """The tensor leaves of the dynamic arguments, in pytree order."""
        if self._leaves is None:
            self._flatten()
        leaves = self._leaves
        return [leaves[i] for i in self._tpos]  # type: ignore[index]

    def all_tensors(self) -> list[torch.Tensor]:
        """Every tensor among the arguments, static ones included."""
        leaves = optree.tree_leaves((self.args, self.kwargs), none_is_leaf=True)
        return [x for x in leaves if isinstance(x, torch.Tensor)]

    def reach_roots(self) -> Any:
        """What the closed-over-tensor walk starts from: the function, plus any
        non-tensor leaves and static arguments (objects that may hold tensors)."""
        if self._leaves is None:
            self._flatten()
        others = [x for x in self._leaves if not isinstance(x, torch.Tensor)]  # type: ignore[union-attr]
        if others or self._static_args or self._static_kwargs:
            return (self.fun, others, self._static_args, self._static_kwargs)
        return self.fun

    def rng_devices(self, tensors: list[torch.Tensor] | None = None) -> list[torch.device]:
        """The accelerator devices whose RNG state the region snapshots (none
        without ``preserve_rng_state`` or without an accelerator)."""
        if not (self.opts.preserve_rng_state and _has_accelerator()):
            return []
        return devices_of(self.all_tensors() if tensors is None else tensors)

    def policy(self, path: str, tensors: list[torch.Tensor] | None = None):
        """The policy in force for this call on ``path`` (a ``memory_budget`` gives
        its cached plan for these inputs, or the measuring policy that makes it)."""
        planner = self.opts.planner
        if planner is None:
            return self.opts.policy
        return planner.policy_for(self.fun, self.all_tensors() if tensors is None else tensors, path)

    def drop_tensors(self) -> None:
        """Forget the argument tensors (:meth:`run` takes replacements), so that the
        call, which lives as long as the region's graph, does not keep offloaded
        inputs alive on their device."""
        if self._leaves is None:
            self._flatten()
        for i in self._tpos:
            self._leaves[i] = None  # type: ignore[index]
        self.args = (None,) * len(self.args)
        self.kwargs = {}

    # -- running -------------------------------------------------------------
    def run(self, tensors) -> tuple[tuple[torch.Tensor, ...], Callable[[Any], Any]]:
        """Call the function with ``tensors`` in place of :attr:`inputs`; returns
        the output's tensor leaves and a ``rebuild(tensors) -> output``."""
        if self._leaves is None:
            self._flatten()
        lv = list(self._leaves)  # type: ignore[arg-type]
        for i, t in zip(self._tpos, tensors):
            lv[i] = t
        a, kw = optree.tree_unflatten(self._treedef, lv)
        pos = self._static_pos
        if pos:
            it = iter(a)
            a = tuple(self._static_args[i] if i in pos else next(it) for i in range(len(self.args)))
        if self._static_kwargs:
            kw = {**kw, **self._static_kwargs}
        out = self.fun(*a, **kw)
        oleaves, odef = flatten_output(out, self.name)
        opos = [i for i, x in enumerate(oleaves) if isinstance(x, torch.Tensor)]
        outs = tuple(oleaves[i] for i in opos)
        template = [None if isinstance(x, torch.Tensor) else x for x in oleaves]  # no tensor refs

        def rebuild(out_tensors):
            ol = list(template)
            for i, t in zip(opos, out_tensors):
                ol[i] = t
            return optree.tree_unflatten(odef, ol)

        return outs, rebuild




def region_depth() -> int:
    """How many remat regions this thread is inside of (see :func:`entered`)."""
    return AMBIENT.depth


class _Entered:
    __slots__ = ()

    def __enter__(self):
        AMBIENT.depth += 1

    def __exit__(self, *exc):
        AMBIENT.depth -= 1


_ENTERED = _Entered()


class _AsCaller:
    """One region up, for an op a region makes for its caller after its call (see entered)."""

    __slots__ = ()

    def __enter__(self):
        AMBIENT.depth -= 1

    def __exit__(self, *exc):
        AMBIENT.depth += 1


as_caller = _AsCaller()


def entered() -> _Entered:
    """Mark a remat region's call: the op trace of an enclosing region treats the
    whole nested call as opaque (it may run plainly in one run and as a custom
    ``autograd.Function`` in the other)."""
    return _ENTERED


# -- the state a recomputation re-enters: RNG ------------------------------------
def devices_of(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """Return the distinct non-CPU devices among ``tensors``."""
    seen: list[torch.device] = []
    for t in tensors:
        d = t.device
        if d.type not in ("cpu", "meta") and d not in seen:
            seen.append(d)
    return seen


def _device_state_api(device: torch.device):
    try:
        mod = torch.get_device_module(device.type)
    except (RuntimeError, AttributeError):  # pragma: no cover - exotic backends
        return None
    if not (hasattr(mod, "get_rng_state") and hasattr(mod, "set_rng_state")):
        return None  # pragma: no cover
    return mod


class RNGSnapshot:
    """States of the CPU generator and of the given devices' generators."""

    __slots__ = ("cpu", "devices", "explicit", "_saved_cpu", "_saved_dev", "_saved_explicit")

    def __init__(self, devices: list[torch.device]):
        self.explicit: list[tuple[torch.Generator, torch.Tensor]] = []  # (the function's own generators, see finish)
        self._saved_explicit: list = []
        self.cpu: torch.Tensor | None = torch.get_rng_state()
        self.devices: list[tuple[torch.device, torch.Tensor]] = []
        for d in devices:
            mod = _device_state_api(d)
            if mod is not None:  # pragma: no cover - needs an accelerator
                self.devices.append((d, mod.get_rng_state(d)))

    def finish(self, tape=None) -> bool:
        """Drop states the forward did not advance; return True if any remain.  ``tape``: the forward's
        tape, whose draws from a generator of the function's own (``torch.rand(..., generator=g)``) a run
        again of the function starts from too (it drew the forward's values again from where ``g`` had
        moved on, and left ``g`` moved twice: 0.14 to 1.7 off under ``jacfwd``, eager forward mode,
        ``debug=True``, a hostile pass)."""
        if tape is not None:
            self.note_draws(tape)
        if self.cpu is not None:
            now = torch.get_rng_state()
            if same_state(now, self.cpu):
                self.cpu = None
        kept = []
        for d, s in self.devices:  # pragma: no cover - needs an accelerator
            now = _device_state_api(d).get_rng_state(d)
            if not same_state(now, s):
                kept.append((d, s))
        self.devices = kept
        return self.cpu is not None or bool(self.devices) or bool(self.explicit)

    def note_draws(self, tape) -> None:
        """The generators of the function's own ``tape`` drew from, as they were before (see finish)."""
        self.explicit = [(g, s) for g, s in tape.first_draws.values() if not is_default_generator(g)]

    def restore_now(self) -> None:
        """Set the generators back to the snapshot (used to retry a forward)."""
        if self.cpu is not None:
            torch.set_rng_state(self.cpu)
        for d, s in self.devices:  # pragma: no cover - needs an accelerator
            _device_state_api(d).set_rng_state(s, d)

    def __enter__(self) -> RNGSnapshot:
        """Install the snapshot, remembering the caller's states."""
        self._saved_cpu = torch.get_rng_state() if self.cpu is not None else None
        self._saved_dev = []
        for d, s in self.devices:  # pragma: no cover - needs an accelerator
            mod = _device_state_api(d)
            self._saved_dev.append((mod, d, mod.get_rng_state(d)))
            mod.set_rng_state(s, d)
        if self.cpu is not None:
            torch.set_rng_state(self.cpu)
        self._saved_explicit = [(g, g.get_state()) for g, _ in self.explicit]
        for g, s in self.explicit:
            g.set_state(s)
        return self

    def __exit__(self, *exc) -> None:
        if self._saved_cpu is not None:
            torch.set_rng_state(self._saved_cpu)
        for mod, d, s in self._saved_dev:  # pragma: no cover - needs an accelerator
            mod.set_rng_state(s, d)
        for g, s in self._saved_explicit:
            g.set_state(s)
        self._saved_cpu = None
        self._saved_dev = []
        self._saved_explicit = []


# -- autocast and the default device ---------------------------------------------
def _device_types() -> tuple[str, ...]:
    types = ["cpu", "cuda"]
    try:
        acc = torch.accelerator.current_accelerator()
        if acc is not None and acc.type not in types:
            types.append(acc.type)
    except Exception:  # pragma: no cover - builds without torch.accelerator
        pass
    return tuple(t for t in types if torch.amp.is_autocast_available(t))


_TYPES = _device_types()


class AutocastState:
    """A snapshot of the autocast flags; ``with state:`` runs under it."""

    __slots__ = ("flags", "cache", "device", "_saved")

    def __init__(self) -> None:
        self.flags = tuple(
            (t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in _TYPES
        )
        self.cache = torch.is_autocast_cache_enabled()
        self.device = torch.get_default_device()
        self._saved: list = []

    def _autocast_same(self, other: AutocastState) -> bool:
        return self.flags == other.flags and self.cache == other.cache

    def _set(self) -> None:
        for t, enabled, dtype in self.flags:
            torch.set_autocast_enabled(t, enabled)
            torch.set_autocast_dtype(t, dtype)
        torch.set_autocast_cache_enabled(self.cache)

    def __enter__(self) -> AutocastState:
        now = AutocastState()
        autocast = not self._autocast_same(now)
        device = torch.device(self.device) if self.device != now.device else None
        if autocast:
            torch.autocast_increment_nesting()
            self._set()
        if device is not None:
            device.__enter__()
        self._saved.append((now if autocast else None, device))
        return self

    def __exit__(self, *exc) -> None:
        now, device = self._saved.pop()
        if device is not None:
            device.__exit__(*exc)
        if now is None:
            return
        now._set()
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
