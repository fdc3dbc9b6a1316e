"""Record and replay of policy decisions: what a region saves, offloads or recomputes.

A :class:`Record` belongs to one call of one region.  During the forward a
:class:`SaveMode` (a ``TorchDispatchMode``, below autograd and below the
functorch layers, so it sees the real tensors) asks the policy about every op
and keeps the outputs it decides to save, keyed by ``(op, n-th call of that
op)`` as torch's selective checkpointing does.  During a recomputation the
same mode returns the kept outputs instead of running those ops, so saved ops
cost nothing in backward.  :func:`checkpoint_name` lets name policies save (or
offload, or force the recomputation of) the op that produced a named value.
Offloaded values live on another device until the recomputation starts, when
they are all sent back at once (asynchronously on CUDA, see :class:`Offloader`).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any

import optree
import torch

from ._ambient import AMBIENT
from ._describe import describe
from ._errors import MutatedSavedTensorError, RecomputeMismatchError
from ._functorch import forward_mode_active, storage_ptr
from ._functorch import unwrap_all as _base
from ._offload import Offloader, Stored, hint, meta_args, tag_name
from ._ops import DETACH, METADATA_ONLY, arg_meta, arg_shapes, draw, follow, placeholder, run_recorded, single_output, user_modes
from ._storage_copy import redirect_writes
from ._torch_internals import DisableTorchFunction, TorchDispatchMode, dispatch_stack_len, schema
from ._torch_internals import version as version_of
from .policies import NAMED, Offload, PolicyContext, decide

__all__ = ["Record", "SaveMode", "saving", "paused", "checkpoint_name", "Diverged", "recording_tapes"]


def recording_tapes() -> list:
    """The tapes the enclosing regions' forwards record (a nested region marks its span there)."""
    return [m.tape for m in AMBIENT.tapes if m.tape is not None and not m.recompute]


def _kept(out):
    """An op's output without autograd history (below a functorch grad level's wrapper: its graph)."""
    return optree.tree_map(lambda t: _base(t.detach()) if isinstance(t, torch.Tensor) else t, out, none_is_leaf=True)


class _Entry:
    """What is kept of one op's output: the whole output, or some of its tensors."""

    __slots__ = ("out", "parts", "meta", "offloaded", "names")

    def __init__(self, meta):
        self.out = None  # full output (pytree of tensors), or None
        self.parts: dict[int, Any] = {}  # index -> tensor (or offload handle)
        self.meta = meta
        self.offloaded: dict[int, Any] = {}
        self.names: dict[int, str] = {}  # output index -> the checkpoint_name it was given


class _Pending:
    """A value the policy offloads, not copied yet: only once autograd saves it
    (or the forward ends and it was saved) is a copy made, so backward fetches
    every copy there is."""

    __slots__ = ("t", "d")

    def __init__(self, t, d: Offload):
        self.t, self.d = t, d


