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
counter, a print) happen once, in the forward.

Writes into tensors from outside (a buffer updated in place) are replayed into
copies: before such a write the values of that storage read so far are
copied (tentatively: the copy is kept only if a replayed op reads it), so the
replay reads exactly what the forward read and never writes a tensor it does
not own.  Every outside tensor the replay reads is checked against the version
it had when the forward read it (:class:`~remat_fn.MutatedSavedTensorError`).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import optree
import torch

from ._errors import RematError, mutated_outside
from ._functorch import any_batched, unwrap_all
from ._torch_internals import any_autocast_enabled, schema
from ._torch_internals import version as version_of

__all__ = ["Tape", "Value", "Node", "PLAIN"]

_NULL = contextlib.nullcontext()
_SEEDED = torch.Tag.nondeterministic_seeded
_DYNAMIC = tuple(t for t in (getattr(torch.Tag, "dynamic_output_shape", None),
                             getattr(torch.Tag, "data_dependent_output", None)) if t is not None)


class Value:
    """A tensor value of the region: output ``idx`` of node ``node`` (``node >= 0``), or
    an outside tensor ``t`` at ``version`` (``node == -1``)."""

    __slots__ = ("node", "idx", "t", "version", "snap", "store", "ptr")

    def __init__(self, node: int, idx: int, t=None, version: int = 0, ptr: int = 0):
        self.node = node
        self.idx = idx
        self.t = t  # outside tensors only (held: the replay may read them)
        self.version = version
        self.snap = None  # a copy taken before the region wrote into this tensor
        self.store = None  # (packed, unpack): stored through enclosing hooks
        self.ptr = ptr

    def __repr__(self):  # pragma: no cover - debugging aid
        return f"Value(node={self.node}, idx={self.idx})" if self.node >= 0 else "Value(outside)"


class Node:
    """One recorded op."""

    __slots__ = ("func", "flat", "spec", "kw", "reads", "outs", "writes", "rng", "key", "meta", "always", "shapes")

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


