"""Aliases no op makes, recorded on the tape as the views they are.

``Tensor.as_subclass`` makes its result without any op a dispatch mode sees (under a
functorch level the plain tensor below the new wrapper is an alias of the old one's), and
torch function modes never see it either.  Taken for a tensor from outside the region, such
an alias is a constant to the replay: a region returning ``h.as_subclass(torch.Tensor)``
had a zero gradient.  :func:`unseen_alias` finds the tensor it views on a storage the
region made; :func:`note_alias` records it (``remat_fn._captures`` tells the tapes of a
view of an argument or a captured tensor, which it sees at its wrapper's level).
"""

from __future__ import annotations

import torch

__all__ = ["unseen_alias", "note_alias"]


def unseen_alias(tape, t: torch.Tensor, ptr: int | None = None):
    """``t``, unknown to ``tape``, is a view on a storage the region made: recorded as a view
    of a tensor the region made (one of its geometry first), so a replay computes it and
    writes through it.  Its Value, or None.  A detached alias (``.data``, ``nn.Parameter(h)``:
    FSDP's unsharded parameters, which its hooks refill in backward) is read as it is then."""
    if t._base is None:
        return None
    ptr = tape.key(t) if ptr is None else ptr
    if ptr not in tape.made:
        return None
    geom = (t.size(), t.stride(), t.storage_offset())
    base = None
    for v, ref in reversed(tape.reg.values()):
        b = ref() if v.node >= 0 else None
        # (not ``t`` itself, nor another tensor re-pointed since its op made it: see Tape.lookup)
        if b is not None and b is not t and b.dtype == t.dtype and tape.key(b) == ptr and tape.value_of(b) is v:
            if (b.size(), b.stride(), b.storage_offset()) == geom:
                base = b
                break
            base = base if base is not None else b
    return None if base is None else note_alias(tape, t, base)


def note_alias(tape, t: torch.Tensor, of: torch.Tensor):
    """Record ``t``, a view of ``of`` no op made, on ``tape`` as ``alias``/``as_strided`` of it."""
    args: tuple = (of,)
    func = torch.ops.aten.alias.default
    if (of.size(), of.stride(), of.storage_offset()) != (t.size(), t.stride(), t.storage_offset()):
        args, func = (of, t.size(), t.stride(), t.storage_offset()), torch.ops.aten.as_strided.default
    tape.after(tape.before(func, None, args, {}), t, args, {})
    return tape.reg[id(t)][0]
