"""``saved_residuals`` / ``print_saved_residuals``: what is kept for backward.

The function is run once in eager mode, differentiating with respect to every
floating-point tensor argument, under

* saved-tensor hooks that see every tensor autograd keeps (outside remat
  regions directly; inside regions through the regions' inputs and
  policy-saved values, which are stored through enclosing hooks), and
* a dispatch mode that remembers which op, at which user source line,
  produced each tensor.

Each kept storage is reported once, classified as ``"argument"`` (with its
path, e.g. ``args[0]['w']``), ``"closure"`` (a tensor the function closes
over), ``"saved"`` (an intermediate value) or ``"offloaded"``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optree
import torch

from ._ambient import AMBIENT
from ._closures import reachable_tensors
from ._describe import describe_meta, user_frame
from ._errors import RematError
from ._functorch import transforms_active
from ._torch_internals import TorchDispatchMode, schema

__all__ = ["Residual", "saved_residuals", "print_saved_residuals"]




@dataclasses.dataclass(frozen=True)
class Residual:
    """One tensor kept for the backward pass."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    kind: str  # "argument" | "closure" | "saved" | "offloaded"
    name: str | None
    op: str | None
    source: str | None

    def __str__(self) -> str:
        head = describe_meta(self.shape, self.dtype)
        if self.kind == "argument":
            return f"{head} from the argument {self.source}"
        if self.kind == "closure":
            return f"{head} closed over as {self.source}"
        named = f" named '{self.name}'" if self.name else ""
        what = f" output of {self.op}" if self.op else ""
        where = f" from {self.source}" if self.source else ""
        tail = f" (offloaded to {self.device})" if self.kind == "offloaded" else ""
        return f"{head}{named}{what}{where}{tail}"


_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default


class _Producers(TorchDispatchMode):
    def __init__(self, closures: dict[int, torch.Tensor]):
        super().__init__()
        self.by_storage: dict[int, tuple[str, str]] = {}
        self.closures = closures
        self.used: dict[int, torch.Tensor] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.closures:
            for a in optree.tree_leaves((args, kwargs)):
                if isinstance(a, torch.Tensor):
                    try:
                        ptr = a.untyped_storage().data_ptr()
                    except (RuntimeError, NotImplementedError):
                        continue
                    if ptr in self.closures:
                        self.used[ptr] = self.closures[ptr]
        out = func(*args, **(kwargs or {}))
        if func.is_view or func is _UNSAFE_VIEW or schema(func).is_mutable:  # (aliases, writes)
            return out
        for t in optree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                try:
                    ptr = t.untyped_storage().data_ptr()
                except (RuntimeError, NotImplementedError):
                    continue
                # a freed storage's memory is reused: the latest op that made it owns it
                self.by_storage[ptr] = (f"aten.{func.overloadpacket.__name__}", user_frame())
        return out


def _path(path: tuple) -> str:
    head, *rest = path
    s = "args" if head == 0 else "kwargs"
    for p in rest:
        s += f"[{p!r}]"
    return s


