"""Global RNG state capture for ``preserve_rng_state=True``.

The region's forward draws from torch's global generators (CPU, plus one per
accelerator device).  To recompute bitwise-identically we snapshot those
states before the forward and restore them around the recomputation, putting
the caller's current states back afterwards.

A snapshot that the forward did not advance is dropped at the end of the
forward (:meth:`RNGSnapshot.finish`), so a region that draws no random numbers
keeps no state and its recomputation touches no generator.  Accelerator states
are handled through :func:`torch.get_device_module`, so CUDA (and any backend
with the same ``get_rng_state``/``set_rng_state`` API) is covered; only the CPU
path is exercised on this project's CI machines.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["RNGSnapshot", "devices_of"]


def devices_of(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """Return the distinct non-CPU devices among ``tensors``."""
    seen: list[torch.device] = []
    for t in tensors:
        d = t.device
        if d.type not in ("cpu", "meta") and d not in seen:
            seen.append(d)
    return seen


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b)  # byte tensors: no numpy needed (a runtime dependency we avoid)


def _device_state_api(device: torch.device):
    try:
        mod = torch.get_device_module(device.type)
    except (RuntimeError, AttributeError):  # pragma: no cover - exotic backends
        return None
    if not (hasattr(mod, "get_rng_state") and hasattr(mod, "set_rng_state")):
        return None  # pragma: no cover
    return mod


class RNGSnapshot:
    """States of the CPU generator and of the given devices' generators."""

    __slots__ = ("cpu", "devices", "_saved_cpu", "_saved_dev")

    def __init__(self, devices: list[torch.device]):
        self.cpu: torch.Tensor | None = torch.get_rng_state()
        self.devices: list[tuple[torch.device, torch.Tensor]] = []
        for d in devices:
            mod = _device_state_api(d)
            if mod is not None:  # pragma: no cover - needs an accelerator
                self.devices.append((d, mod.get_rng_state(d)))

    def finish(self) -> bool:
        """Drop states the forward did not advance; return True if any remain."""
        if self.cpu is not None:
            now = torch.get_rng_state()
            if _same(now, self.cpu):
                self.cpu = None
        kept = []
        for d, s in self.devices:  # pragma: no cover - needs an accelerator
            now = _device_state_api(d).get_rng_state(d)
            if not torch.equal(now, s):
                kept.append((d, s))
        self.devices = kept
        return self.cpu is not None or bool(self.devices)

    def restore_now(self) -> None:
        """Set the generators back to the snapshot (used to retry a forward)."""
        if self.cpu is not None:
            torch.set_rng_state(self.cpu)
        for d, s in self.devices:  # pragma: no cover - needs an accelerator
            _device_state_api(d).set_rng_state(s, d)

    def __enter__(self) -> RNGSnapshot:
        """Install the snapshot, remembering the caller's states."""
        self._saved_cpu = torch.get_rng_state() if self.cpu is not None else None
        self._saved_dev = []
        for d, s in self.devices:  # pragma: no cover - needs an accelerator
            mod = _device_state_api(d)
            self._saved_dev.append((mod, d, mod.get_rng_state(d)))
            mod.set_rng_state(s, d)
        if self.cpu is not None:
            torch.set_rng_state(self.cpu)
        return self

    def __exit__(self, *exc) -> None:
        if self._saved_cpu is not None:
            torch.set_rng_state(self._saved_cpu)
        for mod, d, s in self._saved_dev:  # pragma: no cover - needs an accelerator
            mod.set_rng_state(s, d)
        self._saved_cpu = None
        self._saved_dev = []