class Record:
    """Policy state of one region call: decisions and what is kept."""

    def __init__(self, policy, offloader: Offloader | None = None):
        self.policy = policy
        self.entries: dict[tuple, _Entry] = {}
        # id(output) -> (op key, index, n outputs, weakref to the output, its place in seq): ids
        # of freed tensors are reused, so a hit counts only while the ref is live
        self.producer: dict[int, tuple] = {}
        self.written_at: dict[int, int] = {}  # storage -> place in seq of the last op that wrote into it
        self._offloader = offloader  # (made on first use: most regions offload nothing)
        self.ctx = PolicyContext() if policy is not None else None  # (asked only where there is a policy)
        self.seq: list = []  # every op of the forward, in order
        self.stash = None  # (packed entries, unpack) when stored through outer hooks
        self.paused = 0  # > 0 while a recomputation runs inside the forward
        self.versions: list = []  # (kept tensor, version after the forward)
        self.kept_ptrs: set[int] = set()  # storages of the values decided "save"
        self.pending: dict[int, list] = {}  # storage -> [(op key, index)] of offloads not copied yet
        self.offload_ops: dict[tuple, tuple] = {}  # op key -> (op, meta args) of ops decided "offload"
        self.seq_nodes: list[int] = []  # per op of ``seq``: its node on the region's tape
        self.overwritten: set = set()  # keys of kept outputs the replay writes into (see plan_kept)
        # storage -> keys of the entries holding a tensor on it, during the forward: a write
        # looks only at those (see before_mutation; a region stays linear in its length)
        self.by_storage: dict[int, set] = {}
        # on_input(base, Offload): checkpoint_name named a region argument the policy offloads
        self.on_input = None  # (set by the path: remat_fn._offload.named_inputs, FuncInputs.listen)

    @property
    def offloader(self) -> Offloader:
        if self._offloader is None:
            self._offloader = Offloader()
        return self._offloader

    def _index(self, key, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                p = storage_ptr(t)
                if p is not None:
                    self.by_storage.setdefault(p, set()).add(key)

    # -- forward -------------------------------------------------------------
    def before_mutation(self, func, args, kwargs) -> None:
        """A kept output about to be modified in place is replaced by a copy first (the value the forward used)."""
        written = []
        for i, a in enumerate(schema(func).arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = args[i] if i < len(args) else kwargs.get(a.name)
                for t in optree.tree_leaves(v):
                    if isinstance(t, torch.Tensor):
                        written.append(storage_ptr(t))
        self.written_at.update((p, len(self.seq) - 1) for p in written if p is not None)  # (see named)
        keys = set().union(*(self.by_storage.pop(p, ()) for p in written if p is not None))
        if not keys:
            return
        hit = {p for p in written if p is not None}

        def fix(t):
            return _base(t.clone()) if isinstance(t, torch.Tensor) and storage_ptr(t) in hit else t

        for key in keys:
            e = self.entries.get(key)
            if e is None:
                continue
            if e.out is not None:
                e.out = optree.tree_map(fix, e.out, none_is_leaf=True)
                self._index(key, e.out if type(e.out) in (tuple, list) else (e.out,))
            for i in list(e.parts):
                e.parts[i] = fix(e.parts[i])
            self._index(key, e.parts.values())
            for p in e.offloaded.values():
                if type(p) is _Pending:
                    p.t = fix(p.t)
                    self._index(key, (p.t,))

    def after_op(self, func, key, args, kwargs, out) -> None:
        leaves = out if type(out) in (tuple, list) else (out,)
        pos = len(self.seq) - 1
        for i, t in enumerate(leaves):
            if isinstance(t, torch.Tensor):
                self.producer[id(t)] = (key, i, len(leaves), weakref.ref(t), pos)
        if self.policy is None or schema(func).is_mutable or func.is_view:
            return
        if not any(isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) for t in leaves):
            return
        ctx = self.ctx
        ctx.key = key
        ctx.name = None
        ctx.op_output = out
        try:
            d = decide(self.policy, ctx, func, args, kwargs)
        finally:
            ctx.op_output = None  # hold no reference past the decision
        if d == "save":
            e = self.entries.setdefault(key, _Entry(arg_meta(args)))
            e.out = _kept(out)
            self._index(key, leaves)
            self.kept_ptrs.update(storage_ptr(t) for t in leaves if isinstance(t, torch.Tensor))
        elif isinstance(d, Offload):
            self.offload_ops[key] = (func, meta_args(args, kwargs))
            self._offload(key, leaves, range(len(leaves)), d)

    def _offload(self, key, leaves, idxs, d: Offload, name=None) -> None:
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = _Entry(None)
        for i in idxs:
            t = leaves[i]
            if not isinstance(t, torch.Tensor):
                continue
            t = _kept(t)  # (an alias of its own: a later in-place metadata op, h.t_(), leaves its shape alone)
            if d.src is not None and t.device.type != torch.device(d.src).type:
                e.parts[i] = t  # not on the offload source: just keep it
                self._index(key, (t,))
                continue
            e.offloaded[i] = _Pending(t, d)
            self.pending.setdefault(storage_ptr(t), []).append((key, i))
            self._index(key, (t,))
        if name:
            for i in idxs:
                e.names[i] = name

    def commit(self, ptr: int | None) -> None:
        """Autograd saved the storage ``ptr``: copy the offloads pending on it now."""
        for key, i in self.pending.pop(ptr, ()):
            e = self.entries.get(key)
            p = e.offloaded.get(i) if e is not None else None
            if type(p) is _Pending:
                e.offloaded[i] = self.offloader.put(p.t, torch.device(p.d.dst), p.d.contiguous)

    def hint_outputs(self, outputs) -> list:
        """For each of the region's output tensors, the op that made it if the policy
        offloaded that op (``(op, meta args)``, else None), and tag the tensor with it:
        the region it enters next asks its policy whether to offload it there."""
        out = []
        for o in outputs:
            info = None
            if isinstance(o, torch.Tensor):
                where = self.producer.get(id(_base(o)))
                if where is not None and where[3]() is _base(o):
                    info = self.offload_ops.get(where[0])
                if info is not None:
                    hint(o, info)
            out.append(info)
        return out

    def named(self, t: torch.Tensor, name: str) -> None:
        base = _base(t)
        ctx = self.ctx
        ctx.key = None
        ctx.name = name
        ctx.op_output = t
        try:
            d = decide(self.policy, ctx, NAMED, (t,), {"name": name})
        finally:
            ctx.op_output = None
        where = self.producer.get(id(base))
        if where is None or where[3]() is not base:  # an argument of the region, or not made by an op
            if isinstance(d, Offload) and self.on_input is not None:
                self.on_input(base, d)  # (an argument: offloaded as offload_inputs offloads one)
            return
        key, i, n, _, pos = where
        if self.written_at.get(storage_ptr(base), -1) > pos:
            if d == "save" or isinstance(d, Offload):
                warnings.warn(
                    f"checkpoint_name({name!r}) named a value written in place through another view after the op that made "
                    "it (y[:, 0] += b; checkpoint_name(y, ...)): no op's output holds that value, so the policy cannot keep "
                    "it by name and it is recomputed. Fix: name the value before the write, or write out of place.", stacklevel=3)
            return
        if d == "save":
            e = self.entries.setdefault(key, _Entry(None))
            if e.out is None:
                e.parts[i] = _kept(base)
            e.names[i] = name
            self._index(key, (base,))
            self.kept_ptrs.add(storage_ptr(base))
        elif isinstance(d, Offload):
            leaves = [None] * n
            leaves[i] = base
            e = self.entries.get(key)
            if e is not None and e.out is not None:  # op rule saved it; offload instead
                e.out = None
            self.kept_ptrs.discard(storage_ptr(base))
            self._offload(key, leaves, (i,), d, name)
        elif d == "force":
            self.entries.pop(key, None)
            self.kept_ptrs.discard(storage_ptr(base))

    def stash_through(self, hooks) -> None:
        """Store the kept tensors through enclosing saved-tensor hooks."""
        pack, unpack = hooks

        def p(x):
            return (True, pack(x)) if isinstance(x, torch.Tensor) else (False, x)

        packed = {}
        for key, e in self.entries.items():
            out = None
            if e.out is not None:
                out = (type(e.out), [p(x) for x in e.out]) if type(e.out) in (tuple, list) else (None, [p(e.out)])
            packed[key] = (out, {i: pack(t) for i, t in e.parts.items()})
            e.out = None
            e.parts = {}
        self.stash = (packed, unpack)

    def unstash(self) -> None:
        if self.stash is None:
            return
        packed, unpack = self.stash
        for key, (out, parts) in packed.items():
            e = self.entries[key]
            if out is not None:
                typ, items = out
                vals = [unpack(v) if is_t else v for is_t, v in items]
                e.out = typ(vals) if typ is not None else vals[0]
            e.parts = {i: unpack(h) for i, h in parts.items()}

    def kept(self):
        """Yield ``(key, index, tensor_or_handle, kind, name)`` of everything kept."""
        for key, e in self.entries.items():
            if e.out is not None:
                leaves = e.out if type(e.out) in (tuple, list) else (e.out,)
                for i, t in enumerate(leaves):
                    if isinstance(t, torch.Tensor):
                        yield key, i, t, "saved", e.names.get(i)
            for i, t in e.parts.items():
                yield key, i, t, "saved", e.names.get(i)
            for i, h in e.offloaded.items():
                yield key, i, h.host if type(h) is Stored else h.t, "offloaded", e.names.get(i)

    def has(self, key, i: int) -> bool:
        """Whether the policy keeps output ``i`` of the op ``key`` (saved or offloaded)."""
        e = self.entries.get(key)
        return e is not None and (e.out is not None or i in e.parts or i in e.offloaded)

    def value(self, key, i: int) -> torch.Tensor:
        """The kept output ``i`` of the op ``key`` (fetched back if offloaded)."""
        e = self.entries[key]
        if i in e.offloaded:
            t = self.offloader.fetch(e.offloaded[i])
        elif i in e.parts:
            t = _base(e.parts[i].detach())
        else:
            leaves = e.out if type(e.out) in (tuple, list) else (e.out,)
            t = _base(leaves[i].detach())
        return t.clone() if key in self.overwritten else t

    def retain(self, used: set) -> None:
        """Keep only the outputs ``used`` (``(key, index)`` pairs): the saveable values that
        backward, or the recomputation of what backward needs, reads (JAX's rule: no
        dead copies).  Offloads among them are copied now (unless already copied);
        never a copy that backward does not fetch."""
        for key in list(self.entries):
            e = self.entries[key]
            if e.out is not None:
                leaves = e.out if type(e.out) in (tuple, list) else (e.out,)
                for i, t in enumerate(leaves):
                    if isinstance(t, torch.Tensor) and (key, i) in used:
                        e.parts[i] = t
                e.out = None
            for i in [i for i in e.parts if (key, i) not in used]:
                del e.parts[i]
            for i in list(e.offloaded):
                h = e.offloaded[i]
                if (key, i) not in used:
                    del e.offloaded[i]
                elif type(h) is _Pending:
                    e.offloaded[i] = self.offloader.put(h.t, torch.device(h.d.dst), h.d.contiguous)
            if not e.parts and not e.offloaded:
                del self.entries[key]
        self.pending = {}

    def prune(self, saved: set[int], offload: set[int] | None = None) -> None:
        """Keep only values autograd itself saved (``saved``: their storages;
        ``offload``: the storages an offloaded value must be among, default ``saved``).

        A policy decides which values *may* be kept; a value autograd did not
        save would only add to what backward holds: the recomputation still has
        to materialise the values autograd needs, so keeping it would raise the
        region's backward peak above plain autograd's.  Dropped values are
        recomputed.  Offloads are copied now (unless already copied when autograd
        saved them): never a copy that backward does not fetch.
        """
        offload = saved if offload is None else offload
        for ptr in list(self.pending):
            if ptr in offload:
                self.commit(ptr)
        self.pending = {}
        for key in list(self.entries):
            e = self.entries[key]
            for i in [i for i, h in e.offloaded.items() if type(h) is _Pending]:
                del e.offloaded[i]
            if e.out is not None:
                leaves = e.out if type(e.out) in (tuple, list) else (e.out,)
                if not any(isinstance(t, torch.Tensor) and storage_ptr(t) in saved for t in leaves):
                    e.out = None
            for i in [i for i, t in e.parts.items() if storage_ptr(t) not in saved]:
                del e.parts[i]
            if e.out is None and not e.parts and not e.offloaded:
                del self.entries[key]

    def seal(self, outputs) -> None:
        """After the forward: remember the versions of the region's outputs whose
        memory a kept value shares.  (The tensors a dispatch mode sees do not share
        version counters with the ones autograd hands out, so the check goes
        through the outputs, the only tensors of the region a caller can modify.)"""
        self.pending = {}
        for e in self.entries.values():  # offloads never saved (no prune ran): no copy
            for i in [i for i, h in e.offloaded.items() if type(h) is _Pending]:
                del e.offloaded[i]
        kept = {storage_ptr(t) for _, _, t, kind, _ in self.kept() if kind == "saved"}
        kept.discard(None)
        if not kept:
            return
        for o in outputs:
            if isinstance(o, torch.Tensor):
                b = _base(o)
                if storage_ptr(b) in kept:
                    # a detached alias shares the version counter; the output itself
                    # would tie its graph to this record (a reference cycle)
                    self.versions.append((b.detach(), version_of(b)))

    # -- recompute -------------------------------------------------------------
    def check_versions(self) -> None:
        for t, v in self.versions:
            if version_of(t) != v:
                raise MutatedSavedTensorError(
                    f"A value {describe(t)} saved by the remat policy was modified in place after the forward (version {v} -> "
                    f"{version_of(t)}), so backward would use the modified value. Fix: clone the region's output before "
                    "modifying it (y = y.clone()), or apply the in-place update after the backward pass.")

    def prefetch(self) -> None:
        if self._offloader is not None:
            self._offloader.begin(recompute=True)

    @contextlib.contextmanager
    def replaying(self):
        """Around a recomputation (the tape's replay, or a re-run under SaveMode): kept
        values checked, back from the enclosing hooks and the offload device; handed
        back to the hooks after."""
        self.check_versions()
        self.unstash()
        self.prefetch()
        try:
            yield
        finally:
            if self.stash is not None:
                for e in self.entries.values():
                    e.out = None
                    e.parts = {}

    def replay(self, func, key, args, kwargs, compute=None):
        """``func``'s output with the kept parts of it put in; what is not kept comes from
        ``compute`` (default: running ``func``).  An op that writes (``h.mul_(2)``, the
        ``squeeze_`` that ends a matmul of a vector) runs, then gets its kept outputs
        copied into its own: an in-place op's result is its argument, so the layers above
        would drop a kept tensor returned in its place (and read what the re-run computed)."""
        writes = schema(func).is_mutable
        out = self._replay(func, key, args, kwargs, compute or func, writes)
        if key in self.overwritten and not writes:
            out = optree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, out, none_is_leaf=True)
        return out

    def _replay(self, func, key, args, kwargs, compute, writes: bool):
        e = self.entries.get(key)
        if e is None:
            return compute(*args, **kwargs)
        if e.meta is not None and e.meta != arg_meta(args):
            raise RecomputeMismatchError(
                f"Recomputing a remat region ran {func} (call #{key[1]}) on inputs {arg_meta(args)} but the forward ran "
                f"it on {e.meta}. The region must run the same ops each time: make control flow depend only on its arguments.")
        if e.out is not None:
            return optree.tree_map(lambda x: _base(x.detach()) if isinstance(x, torch.Tensor) else x, e.out, none_is_leaf=True)
        if not writes and single_output(func) and (0 in e.parts or 0 in e.offloaded):
            return _base(e.parts[0].detach()) if 0 in e.parts else self.offloader.fetch(e.offloaded[0])
        out = compute(*args, **kwargs)
        multi = type(out) in (tuple, list)
        leaves = list(out) if multi else [out]
        kept = [(i, _base(t.detach())) for i, t in e.parts.items()] + [(i, self.offloader.fetch(h)) for i, h in e.offloaded.items()]
        for i, t in kept:
            leaves[i] = leaves[i].copy_(t) if writes else t
        return type(out)(leaves) if multi else leaves[0]