def saved_residuals(fun: Any, *args: Any, **kwargs: Any) -> list[Residual]:
    """List the tensors that differentiating ``fun(*args, **kwargs)`` keeps for backward.

    Works for plain functions and for functions containing :func:`remat_fn.remat`
    regions (whose inputs and policy-saved or offloaded values are what they
    keep).  Every floating-point tensor argument is differentiated.

    >>> import torch, remat_fn
    >>> f = remat_fn.remat(lambda x: torch.sin(torch.sin(x)))
    >>> [r.kind for r in remat_fn.saved_residuals(f, torch.ones(3))]
    ['argument']
    """
    if transforms_active():
        raise RematError(
            "saved_residuals runs the function with eager autograd; call it outside "
            "torch.func transforms (it reports what each region keeps in either mode)."
        )
    tree: Any = (args, kwargs)
    flat, _, spec = optree.tree_flatten_with_path(tree, none_is_leaf=True)
    leaves: list[Any] = optree.tree_leaves(tree, none_is_leaf=True)
    new_leaves = []
    arg_src: dict[int, str] = {}
    for path, x in zip(flat, leaves):
        if isinstance(x, torch.Tensor):
            y = x.detach()
            if y.is_floating_point() or y.is_complex():
                y.requires_grad_(True)
            arg_src[y.untyped_storage().data_ptr()] = _path(path)
            x = y
        new_leaves.append(x)
    a, kw = optree.tree_unflatten(spec, new_leaves)
    closures: dict[int, torch.Tensor] = {}
    sc = reachable_tensors(fun)
    for t in sc.tensors.values():
        try:
            closures.setdefault(t.untyped_storage().data_ptr(), t)
        except (RuntimeError, NotImplementedError):
            pass

    kept: list[torch.Tensor] = []
    sink: list = []

    def pack(t):
        kept.append(t)
        return t

    prev = AMBIENT.residuals
    AMBIENT.residuals = sink
    prod = _Producers(closures)
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), prod:
            out = fun(*a, **kw)
    finally:
        AMBIENT.residuals = prev
    del out

    names: dict[int, str] = {}
    offloaded: list[tuple[torch.Tensor, str | None, str | None]] = []
    offloaded_inputs: dict[int, tuple[str | None, str]] = {}  # storage -> (name, destination)
    for t, kind, name, op in sink:
        ptr = t.untyped_storage().data_ptr()
        if name:
            names[ptr] = name
        if kind == "offloaded":
            offloaded.append((t, name, op))
        elif kind == "offloaded_input":  # a region's argument, kept on `op` (its destination)
            offloaded_inputs[ptr] = (name, op)

    res: list[Residual] = []
    seen: set = set()  # storages, and (storage, offset) of offloaded copies
    for t in kept:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        def residual(kind: str, name: str | None, op: str | None, source: str | None) -> Residual:
            return Residual(tuple(t.shape), t.dtype, t.device, st.nbytes(), kind, name, op, source)

        if ptr in offloaded_inputs:
            name, dst = offloaded_inputs[ptr]
            op, src = prod.by_storage.get(ptr, (None, None))
            res.append(Residual(tuple(t.shape), t.dtype, torch.device(dst), t.numel() * t.element_size(),
                                "offloaded", name or names.get(ptr), op, arg_src.get(ptr, src)))
        elif ptr in arg_src:
            res.append(residual("argument", None, None, arg_src[ptr]))
        elif ptr in closures:
            res.append(residual("closure", None, None, sc.labels.get(id(closures[ptr]), "a closed-over tensor")))
        else:
            op, src = prod.by_storage.get(ptr, (None, None))
            res.append(residual("saved", names.get(ptr), op, src))
    for ptr, t in prod.used.items():  # closures a region uses (kept for its recompute)
        if ptr in seen:
            continue
        seen.add(ptr)
        res.append(Residual(shape=tuple(t.shape), dtype=t.dtype, device=t.device,
                            nbytes=t.untyped_storage().nbytes(), kind="closure", name=None, op=None,
                            source=sc.labels.get(id(t), "a closed-over tensor")))
    for t, name, op in offloaded:
        # offloaded copies live in pooled buffers (one storage may hold several): their own bytes
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        res.append(Residual(shape=tuple(t.shape), dtype=t.dtype, device=t.device,
                            nbytes=t.numel() * t.element_size(), kind="offloaded", name=name, op=op, source=None))
    return res


def print_saved_residuals(fun: Any, *args: Any, **kwargs: Any) -> None:
    """Print :func:`saved_residuals` one line per tensor, JAX style, and a total."""
    res = saved_residuals(fun, *args, **kwargs)
    for r in res:
        print(r)
    total = sum(r.nbytes for r in res)
    inter = sum(r.nbytes for r in res if r.kind in ("saved", "offloaded"))
    print(f"total: {len(res)} residuals, {total} bytes ({total / 2**20:.2f} MiB); "
          f"intermediates {inter} bytes")