# ops that update BatchNorm's running statistics in place although their schema does
# not say so (the ``training`` flag is argument 5)
_UNDECLARED = tuple(getattr(getattr(torch.ops.aten, n, None), "default", None)
                    for n in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm"))


def _writes_of(func) -> tuple:
    """(position, name) of the arguments ``func`` writes in place (cached by :func:`_info`)."""
    args = schema(func).arguments
    if func in _UNDECLARED:
        return ((3, args[3].name), (4, args[4].name))
    return tuple((i, a.name) for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write)


_SEQ = (tuple, list)
# ops whose output shares its first argument's storage without being marked a view
_ALIASING = tuple(getattr(torch.ops.aten, n).default for n in ("_unsafe_view",) if hasattr(torch.ops.aten, n))
_INFO: dict[Any, tuple] = {}


def _info(func) -> tuple:
    """(written positions, draws random numbers, is a view, output shape depends on data,
    takes a storage, the op)"""
    i = _INFO.get(id(func))  # (by id: an op's own hash is Python code; the op is held below)
    if i is None:
        tags = func.tags
        i = _INFO[id(func)] = (_writes_of(func), _SEEDED in tags, func.is_view,
                               any(t in tags for t in _DYNAMIC),
                               any("Storage" in str(a.type) for a in schema(func).arguments), func)
    return i


def _simple(args, kwargs) -> bool:
    """No tensor among ``kwargs`` or inside a list argument."""
    for a in args:
        if type(a) in _SEQ:
            for e in a:
                if isinstance(e, torch.Tensor):
                    return False
    if kwargs:
        for v in kwargs.values():
            if isinstance(v, torch.Tensor):
                return False
            if type(v) in _SEQ:
                for e in v:
                    if isinstance(e, torch.Tensor):
                        return False
    return True


def written_tensors(func, args, kwargs) -> list:
    out = []
    for i, name in _info(func)[0]:
        v = args[i] if i < len(args) else kwargs.get(name)
        for t in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


# tensors whose storage can be asked for (a subclass may have none)
PLAIN = (torch.Tensor, torch.nn.Parameter)


def arg_shapes(args, kwargs) -> tuple:
    if _simple(args, kwargs):
        return tuple(t.shape for t in args if isinstance(t, torch.Tensor))
    return tuple(t.shape for t in optree.tree_leaves((args, kwargs), none_is_leaf=True)
                 if isinstance(t, torch.Tensor))


def _ptr(t: torch.Tensor) -> int:
    if type(t) not in PLAIN:  # a subclass may have no storage (asking can abort the process)
        return 0
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return 0
    return st.data_ptr() if st.nbytes() else 0


def _generator(func, args, kwargs):
    g = kwargs.get("generator")
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


def _no_autocast():
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


class Tape:
    """The ops of one forward of one region (see the module docstring)."""

    def __init__(self, func_path: bool = False, copies: bool = False):
        self.nodes: list[Node] = []
        self.func_path = func_path  # record output metadata (the torch.func recomputation)
        self.copies = func_path or copies  # fill pre_write (a torch.func re-run may follow)
        # id(tensor) -> (Value, weak ref to the tensor, or the tensor itself for outside ones)
        self.reg: dict[int, tuple] | None = {}
        # storages of outside tensors the region wrote (``outside`` has those read
        # since): together, every outside storage a write can hit, as the written
        # tensor is looked up (read) by the writing op itself
        self.written_outside: set[int] = set()
        self.last_write: dict[int, Value] = {}  # storage -> Value written last
        self.outside: dict[int, list] = {}  # storage -> outside Values read from it
        self.paused = 0
        self.stale: list = []  # outside Values whose tensor the region wrote after reading them
        # torch.func path: storage -> a copy of it before the region first wrote into it
        # (the re-run writes into private copies: a buffer is updated once)
        self.pre_write: dict[int, Any] = {}
        self.written_storages: list = []  # (storage, its copy): see undo_writes

    # -- forward -------------------------------------------------------------
    def lookup(self, t: torch.Tensor) -> Value:
        reg = self.reg
        e = reg.get(id(t))
        if e is not None:
            v, ref = e
            if v.node >= 0:
                if ref() is t:
                    return v
            elif ref is t and (v.version == version_of(t) or (v.snap is not None and v.ptr in self.written_outside)):
                # (read again after the region wrote it through a view: the replay's copy
                # of this value receives those writes in order)
                return v
        ptr = _ptr(t)
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
        if v.node >= 0 and ref() is t:
            return v
        return None

    def write_before(self, t: torch.Tensor) -> Value | None:
        """The last write into ``t``'s storage (through a view, say), which a saved ``t``
        depends on too."""
        return self.last_write.get(_ptr(t)) if self.last_write else None

    def before(self, func, key, args, kwargs) -> Node:
        info = _info(func)
        if _simple(args, kwargs):  # (most ops: tensors only as positional arguments)
            flat, spec = list(args), None
        else:
            flat, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
        if info[4]:
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
                    w = last.get(v.ptr if v.node < 0 else _ptr(x))
                    if w is not None:
                        reads.append(w)
        rng = None
        if info[1]:
            g = _generator(func, args, kwargs)
            if g is not None:
                rng = (g, g.get_state())
        node = Node(func, flat, spec, kwargs if spec is None else None, reads, rng, key)
        if shapes is not None:  # (as arg_shapes gives them: the tensor leaves, in order)
            node.shapes = tuple(shapes)
        if info[0]:
            for t in written_tensors(func, args, kwargs):
                p = _ptr(t)
                if p and (p in self.outside or p in self.written_outside):
                    self.written_outside.add(p)
                    self._snapshot(p)
                    if self.copies and p not in self.pre_write:
                        st = t.untyped_storage()
                        self.pre_write[p] = st.clone()
                        self.written_storages.append((st, self.pre_write[p]))
        return node

    def record(self, func, key, args, kwargs):
        """Run ``func`` and record it as the next node."""
        node = self.before(func, key, args, kwargs)
        out = func(*args, **kwargs)
        self.after(node, out, args, kwargs)
        return out

    def _snapshot(self, ptr: int) -> None:
        """The region writes into an outside storage: copy the values read from it so far."""
        for v in self.outside.pop(ptr, ()):
            if v.snap is None and version_of(v.t) == v.version:
                with torch.no_grad():
                    v.snap = v.t.clone()
                self.stale.append(v)

    def after(self, node: Node, out, args, kwargs) -> None:
        k = len(self.nodes)
        self.nodes.append(node)
        reg = self.reg
        leaves = out if type(out) in _SEQ else (out,)
        writes, _, view, dynamic, _, _ = _info(node.func)
        if self.func_path:
            node.meta = (type(out) if type(out) in (tuple, list) else None,
                         [(t.shape, t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor) else None
                          for t in leaves])
        outs = node.outs
        for i, t in enumerate(leaves):
            if isinstance(t, torch.Tensor):
                v = Value(k, i)
                reg[id(t)] = (v, weakref.ref(t))
                outs.append(v)
                if self.last_write and not view and not writes:  # (a freed storage reused)
                    self.last_write.pop(_ptr(t), None)
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
                p = _ptr(t)
                if p:
                    self.last_write[p] = v

    # -- plan ----------------------------------------------------------------
    def kept_by(self, rec):
        """The plan's ``kept`` predicate for the policy record ``rec`` (None: nothing kept)."""
        nodes = self.nodes
        if rec is None:
            return lambda v: False
        return lambda v: nodes[v.node].key is not None and rec.has(nodes[v.node].key, v.idx)

    def plan_kept(self, roots, rec) -> tuple[list[int], set, set]:
        """:meth:`plan` with what the policy record ``rec`` keeps; lets go of every kept
        value the plan does not read (``rec.retain``: no dead copies).  Returns what
        :meth:`plan` returns."""
        run, used_kept, used_outside = self.plan(roots, self.kept_by(rec))
        if rec is not None:
            nodes = self.nodes
            rec.retain({(nodes[v.node].key, v.idx) for v in used_kept})
            # kept values a replayed op writes into (h = x @ w; h += b): handed out as
            # copies, or a second backward would read the first one's writes
            kept = {id(v) for v in used_kept}
            rec.overwritten = {nodes[b.node].key for k in run if nodes[k].writes
                               for w in self._written_values(nodes[k]) for b in self._bases(w) if id(b) in kept}
        return run, used_kept, used_outside

    def _written_values(self, n: Node) -> list:
        """The Values of the arguments node ``n`` writes (all its tensor arguments when
        they were recorded flattened)."""
        if n.spec is None:
            return [n.flat[i] for i, _ in _info(n.func)[0] if i < len(n.flat) and type(n.flat[i]) is Value]
        return [x for x in n.flat if type(x) is Value]

    def _bases(self, v: Value) -> list:
        """``v`` and the region values it aliases: through views, and through writes (the
        result of an in-place op is its target)."""
        out, todo, seen = [], [v], set()
        while todo:
            v = todo.pop()
            if id(v) in seen or v.node < 0:
                continue
            seen.add(id(v))
            out.append(v)
            n = self.nodes[v.node]
            if n.func.is_view or n.func in _ALIASING:
                todo.extend(n.reads[:1])
            elif any(w is v for _, w in n.writes):
                todo.extend(self._written_values(n))
        return out

    def plan(self, roots, kept) -> tuple[list[int], set, set]:
        """Walk back from ``roots`` (the Values backward needs).

        ``kept(value)`` tells whether the policy keeps a value.  Returns the nodes to
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
                if n.always:
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
            if kept(v):
                used_kept.add(v)
                continue
            if v.node in run:
                continue
            run.add(v.node)
            todo.extend(nodes[v.node].reads)
        return sorted(run), used_kept, used_outside

    def release(self, used_outside) -> None:
        """After planning: hold only what the replay reads."""
        self.reg = None
        self.outside = {}
        self.last_write = {}
        self.written_outside = set()
        used = {id(v) for v in used_outside}
        for v in self.stale:
            if id(v) not in used:
                v.snap = None
        self.stale = []

    def keep_only(self, run, used_kept) -> None:
        """Forget the nodes the replay neither runs nor reads a kept output of (and the
        outside tensors only they read)."""
        run = set(run)
        kept = {v.node for v in used_kept}
        nodes = self.nodes
        for k, n in enumerate(nodes):
            if k in run:
                continue
            if k in kept:  # looked up by its key only: let go of its arguments
                n.flat = n.reads = ()
            else:
                nodes[k] = None

    def undo_writes(self) -> None:
        """Put back what the forward wrote into outside storages (a buffer updated in
        place), before that forward runs again (a retry on the torch.func path)."""
        with torch.no_grad():
            for st, before in reversed(self.written_storages):
                st.copy_(before)
        self.written_storages = []

    def restore_rng(self) -> None:
        """Put every generator the forward drew from back where it was before the first draw."""
        done = set()
        for n in self.nodes:
            if n is not None and n.rng is not None and id(n.rng[0]) not in done:
                done.add(id(n.rng[0]))
                n.rng[0].set_state(n.rng[1])

    # -- backward ------------------------------------------------------------
    def outside_value(self, v: Value, name: str, env: dict) -> torch.Tensor:
        t = env.get(id(v))
        if t is not None:
            return t
        if v.snap is not None:
            t = v.snap.clone()  # the replay may write into it; a second backward replays again
        elif v.store is not None:
            packed, unpack = v.store
            t = unpack(packed)
        else:
            t = v.t
            if version_of(t) != v.version:
                raise mutated_outside(name, t, v.version, version_of(t))
        env[id(v)] = t
        return t

    def replay(self, run, want, kept_value, name: str) -> dict:
        """Run the nodes ``run`` (indices, in order) and return ``{id(value): tensor}`` for
        the Values in ``want``.  ``kept_value(value)`` gives a kept value's tensor."""
        env: dict[int, torch.Tensor] = {}

        def get(v):
            t = env.get(id(v))
            if t is not None:
                return t
            if v.node < 0:
                return self.outside_value(v, name, env)
            t = kept_value(v)
            env[id(v)] = t
            return t

        grad = torch.is_grad_enabled()
        if grad:
            torch.set_grad_enabled(False)
        try:
            with _no_autocast():
                return self._run_nodes(run, want, get, env)
        finally:
            if grad:
                torch.set_grad_enabled(True)

    def _run_nodes(self, run, want, get, env) -> dict:
        nodes = self.nodes
        for k in run:
            node = nodes[k]
            flat = [get(x) if type(x) is Value else x for x in node.flat]
            if node.spec is None:
                args, kwargs = flat, node.kw
            else:
                args, kwargs = optree.tree_unflatten(node.spec, flat)
            out = run_recorded(node, args, kwargs)
            if type(out) in _SEQ:
                for v, t in zip(node.outs, out):
                    if v is not None:
                        env[id(v)] = t
            elif node.outs[0] is not None:
                env[id(node.outs[0])] = out
            if node.writes:
                written = written_tensors(node.func, args, kwargs)
                for n, v in node.writes:
                    env[id(v)] = written[n]
        return {id(v): get(v) for v in want}


def run_recorded(node: Node, args, kwargs):
    """Run ``node``'s op on ``args``; a random op draws the forward's numbers (its
    generator set to the recorded state, and put back after)."""
    rng = node.rng
    if rng is None:
        return node.func(*args, **kwargs)
    g, state = rng
    before = g.get_state()
    g.set_state(state)
    try:
        return node.func(*args, **kwargs)
    finally:
        g.set_state(before)


def redirect_writes(node, args, kwargs):
    """``node``'s arguments with the outside tensors it writes replaced by copies of
    what the forward read (the torch.func re-run never writes a tensor it does not own)."""
    # node.flat lines up with the positional arguments, or with the leaves (see Node)
    flat, spec = (list(args), None) if node.spec is None else optree.tree_flatten((args, kwargs), none_is_leaf=True)
    for j, v in enumerate(node.flat):
        if type(v) is Value and v.node < 0 and v.snap is not None:
            flat[j] = v.snap.clone()
    return (flat, kwargs) if spec is None else optree.tree_unflatten(spec, flat)


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
    leaves = [alias[i] if i in alias else
              torch.empty_strided(m[0], m[1], dtype=m[2], device=m[3])
              for i, m in enumerate(metas)]
    return multi(leaves) if multi is not None else leaves[0]


def private_copies(tensors, pre_write: dict) -> dict:
    """``{id(t): copy}`` for the ``tensors`` (what a region reaches) whose storage the
    region's forward wrote: each a plain tensor, with ``t``'s geometry, on a fresh copy
    of the storage as it was before the first write (see ``Tape.pre_write``)."""
    out: dict = {}
    copies: dict = {}  # storage -> its one copy (buffers that share a storage share it)
    for t in tensors:
        if any_batched(t):  # (a per-model slice of stacked buffers under vmap: not rebuilt)
            continue
        b = unwrap_all(t)
        p = _ptr(b) if b.layout == torch.strided else 0
        st = pre_write.get(p)
        if st is not None:
            if p not in copies:
                copies[p] = st.clone()
            out[id(t)] = torch.empty(0, dtype=b.dtype, device=b.device).set_(
                copies[p], b.storage_offset(), b.size(), b.stride())
    return out
