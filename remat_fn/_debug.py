"""Op traces for ``debug=True``: which aten ops ran, from which user line."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

from ._format import user_frame

__all__ = ["OpTrace", "format_traces"]


class OpTrace(TorchDispatchMode):
    """Records ``aten.op  file:line (function)`` for every op dispatched."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(f"{func}  {user_frame()}")
        return func(*args, **(kwargs or {}))


def format_traces(forward: list[str], recompute: list[str] | None) -> str:
    lines = ["forward ops:"]
    lines += [f"  {i:4d} {op}" for i, op in enumerate(forward)]
    lines.append("recompute ops:")
    if recompute is None:
        lines.append("  (not recorded)")
    else:
        lines += [f"  {i:4d} {op}" for i, op in enumerate(recompute)]
        for i, (a, b) in enumerate(zip(forward, recompute)):
            if a.split()[0] != b.split()[0]:
                lines.append(f"first difference at op {i}: {a!r} vs {b!r}")
                break
    return "\n".join(lines)
