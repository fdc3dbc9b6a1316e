"""How the library writes about tensors and user code, in errors and reports.

One home for tensor descriptions: ``f32[8,512]`` (JAX's notation, see
:func:`describe`), with the device where it matters, and the user source line
(``file.py:12 (block)``) that error messages and residual reports point at.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

__all__ = ["short_dtype", "describe", "describe_meta", "user_frame", "call_meta"]

_SHORT = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128",
}

_LIB_DIRS = tuple(
    os.path.dirname(m.__file__) + os.sep
    for m in (torch, sys.modules[__name__.rsplit(".", 1)[0]])
    if getattr(m, "__file__", None)
)


def short_dtype(dtype: torch.dtype) -> str:
    return _SHORT.get(dtype, str(dtype).replace("torch.", ""))


def describe_meta(shape, dtype: torch.dtype, device=None) -> str:
    """``f32[8,512]`` from a shape and dtype, with `` on <device>`` when a device is given."""
    head = f"{short_dtype(dtype)}[{','.join(str(s) for s in shape)}]"
    return head if device is None else f"{head} on {device}"


def describe(t: torch.Tensor, *, device: bool = False) -> str:
    """Short JAX-style description of a tensor, e.g. ``f32[8,512]``."""
    return describe_meta(t.shape, t.dtype, t.device if device else None)


def user_frame() -> str:
    """``file:line (function)`` of the innermost stack frame outside torch and remat_fn."""
    for fr in reversed(traceback.extract_stack()):
        f = fr.filename
        if f.startswith(_LIB_DIRS) or f.startswith("<frozen") or "/optree/" in f:
            continue
        return f"{os.path.basename(f)}:{fr.lineno} ({fr.name})"
    return "<unknown>"


def call_meta(out) -> tuple | None:
    """The (shape, dtype, device) of each tensor a torch call returned (None: it returned none), as a
    region's call trace records them (see remat_fn._debug.CallTrace)."""
    if isinstance(out, torch.Tensor):
        return ((tuple(out.shape), out.dtype, out.device),)
    if isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
        return tuple((tuple(o.shape), o.dtype, o.device) if isinstance(o, torch.Tensor) else None for o in out)
    return None
