"""The autocast state (and default device) a region ran under, re-entered for
its recomputation.

Like ``torch.utils.checkpoint`` (``_get_autocast_kwargs``), a region records,
at forward, whether autocast is enabled, its dtype for every device type that
has autocast (CPU, CUDA and the current accelerator), and the cache flag; the
recomputation runs under exactly that state, whatever the state is when
backward runs (usually outside any ``torch.autocast`` block).  Without this a
region called under ``torch.autocast("cpu", dtype=torch.bfloat16)`` recomputes
in float32.

The state is set with torch's own setters, as ``torch.autocast.__enter__``
does, so the same code path serves every device type; on a machine without
CUDA the CUDA flags are still recorded and restored.  The default device of a
``with torch.device(...)`` block is recorded and re-entered the same way, so
tensors the function creates without a device land where they did in the
forward.
"""

from __future__ import annotations

import torch

__all__ = ["AutocastState"]


def _device_types() -> tuple[str, ...]:
    types = ["cpu", "cuda"]
    try:
        acc = torch.accelerator.current_accelerator()
        if acc is not None and acc.type not in types:
            types.append(acc.type)
    except Exception:  # pragma: no cover - builds without torch.accelerator
        pass
    return tuple(t for t in types if torch.amp.is_autocast_available(t))


_TYPES = _device_types()


class AutocastState:
    """A snapshot of the autocast flags; ``with state:`` runs under it."""

    __slots__ = ("flags", "cache", "device", "_saved")

    def __init__(self) -> None:
        self.flags = tuple(
            (t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in _TYPES
        )
        self.cache = torch.is_autocast_cache_enabled()
        self.device = torch.get_default_device()
        self._saved: list = []

    def _autocast_same(self, other: AutocastState) -> bool:
        return self.flags == other.flags and self.cache == other.cache

    def _set(self) -> None:
        for t, enabled, dtype in self.flags:
            torch.set_autocast_enabled(t, enabled)
            torch.set_autocast_dtype(t, dtype)
        torch.set_autocast_cache_enabled(self.cache)

    def __enter__(self) -> AutocastState:
        now = AutocastState()
        autocast = not self._autocast_same(now)
        device = torch.device(self.device) if self.device != now.device else None
        if autocast:
            torch.autocast_increment_nesting()
            self._set()
        if device is not None:
            device.__enter__()
        self._saved.append((now if autocast else None, device))
        return self

    def __exit__(self, *exc) -> None:
        now, device = self._saved.pop()
        if device is not None:
            device.__exit__(*exc)
        if now is None:
            return
        now._set()
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
