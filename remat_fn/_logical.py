"""The region's forward as the function called torch: its torch calls, recorded at the torch-function
level (where tensors are the logical ones every transform sees), replayed in place of the function's
Python where a run again would otherwise run it.

The aten tape (:mod:`remat_fn._tape`) records the ops below every functorch level, as ``vmap`` batched
them; a replay of those ops stands for the function wherever the levels that differentiate its
backward sit below the vmaps, or there are none.  Under ``vmap(hessian(f))``, ``vmap(grad(grad(f)))``,
``vmap(jvp(grad(f)))`` or MAML's ``grad(vmap(grad(f)))`` a level above a vmap differentiates the
backward: it must see the ops as the function called them, before the vmap batched them.  This tape
holds them so: each call's function, its arguments (the region's inputs by position, what an earlier
call made by its place, anything else as the object itself), the grad mode it ran under.  A replay
calls them again, in order, through the same capture mode a run again runs under (so the tensors the
function closes over are replaced, its writes go to private copies, its side outputs are found, its
calls are checked against the forward's), and the function's Python does not run: what it did
besides calling torch (a counter, a list it appends to) is not done twice, and does not change the
gradient.

It is recorded where the caller asks (``RegionState.logical``): a level above a vmap may differentiate
the backward (see above_vmaps), or a vmap outside the grad level keeps apart the examples' gradients of
an input it does not batch (``RegionState.apart``), which a replay of the batched ops would sum
(``vmap(jacrev(f))``, ``vmap(grad(vmap(f)))``, a vjp_fn under the vmap); and in a region nested in
one that records, whose call the enclosing tape holds as one call (see :meth:`LogicalTape.region`).
A forward the tape cannot stand for is not recorded (the run again stays): a region calling a custom
``autograd.Function``, holding a nested region with side outputs or a memory budget, calling
``torch.func`` itself, reading ``.data``, a hook or ``autograd`` inside, a tensor made where no torch
function mode sees it, an argument that is no tensor, generator, numpy array or number, or immutable
value, autocast or inference mode changed inside, the global seed set inside, a call that raised.
"""

from __future__ import annotations

import functools
import weakref

import optree
import torch

from ._functorch import current_level, unwrap_all
from ._ops import is_default_generator
from ._torch_internals import DisableTorchFunction, any_autocast_enabled, set_grad_mode

__all__ = ["LogicalTape"]


class _In:
    """The region's ``k``-th argument (as the function receives them)."""

    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k


class _Made:
    """The ``j``-th tensor call ``c`` returned."""

    __slots__ = ("c", "j")

    def __init__(self, c: int, j: int):
        self.c, self.j = c, j


