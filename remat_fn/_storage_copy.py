"""Copies of outside storages the region writes (see :mod:`remat_fn._tape`)."""

from __future__ import annotations

import optree
import torch

__all__ = ["StorageCopy", "clone_storage", "from_copy", "redirect_writes", "versioned_copy"]


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