class Diverged(Exception):
    """Internal: a recomputation that skipped ops stopped following the forward's op
    sequence; it runs again computing everything."""


class SaveMode(TorchDispatchMode):
    """Records a region's forward (``recompute=False``: the :class:`~remat_fn._tape.Tape`
    and the :class:`Record` of policy decisions) or applies them to a recomputation
    that re-runs the function (the torch.func path): kept outputs are returned,
    and with a ``plan`` ops whose results nothing needs are not computed."""

    def __init__(self, rec: Record | None, recompute: bool, tape=None, plan=None):
        # (no super().__init__(): TorchDispatchMode.__enter__ creates its state lazily)
        self.rec = rec
        self.tape = tape
        self.recompute = recompute
        self.plan = plan  # (set of node indices to compute) on a torch.func recomputation
        self.counts: dict[Any, int] = {}
        self.pos = 0
        self.dummies = False  # an op was skipped (its outputs are placeholders)
        # Forward-mode tangent ops interleave with the region's own ops: no replay while forward-mode AD is on (see forward_mode_active).
        self.diverged = recompute and forward_mode_active()
        # a recomputation runs inside Record.replaying (kept values checked, fetched)
        self.around = rec.replaying() if recompute and rec is not None else None

    def __enter__(self):
        if self.around is not None:
            self.around.__enter__()
        AMBIENT.tapes.append(self)
        if self.tape is not None and not self.recompute and dispatch_stack_len():
            self.tape.modes = user_modes()  # (the replay runs through them again, see Tape.replay)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            AMBIENT.tapes.pop()
            if self.around is not None:
                self.around.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # The bookkeeping below (detach, copies to the offload device) must not
        # show up as the region's own ops in torch-function-level traces.
        with DisableTorchFunction():
            return self._dispatch(func, args, kwargs or {})

    def _dispatch(self, func, args, kwargs):
        if AMBIENT.bookkeeping:  # (a nested region's tape copying: no op of this region)
            return func(*args, **kwargs)
        rec = self.rec
        tape = self.tape
        if rec is None and not self.recompute:  # (no policy: the tape only, no op keys needed)
            return func(*args, **kwargs) if tape.paused else tape.record(func, None, args, kwargs)
        if self.recompute:
            if func is DETACH or rec is None:
                return func(*args, **kwargs)
            return self._recompute(rec, func, args, kwargs)
        if (rec is not None and rec.paused) or (tape is not None and tape.paused):
            return func(*args, **kwargs)
        if func is DETACH:
            # A detach is never kept (a view) and autograd under a functorch grad
            # level inserts its own detaches where the forward ran none: leaving
            # them out of the policy's op sequence keeps the replay aligned.
            return func(*args, **kwargs) if tape is None else tape.record(func, None, args, kwargs)
        key = (func, self.counts.get(func, 0))
        self.counts[func] = key[1] + 1
        node = None
        if tape is not None:
            node = tape.before(func, key, args, kwargs)
        if rec is not None:
            rec.seq.append(func)
            if tape is not None:
                rec.seq_nodes.append(len(tape.nodes))
            if rec.policy is not None and schema(func).is_mutable and func.overloadpacket not in METADATA_ONLY:
                rec.before_mutation(func, args, kwargs)  # (no policy: nothing kept, nothing named)
        out = func(*args, **kwargs) if node is None or node.rng is None else draw(node, func, args, kwargs)
        if node is not None:
            tape.after(node, out, args, kwargs)
        if rec is not None:
            rec.after_op(func, key, args, kwargs, out)
        return out

    def _diverge(self) -> None:
        """From here on compute everything; after placeholders, start again (Diverged)."""
        self.diverged = True
        if self.dummies:
            raise Diverged()

    def _recompute(self, rec: Record, func, args, kwargs):
        key = (func, self.counts.get(func, 0))
        self.counts[func] = key[1] + 1
        # Replay kept outputs only while the recomputation runs exactly the forward's op sequence; from the first
        # difference on (an op whose decomposition depends on grad mode, say) everything is recomputed, which is
        # always correct, unless ops were skipped before: then it runs again, whole.
        seq = rec.seq
        pos = self.pos
        if not self.diverged and (pos >= len(seq) or seq[pos] is not func):
            self._diverge()
        self.pos = pos + 1
        if self.diverged:
            return func(*args, **kwargs)
        node = self.tape.nodes[rec.seq_nodes[pos]] if self.tape is not None and rec.seq_nodes else None
        out = self._replayed(rec, func, key, pos, node, args, kwargs)
        if node is not None and not self.diverged:
            follow(node, args, kwargs)  # (a nested region's draw running inside this re-run)
        return out

    def _replayed(self, rec: Record, func, key, pos: int, node, args, kwargs):
        plan = self.plan
        if plan is None:
            # (a random op draws the forward's numbers from its recorded state: a kept one
            # before it, returned without drawing, must not shift what it draws)
            if node is not None and node.rng is not None and (node.shapes is None or node.shapes == arg_shapes(args, kwargs)):
                return rec.replay(func, key, args, kwargs, lambda *a, **k: run_recorded(node, a, k))
            return rec.replay(func, key, args, kwargs)
        if node.shapes != arg_shapes(args, kwargs):  # (batched differently under vmap, say)
            self._diverge()
            return func(*args, **kwargs)
        if node.held is not None:  # (a random op whose outputs the tape holds)
            return run_recorded(node, args, kwargs)
        needed = rec.seq_nodes[pos] in plan or func.is_view or func.overloadpacket in METADATA_ONLY or AMBIENT.tapes[-1] is not self
        kept = rec.entries.get(key) is not None
        if node.writes and (needed or kept):  # writes into tensors from outside go to copies of what the forward read
            args, kwargs = redirect_writes(node, args, kwargs)
        if kept:  # (an op that writes runs, or is a placeholder, and gets the kept values copied in: see Record.replay)
            if needed and not node.writes:
                return rec.replay(func, key, args, kwargs)
            # (its other outputs are not needed: placeholders, never the op on placeholder inputs)
            self.dummies |= not needed
            return rec.replay(func, key, args, kwargs, lambda *a, **k: (run_recorded if needed else placeholder)(node, a, k))
        if needed:  # (the last: an op of a nested region's forward, which keeps what it computes: never a placeholder)
            return run_recorded(node, args, kwargs)
        self.dummies = True
        return placeholder(node, args, kwargs)