class _Const:
    """The ``i``-th tensor a nested region's tape reads from the enclosing region (what that region made, or
    an argument of it): each replay of the enclosing one hands it anew (see :meth:`LogicalTape.region`)."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


class _Gen:
    """A ``torch.Generator`` argument: its state when the forward drew, drawn again from a copy."""

    __slots__ = ("state", "device")

    def __init__(self, g: torch.Generator):
        self.state, self.device = g.get_state(), g.device

    def fresh(self) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.set_state(self.state)
        return g


class _Array:
    """A numpy array argument (``torch.tensor(array)``): its contents at the call, handed to each replay as
    a fresh copy (numpy's writes after the forward do not reach it; the replay's writes do not reach numpy)."""

    __slots__ = ("data",)

    def __init__(self, a):
        self.data = a.copy()

    def fresh(self):
        return self.data.copy()


def _numpy(x) -> str | None:
    """``"array"`` for a numpy array of numbers (a subclass too), ``"scalar"`` for a numpy number (immutable),
    else None; told without importing numpy, which the library does not depend on."""
    t = type(x)
    if t.__module__ != "numpy" and not any(c.__module__ == "numpy" for c in t.__mro__[1:]):
        return None
    kind = getattr(getattr(x, "dtype", None), "kind", None)
    if kind is None or kind not in "biufc":
        return None
    return "array" if any(c.__name__ == "ndarray" and c.__module__ == "numpy" for c in t.__mro__) else "scalar"


# what a call's argument may be besides tensors and generators: values nothing changes after the call
_CONSTANTS = frozenset({int, float, bool, complex, str, bytes, type(None), type(...), range, torch.dtype, torch.device,
                        torch.layout, torch.memory_format, torch.Size})


def _tensors_of(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):  # (torch.return_types too)
        return [t for t in optree.tree_leaves(out, none_is_leaf=True) if isinstance(t, torch.Tensor)]
    return []


def _autocast() -> bool:
    return bool(any_autocast_enabled()) if any_autocast_enabled is not None else torch.is_autocast_enabled()


class LogicalTape:
    """The torch calls of one forward of a region (see the module's docstring).

    ``args``: the tensors the function receives, by position; ``tape``: the region's aten tape, which
    tells a tensor the forward made (a constant must not be one)."""

    __slots__ = ("ok", "calls", "outs", "rebuild", "_ids", "_last", "_tape", "_base", "_state", "_mark")

    def __init__(self, args, tape):
        self.ok = True
        # (func, argument leaves, their structure, grad mode, the generator states it drew from, then what to drop after it)
        self.calls: list = []
        self.outs: list = []
        self.rebuild = None
        self._ids: dict[int, tuple] = {}  # id -> (weak ref, _In or _Made)
        for k, a in enumerate(args):
            if isinstance(a, torch.Tensor) and id(a) not in self._ids:
                self._ids[id(a)] = (weakref.ref(a), _In(k))
        self._last: dict[tuple[int, int], int] = {}  # (c, j) -> the last call reading it
        self._tape = tape
        self._mark = 0  # (the aten tape's length when the last call began)
        self._base = current_level()
        self._state = (_autocast(), torch.is_inference_mode_enabled(), torch.initial_seed())

    def fail(self) -> None:
        """The forward did something this tape cannot stand for: a run again stays."""
        self.ok = False
        self.calls = []
        self._ids = {}

    def _ref(self, x, reader: int):
        e = self._ids.get(id(x))
        if e is not None and e[0]() is x:
            d = e[1]
            if type(d) is _Made:
                self._last[(d.c, d.j)] = reader
            return d
        tape = self._tape
        if tape is not None:
            with DisableTorchFunction():  # (finish runs under the capture mode: its own storage reads are no calls)
                b = unwrap_all(x)
                if tape.value_of(b) is not None or tape.key(b) in tape.made:
                    return None  # (made inside where no torch function mode saw it: nn.Parameter(h), as_subclass)
        return x  # a constant: a tensor from outside (one the function closes over: the capture mode replaces it)

    def note(self, func, args, kwargs) -> None:
        """The function calls ``func(*args, **kwargs)`` (as it passed them), before the call runs
        (a generator's state is the one it draws from); then :meth:`made` its result."""
        if not self.ok:
            return
        if current_level() != self._base or (_autocast(), torch.is_inference_mode_enabled()) != self._state[:2]:
            return self.fail()  # (a torch.func transform it calls; autocast or inference mode changed inside)
        c = len(self.calls)
        if c and self.calls[-1][4] < 0:
            return self.fail()  # (the call before raised, and the function caught it)
        leaves, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
        desc = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                d = self._ref(x, c)
                if d is None:
                    return self.fail()
                desc.append(d)
            elif isinstance(x, torch.Generator):
                desc.append(_Gen(x))
            elif (np_kind := _numpy(x)) is not None:
                desc.append(_Array(x) if np_kind == "array" else x)
            elif type(x) in _CONSTANTS or (type(x) is slice and not any(isinstance(v, torch.Tensor) for v in (x.start, x.stop, x.step))):
                desc.append(x)
            else:  # (an object the function may change after the call, or holding a tensor the tape would not see)
                return self.fail()
        self.calls.append([func, desc, spec, torch.is_grad_enabled(), -1, ()])
        self._mark = len(self._tape.nodes)

    def made(self, out) -> None:
        """The result of the call :meth:`note` saw."""
        if not self.ok:
            return
        c = len(self.calls) - 1
        made = _tensors_of(out)
        self.calls[c][4] = len(made)
        # the states the call's draws started from, as the aten tape read them: a replay draws from them,
        # whatever the function did to the generators between calls (torch.random.fork_rng, set_rng_state)
        draws: dict = {}
        for node in self._tape.nodes[self._mark:]:
            if node.rng is not None and node.rng[1] is not None and is_default_generator(node.rng[0]):
                draws.setdefault(id(node.rng[0]), (node.rng[0], node.rng[1]))
        self.calls[c][5] = tuple(draws.values())
        for j, t in enumerate(made):
            self._ids[id(t)] = (weakref.ref(t), _Made(c, j))

    def region(self, inputs, inner, opts, name: str, grad: bool, runner) -> None:
        """A region nested in this one ran on ``inputs`` (its tensor arguments, as the function passed them),
        then :meth:`made` its outputs.  ``inner``: its own tape, which stands for its function where a replay of
        this one calls it again (``runner(function, name, options, inputs)``, a region call): the nested
        region's forward runs again there, as the function's Python would run it, and that Python does not.
        The tensors its tape reads from this region become arguments of that call, handed anew by each replay."""
        if not self.ok:
            return
        if not isinstance(inner, LogicalTape) or opts.planner is not None:  # (a memory budget plans per function)
            return self.fail()
        c = len(self.calls)
        consts: list = []  # (the tensors from this region, and their descriptors here)
        refs: list = []
        where: dict[int, int] = {}

        def mapped(d):
            if isinstance(d, torch.Tensor):
                if id(d) in where:
                    return _Const(where[id(d)])
                r = self._ref(d, c)
                if r is not d:
                    where[id(d)] = len(consts)
                    consts.append(d)
                    refs.append(r)
                    return _Const(where[id(d)])
            return d

        tape = LogicalTape.__new__(LogicalTape)
        tape.ok, tape.rebuild, tape._ids, tape._last, tape._tape = True, inner.rebuild, {}, {}, None
        tape.calls = [(f, [mapped(d) for d in desc], *rest) for f, desc, *rest in inner.calls]
        tape.outs = [mapped(d) for d in inner.outs]
        leaves = [*inputs, *consts]
        desc = [self._ref(x, c) for x in inputs] + refs
        if any(d is None for d in desc):
            return self.fail()
        # (the tensors from outside both, as the replayed function's closure: the region threads them as its own;
        # those of regions nested deeper too, which must not be this one's: no replay hands them down)
        deeper = [t for f, *_ in inner.calls if type(f) is functools.partial and f.func is _nested_region for t in f.args[5]]
        if any(self._ref(t, c) is not t for t in deeper):
            return self.fail()
        outside = [d for call in tape.calls for d in call[1] if isinstance(d, torch.Tensor)] + deeper
        func = functools.partial(_nested_region, tape, len(inputs), opts, name, runner, outside)
        self.calls.append([func, desc, optree.tree_flatten((tuple(leaves), {}), none_is_leaf=True)[1], grad, -1, ()])
        self._mark = len(self._tape.nodes)

    def finish(self, outs, rebuild) -> LogicalTape | None:
        """The function returned ``outs`` (``rebuild``: their structure): this tape, or None where
        it cannot stand for the forward."""
        if self.ok and (torch.initial_seed() != self._state[2] or (self.calls and self.calls[-1][4] < 0)):
            self.fail()  # (the global seed set inside; the last call raised, and the function caught it)
        if self.ok:
            n = len(self.calls)
            self.outs = [self._ref(o, n) if isinstance(o, torch.Tensor) else o for o in outs]
            if any(d is None for d in self.outs):
                self.fail()
        if not self.ok:
            return None
        # each call's results nothing reads after it: dropped then, as the function's Python drops them
        n = len(self.calls)
        free: list[list] = [[] for _ in self.calls]
        for c, call in enumerate(self.calls):
            for j in range(call[4]):
                last = self._last.get((c, j), c)
                if last < n:
                    free[last].append((c, j))
        self.calls = [(*call[:4], call[5], f) for call, f in zip(self.calls, free)]  # type: ignore[misc]
        self.rebuild = rebuild
        self._ids, self._last, self._tape = {}, {}, None
        return self

    def run(self, args, consts=()) -> tuple:
        """The recorded calls again on ``args`` (the function's arguments now): ``(outputs, rebuild)``,
        as the function returns them.  Each call's draws start from the default generators' states
        the forward's did; the generators are put back after.  ``consts``: see :meth:`region`."""
        if not self.ok:
            raise AssertionError("a logical tape that failed is replayed")
        gens = {id(g): g for call in self.calls for g, _ in call[4]}
        before = [(g, g.get_state()) for g in gens.values()]
        try:
            return self._run(args, consts)
        finally:
            for g, state in before:
                g.set_state(state)

    def _run(self, args, consts) -> tuple:
        env: list = [None] * len(self.calls)

        def val(d):
            t = type(d)
            if t is _In:
                return args[d.k]
            if t is _Made:
                return env[d.c][d.j]
            if t is _Const:
                return consts[d.i]
            if t is _Gen or t is _Array:
                return d.fresh()
            return d

        for c, (func, desc, spec, grad, draws, free) in enumerate(self.calls):
            a, kw = optree.tree_unflatten(spec, [val(d) for d in desc])
            kw = kw or {}
            if grad is not torch.is_grad_enabled():  # (as the call ran: no torch function mode sees this,
                with DisableTorchFunction():  # where torch.no_grad's own switch, a torch call, is one of the calls)
                    set_grad_mode(grad)
            for g, state in draws:
                g.set_state(state)
            out = func(*a, **kw)
            env[c] = _tensors_of(out)
            for cc, j in free:
                env[cc][j] = None
        return tuple(val(d) for d in self.outs), self.rebuild


def _nested_region(tape: LogicalTape, n: int, opts, name: str, runner, outside: list, *xs) -> tuple:
    """A nested region's call in a replay of the region holding it (see :meth:`LogicalTape.region`): the
    region's tensor outputs, in order."""
    fun = functools.partial(_replayed, tape, list(xs[n:]), outside)
    return tuple(t for t in optree.tree_leaves(runner(fun, name, opts, xs[:n]), none_is_leaf=True) if isinstance(t, torch.Tensor))


def _replayed(tape: LogicalTape, consts: list, outside: list, *args):
    """The nested region's function there: its recorded calls (``outside``: what they read from outside both
    regions, held here for the region's walk of what its function closes over)."""
    outs, rebuild = tape.run(args, consts)
    return rebuild(outs)
