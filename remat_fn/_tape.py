"""The tape: a region's ops recorded once, in its one real forward, and replayed in backward.

A :class:`Tape` is filled by the region's dispatch mode (:class:`remat_fn._record.SaveMode`,
below autograd and below every functorch layer, so it sees the real tensors
and the ops that really run).  Each :class:`Node` is one aten op: the op, its
arguments with every tensor replaced by the :class:`Value` it holds, the state
of the generator it draws from (for random ops) and which of its outputs are
new values.  A value is the output of a node, or a tensor from outside the
region (an argument, a parameter, a buffer, a tensor the function closes
over) at the version it was read.

After the forward, :meth:`Tape.plan` takes the values backward needs (what
autograd saved) and walks back from them, JAX-style: a value the policy kept
stops the walk, a value from outside is read as it is, anything else is
recomputed by its node, whose inputs are needed in turn.  So the
recomputation (:meth:`Tape.replay`) runs exactly the ops backward needs, keeps
exactly the saveable values those ops (or backward) read, and never runs the
user's Python again: side effects (BatchNorm's running statistics, a cache, a
counter, a print) happen once, in the forward.  The replay lets go of each value
after the last replayed op that reads it, and hands each saved value out as it
was when autograd saved it (a later write reaches a copy taken before it; the
write of the op being dispatched then, rrelu's ``noise``, is replayed into it).

Writes into tensors from outside (a buffer updated in place) are replayed into
copies: the storage is copied before its first write (tentatively: the copy is
kept only if a replayed op reads it) and every value read from it replays as a
view of one fresh copy per replay, so the replay reads exactly what the forward
read, a write through one alias reaches the others, and it never writes a
tensor it does not own.  Every outside tensor the replay reads is checked
against the version it had when the forward read it
(:class:`~remat_fn.MutatedSavedTensorError`).  Random ops: see :mod:`remat_fn._ops`.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import optree
import torch

from ._errors import RematError, mutated_outside
from ._ops import (
    ALIASING,
    DECOMPOSED,
    DETACH,
    LIFT_FRESH,
    SEQ,
    bookkeeping,
    call_grad_mode,
    copy_before_write,
    default_states,
    devices_of,
    draw,
    generator_of,
    has_storage,
    held_copy,
    no_autocast,
    op_info,
    reenter,
    run_recorded,
    same_state,
    simple_args,
    storage_id,
    storage_key,
    user_generator,
    written_tensors,
)
from ._storage_copy import OutsideWrites, StorageCopy, from_copy, versioned_copy
from ._torch_internals import generator_key
from ._torch_internals import version as version_of
from ._unseen import unseen_alias

__all__ = ["Tape", "Value", "Node"]

_NULL = contextlib.nullcontext()
class Value:
    """A tensor value of the region: output ``idx`` of node ``node`` (``node >= 0``), or
    an outside tensor ``t`` at ``version`` (``node == -1``)."""

    __slots__ = ("node", "idx", "t", "version", "snap", "store", "ptr", "geom", "st")

    def __init__(self, node: int, idx: int, t=None, version: int = 0, ptr: int = 0):
        self.node = node
        self.idx = idx
        self.t = t  # outside tensors only (held: the replay may read them)
        self.version = version
        # the region writes this outside tensor's storage: a StorageCopy (with ``geom``, the
        # tensor's place in it), or a copy of the tensor itself (a subclass)
        self.snap = None
        self.store = None  # (packed, unpack): stored through enclosing hooks
        self.ptr = ptr
        self.geom = None  # (dtype, device, storage offset, size, stride), with a StorageCopy
        self.st = 0  # an op's output: its storage's identity (``t.data = ...`` re-points the tensor, unseen)

    def __repr__(self):  # pragma: no cover - debugging aid
        return f"Value(node={self.node}, idx={self.idx})" if self.node >= 0 else "Value(outside)"


class Node:
    """One recorded op."""

    __slots__ = ("func", "flat", "spec", "kw", "reads", "outs", "writes", "rng", "key", "meta", "always", "shapes",
                 "held", "probe", "grad", "inference")

    def __init__(self, func, flat, spec, kw, reads, rng, key):
        self.func = func
        # argument leaves, tensors replaced by their Values: with ``spec`` the leaves of
        # (args, kwargs); without, the positional arguments, and ``kw`` the keyword
        # arguments (no tensor in a list or among those: most ops)
        self.flat = flat
        self.spec = spec
        self.kw = kw
        self.reads = reads  # the Values the op reads (arguments and earlier writes to their storage)
        self.outs: list = []  # per output leaf: its Value, or None (not a tensor)
        self.writes: list = []  # (argument position, Value of the written tensor after the op)
        self.rng = rng  # (generator, state before the op) for random ops
        self.key = key  # the policy's key of the op: (op, n-th call), None for detach
        self.meta: list | None = None  # output (size, stride, dtype, device), on the torch.func path
        self.always = False  # its result steers Python (a scalar, a data-dependent shape)
        self.shapes: tuple | None = None  # argument shapes, on the torch.func path
        # the outputs themselves, for a random op that cannot be handed a private generator
        # (the replay never touches a generator other threads draw from): see Tape.after
        self.held: dict | None = None  # output index (or -1-n: written argument n) -> tensor
        self.probe = None  # generator states before an op that may draw (a custom op)
        # grad mode when it ran (off under the function's no_grad, and inside a custom
        # autograd.Function's forward): a differentiated replay runs it so (see _replay_live)
        self.grad = call_grad_mode()
        self.inference = torch.is_inference_mode_enabled()  # (no tangent reaches its results: see _replay_live)

    def values(self) -> list:
        """The Values it makes: its outputs and its written arguments after the op."""
        return [v for v in (*self.outs, *(w for _, w in self.writes)) if v is not None]


class Tape(OutsideWrites):
    """The ops of one forward of one region (see the module docstring)."""

    def __init__(self, func_path: bool = False, copies: bool = False, replayed: bool = True):
        self.nodes: list[Node] = []
        self.func_path = func_path  # record output metadata (the torch.func recomputation)
        self.copies = func_path or copies  # fill pre_write (a torch.func re-run may follow)
        # False: recorded only to put back what the forward wrote (see undo_writes), never replayed,
        # so nothing is refused for the replay's sake (the function runs again instead)
        self.replayed = replayed
        # id(tensor) -> (Value, weak ref to the tensor, or the tensor itself for outside ones)
        self.reg: dict[int, tuple] | None = {}
        # storages of outside tensors the region wrote (``outside`` has those read
        # since): together, every outside storage a write can hit, as the written
        # tensor is looked up (read) by the writing op itself
        self.written_outside: set[int] = set()
        self.last_write: dict[int, Value] = {}  # storage -> Value written last
        self.outside: dict[int, list] = {}  # storage -> outside Values read from it
        self.storage_copies: dict[int, StorageCopy | None] = {}  # storage -> its contents before the first write
        self.paused = 0
        self.stale: list = []  # outside Values whose tensor the region wrote after reading them
        self.lifts: list | None = []  # (memory range, storage, Values, copy) of data handed to torch, see _lifted
        # torch.func path: storage -> a copy of it before the region first wrote into it
        # (the re-run writes into private copies: a buffer is updated once)
        self.pre_write: dict[int, Any] = {}
        self.written_storages: list = []  # (storage or subclass tensor, its copy): see undo_writes
        # storage keys of tensors without a storage of their own (a wrapper subclass that
        # does not say what it wraps): id -> (key, weak ref); a view shares its base's
        self.synth: dict[int, tuple] = {}
        self.writes_to: dict[int, list] = {}  # storage -> (node, Value) of each write into it, in order
        self.held_at: dict[int, list] = {}  # storage -> (node, index) of the held outputs on it
        self.modes: list = []  # the user's dispatch modes of the forward (see reenter)
        # (start, end, options, name) of each region nested in this one: its nodes are tape[start:end]
        # (a replay runs them as a region of their own, see _replay_live)
        self.spans: list[tuple] = []
        self.out_writes: list = []  # the last write into each output's storage (see _frame.output_value)
        self.made: set[int] = set()  # storages the region's ops allocated (see remat_fn._unseen)
        self.functions: dict = {}  # custom autograd.Function class -> every call a step of its own (see _replay_live)
        self.first_draws: dict[int, tuple] = {}  # generator_key -> (generator, its state before the forward's first draw from it)

    def first_write(self, key: int, pos: int):
        """The write autograd expects into a tensor it saved at ``pos``: the first write into
        storage ``key`` from ``pos`` on, if it is by the op being dispatched then (only views
        and detaches before it) and writes an argument it does not return (rrelu_with_noise's
        ``noise``; an in-place or ``out=`` op returns what it writes, and moves its version).
        (node, Value), or None."""
        for k, v in self.writes_to.get(key, ()):
            if k >= pos:
                ok = v.idx < 0 and all(self.nodes[j].func.is_view or self.nodes[j].func is DETACH
                                       for j in range(pos, k))
                return (k, v) if ok else None
        return None

    # -- forward -------------------------------------------------------------
    def key(self, t: torch.Tensor) -> int:
        """``t``'s storage (see storage_key); for a wrapper without one, a key of its own that its
        views share, so writes through them are tracked all the same."""
        p = storage_key(t)
        if p or has_storage(t):
            return p
        e = self.synth.get(id(t))
        if e is not None and e[1]() is t:
            return e[0]
        k = -1 - len(self.synth)
        self.synth[id(t)] = (k, weakref.ref(t))
        return k

    def lookup(self, t: torch.Tensor) -> Value:
        reg = self.reg
        e = reg.get(id(t))
        if e is not None:
            v, ref = e
            if v.node >= 0:
                if ref() is t and (not v.st or v.st == storage_id(t)):
                    return v
            elif ref is t and (v.version == version_of(t) or (v.snap is not None and v.ptr in self.written_outside)):
                # (read again after the region wrote it through a view: the replay's copy of this value receives those writes in order)
                return v
        ptr = self.key(t)
        if ptr in self.made and (v := unseen_alias(self, t, ptr)) is not None:
            return v
        if t.is_inference():  # (no version counter: each read keeps a copy of what it read, for the replay)
            return Value(-1, 0, c := versioned_copy(t), version_of(c), self.key(c))
        v = Value(-1, 0, t, version_of(t), ptr)
        reg[id(t)] = (v, t)
        if ptr:
            self.outside.setdefault(ptr, []).append(v)
        return v

    def value_of(self, t: torch.Tensor) -> Value | None:
        """The Value ``t`` holds now (a saved tensor, at pack time), if the region made it."""
        e = self.reg.get(id(t)) if self.reg is not None else None
        if e is None:
            return None
        v, ref = e
        if v.node >= 0 and ref() is t and (not v.st or v.st == storage_id(t)):
            return v
        return None

    def alias(self, new: torch.Tensor, old: torch.Tensor) -> None:
        """``new``, a detached alias of ``old`` made as bookkeeping (what a nested region's Function
        returns for its output, see remat_fn._func_graph.release_outputs), holds ``old``'s Value: the
        replay reads what it makes for ``old``, differentiable where that is."""
        if self.reg is not None:
            v = self.value_of(old) or self.lookup(old)
            self.reg[id(new)] = (v, weakref.ref(new)) if v.node >= 0 else (v, new)

    def write_before(self, t: torch.Tensor) -> Value | None:
        """The last write into ``t``'s storage (through a view, say), which a saved ``t``
        depends on too."""
        return self.last_write.get(self.key(t)) if self.last_write else None

    def before(self, func, key, args, kwargs) -> Node:
        info = op_info(func)
        if simple_args(args, kwargs):  # (most ops: tensors only as positional arguments)
            flat, spec = list(args), None
        else:
            flat, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
        if info[4] and self.replayed:
            raise RematError(
                f"remat: the region calls {func} on a storage: the recorded forward cannot replay a "
                "tensor re-pointed at other memory (its writes would be lost). Fix: make that alias "
                "outside the region, or use a view (x.view, x.as_strided) of the tensor instead.")
        reads = []
        shapes = [] if self.func_path else None
        last = self.last_write
        lookup = self.lookup
        for j, x in enumerate(flat):
            if isinstance(x, torch.Tensor):
                if shapes is not None:
                    shapes.append(x.shape)
                v = lookup(x)
                flat[j] = v
                reads.append(v)
                if last:
                    w = last.get(v.ptr if v.node < 0 else self.key(x))
                    if w is not None:
                        reads.append(w)
        rng = None
        if info[1]:
            g = generator_of(func, args, kwargs, info[6])
            if g is not None:
                rng = (g, None)  # (its state is read right before the op runs: see draw)
        node = Node(func, flat, spec, kwargs if spec is None else None, reads, rng, key)
        if info[6] is None and (info[7] or (rng is not None and func not in DECOMPOSED)):
            # a custom op, or a random op that takes no generator (attention with dropout_p):
            # it draws if a default generator moves (see after)
            node.probe = (devices_of(args, kwargs),)
            node.probe += (default_states(node.probe[0]),)
        if shapes is not None:  # (as arg_shapes gives them: the tensor leaves, in order)
            node.shapes = tuple(shapes)
        if info[0]:
            for t in written_tensors(func, args, kwargs):
                if self.lifts and has_storage(t):
                    self._unlift(t)
                p = self.key(t)
                for n, i in self.held_at.pop(p, ()) if self.held_at else ():
                    n.held[i] = n.held[i].clone()  # (a held output written later: keep what it was)
                if p and (p in self.outside or p in self.written_outside):
                    self.written_outside.add(p)
                    self._snapshot(p, t)
        elif func is LIFT_FRESH and flat[0].node < 0 and (p := flat[0].ptr) > 0:
            self._lifted(p, args[0])
        return node

    def record(self, func, key, args, kwargs):
        """Run ``func`` and record it as the next node."""
        node = self.before(func, key, args, kwargs)
        out = func(*args, **kwargs) if node.rng is None else draw(node, func, args, kwargs)
        self.after(node, out, args, kwargs)
        return out

    def _hold(self, node: Node, leaves, args, kwargs) -> None:
        """Keep a random op's outputs (and the arguments it wrote) instead of replaying it;
        a later write into one of them reaches a copy taken before it (see before)."""
        with bookkeeping():
            held = {i: held_copy(t) for i, t in enumerate(leaves)}
            for n, t in enumerate(written_tensors(node.func, args, kwargs)):
                held[-1 - n] = t.detach().clone()
        node.held = held
        for i, t in held.items():
            if isinstance(t, torch.Tensor) and i >= 0:
                p = self.key(t)
                if p:
                    self.held_at.setdefault(p, []).append((node, i))

    def after(self, node: Node, out, args, kwargs) -> None:
        k = len(self.nodes)
        self.nodes.append(node)
        reg = self.reg
        leaves = out if type(out) in SEQ else (out,)
        writes, _, view, dynamic, _, _, gen, _ = op_info(node.func)
        if self.func_path:
            node.meta = (type(out) if type(out) in (tuple, list) else None,
                         [(t.shape, t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor) else None
                          for t in leaves])
        if node.probe is not None:
            devices, states = node.probe
            node.probe = None
            if any(not same_state(a, b) for a, b in zip(states, default_states(devices))):
                # it drew, and takes no generator to hand a private one: replaying it would
                # set a generator other threads draw from; its outputs are kept instead
                self._hold(node, leaves, args, kwargs)
                node.rng = (torch.default_generator, states[0])  # (for restore_rng)
            else:
                node.rng = None  # (it drew nothing: dropout_p=0, eval mode)
        if node.rng is not None and node.rng[1] is not None:  # (for a run again of the function: RNGSnapshot.finish;
            g = user_generator(node.rng[0])  # a nested region's draw: the caller's generator it stands for)
            self.first_draws.setdefault(generator_key(g), (g, node.rng[1]))
        outs = node.outs
        fresh = not view and node.func not in ALIASING
        wrote = {id(t) for t in written_tensors(node.func, args, kwargs)} if writes and fresh else ()
        for i, t in enumerate(leaves):
            if isinstance(t, torch.Tensor):
                v = Value(k, i)
                v.st = storage_id(t)
                reg[id(t)] = (v, weakref.ref(t))
                outs.append(v)
                if fresh and id(t) not in wrote:
                    if (p := storage_key(t)):
                        self.made.add(p)
                    if self.last_write:  # (a freed storage reused)
                        self.last_write.pop(p or self.key(t), None)
                elif (view or node.func in ALIASING) and not has_storage(t) and not storage_key(t) \
                        and args and isinstance(args[0], torch.Tensor):
                    self.synth[id(t)] = (self.key(args[0]), weakref.ref(t))
            else:
                outs.append(None)
                if t is not None:
                    node.always = True  # a number or a flag read by Python
        if dynamic:
            node.always = True
        if writes:
            ids = {id(t): i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)}
            for n, t in enumerate(written_tensors(node.func, args, kwargs)):
                i = ids.get(id(t))
                v = outs[i] if i is not None else Value(k, -1 - n)
                if i is None:
                    reg[id(t)] = (v, weakref.ref(t))
                node.writes.append((n, v))
                p = self.key(t)
                if p:
                    self.last_write[p] = v
                    self.writes_to.setdefault(p, []).append((k, v))

    # -- plan ----------------------------------------------------------------
    def written_values(self, n: Node) -> list:
        """The Values of the arguments node ``n`` writes (all its tensor arguments when
        they were recorded flattened)."""
        if n.spec is None:
            return [n.flat[i] for i, _ in op_info(n.func)[0] if i < len(n.flat) and type(n.flat[i]) is Value]
        return [x for x in n.flat if type(x) is Value]

    def bases(self, values) -> list:
        """The ``values`` and the region values they alias: through views, and through writes
        (the result of an in-place op is its target).  One walk for all of them (a value
        written N times is a chain of N: walked once, not once per write)."""
        out, todo, seen = [], list(values), set()
        while todo:
            v = todo.pop()
            if id(v) in seen or v.node < 0:
                continue
            seen.add(id(v))
            out.append(v)
            n = self.nodes[v.node]
            if n.func.is_view or n.func in ALIASING:
                todo.extend(n.reads[:1])
            elif any(w is v for _, w in n.writes):
                todo.extend(self.written_values(n))
        return out

    def plan(self, roots, kept: set | None = None) -> tuple[list[int], set, set]:
        """Walk back from ``roots`` (the Values backward needs).

        ``kept``: the ids of the Values the policy keeps.  Returns the nodes to
        replay (in order), the kept Values they or backward read, and the outside
        Values they read.
        """
        nodes = self.nodes
        todo = list(roots)
        seen: set[int] = set()
        run: set[int] = set()
        used_kept: set = set()
        used_outside: set = set()
        if self.func_path:
            for k, n in enumerate(nodes):
                if n is not None and n.always:
                    todo.extend(n.reads)
                    run.add(k)
        while todo:
            v = todo.pop()
            if id(v) in seen:
                continue
            seen.add(id(v))
            if v.node < 0:
                used_outside.add(v)
                continue
            # (a held op's outputs are read as held; a write of one is replayed: see run_recorded)
            if (v.idx >= 0 and nodes[v.node].held is not None) or (kept and id(v) in kept):
                used_kept.add(v)
                continue
            if v.node in run:
                continue
            run.add(v.node)
            todo.extend(nodes[v.node].reads)
        return sorted(run), used_kept, used_outside

    def plan_steps(self, want: list):
        """:meth:`plan` computing every value, where each custom Function is one step (its span
        ``(start, end, FunctionStep, None)``, see remat_fn._function_steps): a Function one of whose
        nodes runs has its every argument and output computed (its replay applies it whole).  Returns
        the extended ``want``, :meth:`plan`'s result and the steps that run (``(their nodes that run, step)``)."""
        run, held, outside = self.plan(want)
        if not self.functions:
            return want, run, held, outside, []
        steps = [s[2] for s in self.spans if s[3] is None]
        while True:
            have = set(run)
            fns = [(ks, fn) for fn in steps if (ks := {k for k in range(fn.start, fn.end) if k in have})]
            more = [x for _, fn in fns for x in (*fn.flat, *fn.outs) if type(x) is Value and x.node >= 0 and x.node not in have]
            if not more:
                return want, run, held, outside, fns
            want = [*want, *more]
            run, held, outside = self.plan(want)

    def release(self, used_outside) -> None:
        """After planning: hold only what the replay reads."""
        self.reg = None
        self.outside, self.last_write, self.storage_copies, self.synth, self.writes_to, self.held_at = {}, {}, {}, {}, {}, {}
        self.written_outside, self.made = set(), set()
        used = {id(v) for v in used_outside}
        for v in self.stale:
            if id(v) not in used:
                v.snap = None
        self.stale = []

    def keep_only(self, run, used_kept, full=None) -> None:
        """Forget the nodes the replay neither runs nor reads a kept output of (and the
        outside tensors only they read).  ``full``: (nodes, kept values) of a replay computing
        every value the policy keeps, remembered whole (see _replay_live)."""
        run = set(run)
        kept = {v.node for v in used_kept}
        if full is not None:
            run.update(full[0])
            kept.update(v.node for v in full[1])
        nodes = self.nodes
        for k, n in enumerate(nodes):
            if k in run:
                continue
            if k in kept:  # looked up by its key only: let go of its arguments
                if full is None:
                    n.flat = n.reads = ()
            else:
                nodes[k] = None

    def restore_rng(self) -> None:
        """Put every generator the forward drew from back where it was before the first draw."""
        for g, state in self.first_draws.values():
            g.set_state(state)

    # -- backward ------------------------------------------------------------
    def outside_value(self, v: Value, name: str, env: dict) -> torch.Tensor:
        t = env.get(id(v))
        if t is not None:
            return t
        if v.snap is not None:
            t = from_copy(v, env)  # the replay may write into it; a second backward replays again
        elif v.store is not None:
            packed, unpack = v.store
            t = unpack(packed)
        else:
            t = v.t
            if version_of(t) != v.version:
                raise mutated_outside(name, t, v.version, version_of(t))
        env[id(v)] = t
        return t

    def replay(self, run, targets, kept_value, name: str) -> list:
        """Run the nodes ``run`` (indices, in order) and return, for each ``(value, pos)`` of
        ``targets``, the value's tensor as the forward's node ``pos`` found it: a later write
        into it (``h.mul_(2)`` after ``h.sin()`` saved ``h``) reaches a copy handed out
        before that write.  ``kept_value(value)`` gives a kept value's tensor.  Each value
        is let go after its last use, so the replay holds what backward needs and the
        values still to be read, no more."""
        env: dict[int, Any] = {}
        writes = any(self.nodes[k].writes for k in run)
        get = self.getter(env, writes, kept_value, lambda v: self.outside_value(v, name, env))
        grad = torch.is_grad_enabled()
        if grad:
            torch.set_grad_enabled(False)
        try:
            with no_autocast(), reenter(self.modes):
                return self.run_nodes(run, targets, get, env, writes, run_recorded)
        finally:
            if grad:
                torch.set_grad_enabled(True)

    def getter(self, env: dict, writes: bool, kept_value, outside):
        """``get(value)`` for :meth:`run_nodes`: a value already made (``env``), an outside
        one (``outside(value)``), a held random op's output (a copy where a replayed op
        ``writes``), or a kept one (``kept_value(value)``)."""
        nodes = self.nodes

        def get(v):
            t = env.get(id(v))
            if t is not None:
                return t
            if v.node < 0:
                t = outside(v)
            elif nodes[v.node].held is not None:
                t = nodes[v.node].held[v.idx]
                t = t.clone() if writes else t  # (a replayed op may write into it)
            else:
                t = kept_value(v)
            env[id(v)] = t
            return t

        return get

    def run_nodes(self, run, targets, get, env, writes: bool, runner, steps=None) -> list:
        """Run the nodes ``run`` (see replay): ``get(value)`` gives a value not made by them,
        ``runner(node, args, kwargs)`` runs one, ``env`` holds the values as they are made
        (each let go after its last reader), ``writes``: some of them write.  ``steps``:
        ``(index, node)`` in order, where a node may stand for several (a nested region's)."""
        if steps is None:
            steps = [(k, self.nodes[k]) for k in run]
        # (a run of two ops or fewer frees nothing worth the bookkeeping)
        last: dict[int, int] | None = {} if len(steps) > 2 else None  # id(value) -> the last node reading it
        if last is not None:
            for k, node in steps:
                for x in node.flat:
                    if type(x) is Value:
                        last[id(x)] = k
        want = {id(v) for v, _ in targets}
        result: list = [None] * len(targets)
        # targets a later write may reach: (index, value, pos)
        guard = [(i, v, pos) for i, (v, pos) in enumerate(targets) if pos <= run[-1]] if writes else None
        for k, node in steps:
            flat = [get(x) if type(x) is Value else x for x in node.flat]
            if node.spec is None:
                args, kwargs = flat, node.kw
            else:
                args, kwargs = optree.tree_unflatten(node.spec, flat)
            if node.writes and guard:
                guard = copy_before_write(guard, k, written_tensors(node.func, args, kwargs), env, result)
            out = runner(node, args, kwargs)
            outs = node.outs
            if type(out) in SEQ:
                for v, t in zip(outs, out):
                    if v is not None:
                        env[id(v)] = t
            elif outs[0] is not None:
                env[id(outs[0])] = out
            if node.writes:
                written = written_tensors(node.func, args, kwargs)
                for n, v in node.writes:
                    env[id(v)] = written[n]
            del flat, args, kwargs, out
            if last is None:
                continue
            # let go of what no later op and no target reads
            for x in node.flat:
                if type(x) is Value and last.get(id(x)) == k and id(x) not in want:
                    env.pop(id(x), None)
            for v in outs:
                if v is not None and id(v) not in last and id(v) not in want:
                    env.pop(id(v), None)
            for _, v in node.writes:
                if id(v) not in last and id(v) not in want:
                    env.pop(id(v), None)
        for i, (v, _) in enumerate(targets):
            if result[i] is None:
                result[i] = get(v)
        return result