@contextlib.contextmanager
def paused(rec: Record | None):
    """While active, ``rec``'s forward mode lets ops through (a recomputation inside the forward: a backward in the region)."""
    if rec is not None:
        rec.paused += 1
    try:
        yield
    finally:
        if rec is not None:
            rec.paused -= 1


def saving(rec: Record | None, recompute: bool, tape=None, plan=None):
    """The context that records (``recompute=False``) or replays ``rec`` and ``tape``; a no-op without either."""
    if rec is None and tape is None:
        return contextlib.nullcontext()
    return SaveMode(rec, recompute, tape, plan)


def checkpoint_name(x: Any, name: str) -> Any:
    """Tag ``x`` (a tensor or a pytree of tensors) with ``name``; returns ``x`` unchanged.

    Inside a :func:`remat_fn.remat` region, name policies
    (``save_only_these_names``, ``save_and_offload_only_these_names``, ...)
    decide from the name whether the value is saved, offloaded or recomputed.
    Outside a region it does nothing.

    >>> import torch, remat_fn
    >>> y = remat_fn.checkpoint_name(torch.ones(2), "h")
    >>> y
    tensor([1., 1.])
    """
    if not isinstance(name, str):
        raise TypeError(f"checkpoint_name expects a string name, got {name!r}")
    if torch.compiler.is_compiling():  # (torch's checkpoint operator, which sees ops, not names: and a graph
        return x  # break inside it, at the name's weak dictionary, left its selective cache refused: a hostile pass)
    for t in optree.tree_leaves(x):
        if isinstance(t, torch.Tensor):
            tag_name(t, name)  # asked about when it enters a region (offload_inputs, name policies)
    sink = AMBIENT.residuals  # (remat_fn.saved_residuals collecting)
    if sink is not None:  # saved_residuals is running: report the name, as JAX does
        for t in optree.tree_leaves(x):
            if isinstance(t, torch.Tensor):
                sink.append((_base(t), "named", name, None))
    stack = AMBIENT.tapes
    if stack:
        mode = stack[-1]
        if not mode.recompute and mode.rec is not None and mode.rec.policy is not None:
            # paused: the detach that keeps the value is bookkeeping, not an op of
            # the region; recorded, it would shift the replayed op sequence
            with DisableTorchFunction(), paused(mode.rec):
                for t in optree.tree_leaves(x):
                    if isinstance(t, torch.Tensor):
                        mode.rec.named(t, name)
    return x

