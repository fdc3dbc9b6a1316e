"""Copies of outside storages the region writes (see :mod:`remat_fn._tape`)."""

from __future__ import annotations

import optree
import torch

from ._ops import bookkeeping, has_storage
from ._torch_internals import version as version_of

__all__ = ["OutsideWrites", "StorageCopy", "clone_storage", "from_copy", "redirect_writes", "versioned_copy"]


class StorageCopy:
    """The contents of an outside storage before the region first wrote into it.  Every
    value read from that storage is replayed as a view of one fresh copy of it per
    replay, so a write through one alias reaches every other (``base[0].copy_(..)``
    read back through a view of ``base`` made outside)."""

    __slots__ = ("data",)

    def __init__(self, data: torch.Tensor):
        self.data = data  # the bytes, as a uint8 tensor (the memory meters follow tensors)

    @property
    def storage(self):
        return self.data.untyped_storage()


def clone_storage(st) -> torch.Tensor:
    """A copy of the storage ``st`` as a uint8 tensor, made by a tensor op (dispatch modes,
    the memory meters among them, see it; ``UntypedStorage.clone`` reaches none)."""
    whole = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, 0, (st.nbytes(),), (1,))
    return whole.clone()


def from_copy(v, env: dict) -> torch.Tensor:
    """A fresh tensor with ``v``'s value from its snapshot: for a StorageCopy, a view of one
    copy of the storage per replay (``env``)."""
    snap = v.snap
    if type(snap) is not StorageCopy:
        return snap.clone()
    st = env.get(id(snap))
    if st is None:
        st = env[id(snap)] = clone_storage(snap.storage).untyped_storage()
    dtype, device, offset, size, stride = v.geom
    return torch.empty(0, dtype=dtype, device=device).set_(st, offset, size, stride)


def versioned_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of the inference tensor ``t`` that is not one: it has a version counter."""
    with torch.inference_mode(False):
        return t.clone()


def redirect_writes(node, args, kwargs):
    """``node``'s (a tape node's) arguments, the outside tensors it writes replaced by copies of what
    the forward read (a run again writes none it does not own)."""
    # node.flat lines up with the positional arguments, or with the leaves (see _tape.Node)
    flat, spec = (list(args), None) if node.spec is None else optree.tree_flatten((args, kwargs), none_is_leaf=True)
    env: dict = {}
    for j, v in enumerate(node.flat):
        if getattr(v, "snap", None) is not None and v.node < 0:  # (an outside Value the region writes)
            flat[j] = from_copy(v, env)
    return (flat, kwargs) if spec is None else optree.tree_unflatten(spec, flat)


class OutsideWrites:
    """The tape's part that keeps what the region reads from storages it writes, or that numpy may write (data
    handed to torch): copies taken before the first write, shared by every value read from the storage (see
    remat_fn._tape.Tape, whose ``__init__`` makes the state: ``outside``, ``written_outside``, ``storage_copies``,
    ``last_write``, ``pre_write``, ``written_storages``, ``stale``, ``lifts``, ``copies``)."""

    def _lifted(self, p: int, t: torch.Tensor) -> None:
        """Data handed to torch (``torch.tensor(array)``, ``torch.from_numpy``): ``t`` is over memory numpy writes
        without a version bump.  Read as a storage the region writes: from a copy taken at its first read, one per
        replay, which every alias of that memory the region reads shares (a write through one reaches the others,
        replayed in order); a fresh copy where numpy changed the memory since (no op of the region wrote it)."""
        if self.lifts is None or p in self.last_write or not has_storage(t):
            return  # (the region writes such memory: read as any tensor from outside, see _unlift)
        st = t.untyped_storage()
        old = self.storage_copies.get(p)
        if old is not None:
            with bookkeeping():
                now = clone_storage(st)
            if not torch.equal(now, old.data):
                del self.storage_copies[p]  # (the values read before keep theirs)
        vs = [v for v in self.outside.get(p, ()) if v.snap is None]
        self.written_outside.add(p)
        self._snapshot(p, t)
        self.lifts.append((st.data_ptr(), st.data_ptr() + st.nbytes(), p, vs, self.storage_copies.get(p)))

    def _unlift(self, t: torch.Tensor) -> None:
        """The region writes ``t``: where that memory overlaps data handed to torch, every such copy is let go and
        the memory read as any tensor from outside, the write snapshotting what it writes (aliases of one array
        at other offsets or lengths have storages of their own, which copies taken apart would keep apart)."""
        st = t.untyped_storage()
        lo, hi = st.data_ptr(), st.data_ptr() + st.nbytes()
        if not any(a < hi and lo < b for a, b, *_ in self.lifts):
            return
        for _, _, p, vs, copy in self.lifts:
            for v in vs:
                v.snap = v.geom = None
                self.outside.setdefault(p, []).append(v)
            if copy is not None and self.storage_copies.get(p) is copy:
                del self.storage_copies[p]
                if self.pre_write.get(p) is not None and self.pre_write[p].data_ptr() == copy.data.data_ptr():
                    del self.pre_write[p]
                self.written_storages = [w for w in self.written_storages if w[1].data_ptr() != copy.data.data_ptr()]
            self.written_outside.discard(p)
        self.lifts = None

    def _snapshot(self, ptr: int, t: torch.Tensor) -> None:
        """The region writes (through ``t``) into an outside storage: the values read from it
        so far replay from a copy of the storage taken before its first write, one copy per
        replay shared by all of them (they alias there as they did here)."""
        with bookkeeping():
            self._snapshot_now(ptr, t)

    def _snapshot_now(self, ptr: int, t: torch.Tensor) -> None:
        if ptr not in self.storage_copies:
            copy = None
            if ptr > 0 and has_storage(t):
                # (storages at one address may differ in length, numpy's views of one array: the longest covers them)
                st = max([t.untyped_storage(), *(v.t.untyped_storage() for v in self.outside.get(ptr, ())
                                                 if v.t is not None and has_storage(v.t))], key=lambda s: s.nbytes())
                copy = StorageCopy(clone_storage(st))
                if self.copies:
                    self.pre_write.setdefault(ptr, copy.storage)  # (what it held before the forward)
                    self.written_storages.append((st, copy.storage))
            self.storage_copies[ptr] = copy
        copy = self.storage_copies[ptr]
        for v in self.outside.pop(ptr, ()):
            if v.snap is None and version_of(v.t) == v.version:
                if copy is not None and has_storage(v.t) and v.t.untyped_storage().nbytes() <= copy.data.numel():
                    t = v.t
                    v.snap = copy
                    v.geom = (t.dtype, t.device, t.storage_offset(), t.size(), t.stride())
                else:  # (a subclass, or a storage longer than the copy: a copy of its own, also what a retry puts back)
                    with torch.no_grad():
                        v.snap = v.t.clone()
                    if self.copies:
                        self.written_storages.append((v.t, v.snap))
                self.stale.append(v)

    def undo_writes(self) -> None:
        """Put back what the forward wrote into outside storages (a buffer updated in
        place; a subclass tensor, whole), before that forward runs again (a retry on the
        torch.func path)."""
        with torch.no_grad():
            for st, before in reversed(self.written_storages):
                st.copy_(before)
        self.written_storages = []
