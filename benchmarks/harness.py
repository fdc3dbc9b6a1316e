"""The benchmark suite's one harness: timing, spread, process memory, the policy table.

Every section of the suite (``python -m benchmarks``) measures with these:

- :func:`interleaved` runs the candidates in turn within every round, so that
  background load on a shared machine hits them alike, and keeps every sample;
  :class:`Spread` reports median and min-max, and :func:`ratio` the per-round
  ratio of two candidates (median and min-max), so a reader can tell a real
  difference from noise.
- :func:`fresh_process` runs a measurement in a new Python process and reads its
  peak resident set size (``VmHWM``), next to the live tensor bytes that
  :class:`remat_fn.memory.LiveBytes` counted in the same process.
- :func:`variants` is the one table of what is compared: the demo's (no
  checkpointing, ``torch.utils.checkpoint``, ``remat`` under each policy of
  :mod:`remat_fn.policies`) plus torch's selective checkpointing saving matmuls.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import remat_fn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


# ---------------------------------------------------------------------------
# Time
# ---------------------------------------------------------------------------


class Spread(NamedTuple):
    """Median and range of a list of samples."""

    median: float
    lo: float
    hi: float

    @classmethod
    def of(cls, samples: list[float]) -> Spread:
        return cls(statistics.median(samples), min(samples), max(samples))

    def fmt(self, scale: float = 1.0, digits: int = 1, unit: str = "") -> str:
        m, lo, hi = (v * scale for v in self)
        return f"{m:.{digits}f}{unit} ({lo:.{digits}f}-{hi:.{digits}f})"

    def scaled(self, scale: float) -> Spread:
        return Spread(self.median * scale, self.lo * scale, self.hi * scale)


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, inner: int = 1,
                warmup: int = 1, before: Callable[[], object] | None = None) -> dict[str, list[float]]:
    """Seconds per call of each candidate, one sample per round; the candidates
    alternate within every round.  ``before`` runs, untimed, before each sample
    (a collective barrier, say)."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(max(1, warmup)):
            fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            if before is not None:
                before()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[k].append((time.perf_counter() - t0) / inner)
    return samples


def spread(samples: list[float]) -> Spread:
    return Spread.of(samples)


def ratio(a: list[float], b: list[float]) -> Spread:
    """Per-round ratio ``a[i] / b[i]`` (samples taken in the same round)."""
    return Spread.of([x / y for x, y in zip(a, b)])


def difference(a: list[float], b: list[float]) -> Spread:
    """Per-round difference ``a[i] - b[i]``."""
    return Spread.of([x - y for x, y in zip(a, b)])


def fmt_time(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


# ---------------------------------------------------------------------------
# Process memory
# ---------------------------------------------------------------------------


def peak_rss_mib() -> float:
    """This process's peak resident set size.

    Linux keeps ``getrusage``'s ``ru_maxrss`` across fork + exec, so a child
    started from a large parent reports the parent's peak; ``VmHWM`` in
    ``/proc/self/status`` belongs to the new address space and does not.
    Elsewhere ``ru_maxrss`` is used (KiB on Linux, bytes on macOS).
    """
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / (1 << 20) if sys.platform == "darwin" else r / 1024


def fresh_process(section: str, spec: str, env: dict[str, str] | None = None, timeout: int = 900) -> dict:
    """Run ``python -m benchmarks --_child SECTION SPEC`` and return the JSON it prints last.

    The child imports the ``remat_fn`` this process imported (a frozen copy first on
    ``PYTHONPATH``, say): ``python -m`` puts its working directory first on
    ``sys.path``, so it runs in the folder that holds that ``remat_fn``."""
    src = os.path.dirname(os.path.dirname(os.path.abspath(remat_fn.__file__)))
    path = [src, ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(dict.fromkeys(path)))
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--_child", section, spec],
                          capture_output=True, text=True, env=full_env, timeout=timeout, cwd=src)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"child failed: {proc.stderr.strip()[-300:]}"}


def child_report(**fields: Any) -> None:
    """What a fresh-process child prints: its fields plus its peak RSS."""
    print(json.dumps({"rss_MiB": peak_rss_mib(), **fields}))


# ---------------------------------------------------------------------------
# What is compared
# ---------------------------------------------------------------------------


def sac_save_matmuls():
    """torch's selective checkpointing policy saving matmul outputs (the analogue of
    ``dots_saveable``)."""
    ops = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def variants() -> list[tuple[str, Callable[[Callable], Callable]]]:
    """``(label, wrap)``: how each block is called.  The demo's table (no remat,
    ``torch.utils.checkpoint``, ``remat`` under each policy) plus torch's
    selective checkpointing saving matmuls, which needs nothing from remat_fn."""
    ctx = functools.partial(create_selective_checkpoint_contexts, sac_save_matmuls())

    def torch_sac(block):
        return functools.partial(torch_checkpoint, block, use_reentrant=False, context_fn=ctx)

    rows = list(demo_module().variants())
    rows.insert(2, ("torch SAC (save mm/addmm/bmm)", torch_sac))
    return rows


def variant(label: str) -> Callable[[Callable], Callable]:
    """The ``wrap`` of one row of :func:`variants`."""
    return dict(variants())[label]


def demo_module():
    """The demo (``examples/demo.py``): its GPT and synthetic task are the suite's
    transformer model.  The demo imports nothing from here."""
    mod = sys.modules.get("remat_demo")
    if mod is None:
        spec = importlib.util.spec_from_file_location("remat_demo", os.path.join(ROOT, "examples", "demo.py"))
        mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules["remat_demo"] = mod
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def error_text(e: BaseException) -> str:
    """One line for a table cell: why a variant could not run (the demo's wording)."""
    text = demo_module().error_text(e)
    return "fails " + text if text.startswith("(torch:") else text


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------


def machine_info() -> dict:
    import optree

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"python": platform.python_version(), "torch": torch.__version__, "optree": optree.__version__,
            "remat_fn": remat_fn.__version__, "platform": platform.platform(),
            "machine": platform.machine(), "cpu": cpu, "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def table(header: list[str], rows: list[list[Any]], align: str | None = None) -> str:
    """A Markdown table (first column left-aligned, the others right-aligned)."""
    align = align or ("|---" + "|---:" * (len(header) - 1) + "|")
    lines = ["| " + " | ".join(header) + " |", align]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def barh(labels: list[str], values: list[float], errors: list[tuple[float, float]] | None,
         xlabel: str, title: str, path: str, color: str = "tab:blue") -> bool:
    """A horizontal bar chart; ``errors`` are (lo, hi) whiskers around each value."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(labels) + 1.4))
    xerr = None
    if errors:
        xerr = [[v - lo for v, (lo, _) in zip(values, errors)], [hi - v for v, (_, hi) in zip(values, errors)]]
    ax.barh(range(len(labels)), values, xerr=xerr, color=color, capsize=3)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.1f}", va="center", fontsize=7)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
