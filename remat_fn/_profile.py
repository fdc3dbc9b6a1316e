"""``remat_fn.profile()``: a per-region report of what rematerialisation did.

While the context manager is active, every remat region records, per call:
the forward time, the time spent recomputing it in backward, the bytes it keeps
for backward on the compute device (its tensor inputs when it may be
recomputed, the values its policy keeps, and what autograd holds of it
directly), the bytes it keeps offloaded, by destination (values and inputs its
policy offloads), and the bytes a plain call would have kept (every tensor
autograd saves, counted once per storage).
Regions are grouped by name and policy: the calls of one function under one
policy are one row (wrappers built anew for each call included), and two
wrappers of a function with different policies are two rows, named
``"name [policy]"`` (a name with one policy is its row's name as it is).
Works on both autograd paths.

>>> import torch, remat_fn
>>> f = remat_fn.remat(lambda x: torch.sin(x).exp())
>>> with remat_fn.profile() as prof:
...     f(torch.ones(256, requires_grad=True)).sum().backward()
>>> r = prof.regions["<lambda>"]
>>> (r.calls, r.recomputes, r.kept_bytes, r.plain_bytes)
(1, 1, 1024, 2048)
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

from ._ambient import AMBIENT
from ._functorch import unwrap_all

__all__ = ["profile", "Profile", "RegionStats", "RegionName", "region_name", "storage_bytes",
           "timer"]




class RegionName(str):
    """A region's name, as messages show it, that carries the region's policy
    (normalised), so that :func:`profile` keeps the regions of one function under
    different policies apart.  Made by :func:`region_name`."""

    policy: Any = None


def region_name(name: str, policy: Any) -> RegionName:
    """``name`` as a :class:`RegionName` of a region with ``policy``."""
    n = RegionName(name)
    n.policy = policy
    return n


_ADDRESS = re.compile(r"<function (\S+) at 0x[0-9a-f]+>")


def policy_label(policy: Any) -> str:
    """A short, stable description of a (normalised) policy: ``"dots_saveable"``,
    ``"memory_budget(fraction=0.5)"``, ``"ops(['aten.mm.default'])"``."""
    if policy is None:
        return "nothing_saveable"
    if not dataclasses.is_dataclass(policy) and isinstance(getattr(policy, "__name__", None), str):
        return policy.__name__  # a function
    return _ADDRESS.sub(r"\1", repr(policy))


@dataclasses.dataclass
class RegionStats:
    """Totals over the calls of one region (one function under one policy)."""

    name: str
    #: the policy, described (``"nothing_saveable"``, ``"dots_saveable"``, ...)
    policy: str = ""
    calls: int = 0
    recomputes: int = 0
    forward_s: float = 0.0
    recompute_s: float = 0.0
    kept_bytes: int = 0
    plain_bytes: int = 0
    #: bytes kept offloaded, by destination device (``{"cpu": ...}``); not in ``kept_bytes``
    offloaded_bytes: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def saved_fraction(self) -> float:
        """``kept_bytes / plain_bytes`` (0 when a plain call would keep nothing)."""
        return self.kept_bytes / self.plain_bytes if self.plain_bytes else 0.0


class Profile:
    """The report: ``regions`` maps each region's row name to its :class:`RegionStats`."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, str], RegionStats] = {}
        self._lock = threading.Lock()

    @property
    def regions(self) -> dict[str, RegionStats]:
        """The rows by name: a function's name, or ``"name [policy]"`` where the
        function ran under more than one policy (in the order first called)."""
        with self._lock:
            rows = list(self._rows.values())
        count: dict[str, int] = {}
        for r in rows:
            count[r.name] = count.get(r.name, 0) + 1
        return {r.name if count[r.name] == 1 else f"{r.name} [{r.policy}]": r for r in rows}

    def _get(self, name: str) -> RegionStats:
        policy = policy_label(name.policy) if isinstance(name, RegionName) else ""
        key = (str(name), policy)
        r = self._rows.get(key)
        if r is None:
            r = self._rows[key] = RegionStats(str(name), policy)
        return r

    def record_call(self, name: str, seconds: float, kept: int, plain: int,
                    offloaded: dict[str, int] | None = None) -> None:
        with self._lock:
            r = self._get(name)
            r.calls += 1
            r.forward_s += seconds
            r.kept_bytes += kept
            r.plain_bytes += plain
            for dst, n in (offloaded or {}).items():
                r.offloaded_bytes[dst] = r.offloaded_bytes.get(dst, 0) + n

    def record_recompute(self, name: str, seconds: float) -> None:
        with self._lock:
            r = self._get(name)
            r.recomputes += 1
            r.recompute_s += seconds

    def table(self) -> str:
        """The report as a Markdown table."""
        regions = self.regions
        off = any(r.offloaded_bytes for r in regions.values())
        rows = ["| region | calls | forward (ms) | recomputes | recompute (ms) | kept (MiB) | plain (MiB) | kept/plain |"
                + (" offloaded (MiB) |" if off else ""),
                "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---|" if off else "")]

        def offl(d: dict[str, int]) -> str:
            return (" " + (", ".join(f"{n / 2**20:.3f} to {dst}" for dst, n in sorted(d.items())) or "0")
                    + " |") if off else ""

        for label, r in regions.items():
            rows.append(
                f"| {label} | {r.calls} | {r.forward_s * 1e3:.2f} | {r.recomputes} | "
                f"{r.recompute_s * 1e3:.2f} | {r.kept_bytes / 2**20:.3f} | "
                f"{r.plain_bytes / 2**20:.3f} | {r.saved_fraction:.2f} |" + offl(r.offloaded_bytes))
        stats = list(regions.values())
        total_k = sum(r.kept_bytes for r in stats)
        total_p = sum(r.plain_bytes for r in stats)
        rows.append(f"| total | {sum(r.calls for r in stats)} | "
                    f"{sum(r.forward_s for r in stats) * 1e3:.2f} | "
                    f"{sum(r.recomputes for r in stats)} | "
                    f"{sum(r.recompute_s for r in stats) * 1e3:.2f} | "
                    f"{total_k / 2**20:.3f} | {total_p / 2**20:.3f} | "
                    f"{total_k / total_p if total_p else 0.0:.2f} |" + offl(self.offloaded_bytes()))
        return "\n".join(rows)

    def offloaded_bytes(self) -> dict[str, int]:
        """Bytes kept offloaded over all regions, by destination."""
        out: dict[str, int] = {}
        for r in self.regions.values():
            for dst, n in r.offloaded_bytes.items():
                out[dst] = out.get(dst, 0) + n
        return out

    def __str__(self) -> str:
        return self.table()

    def __enter__(self) -> Profile:
        AMBIENT.profiles.append(self)
        return self

    def __exit__(self, *exc) -> None:
        AMBIENT.profiles.remove(self)


def profile() -> Profile:
    """A context manager recording, per remat region, calls, forward and
    recompute time, bytes kept for backward (on the device, and offloaded by
    destination: ``RegionStats.offloaded_bytes``) and bytes a plain call would keep.

    ``with remat_fn.profile() as prof: ...`` then ``print(prof)`` (a Markdown
    table) or read ``prof.regions``.
    """
    return Profile()


def storage_bytes(tensors: Iterable) -> int:
    """Bytes of the distinct storages behind ``tensors`` (non-tensors ignored)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            try:
                st = unwrap_all(t).untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            seen.setdefault(st.data_ptr(), st.nbytes())
    return sum(seen.values())


class timer:
    """``with timer() as t: ...; t.seconds``."""

    __slots__ = ("start", "seconds")

    def __enter__(self) -> timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start
