"""Benchmarks for ``remat_fn.random`` against torch's global-RNG equivalents.

Run as ``python benchmarks/bench_random.py [--quick] [--threads N] [--stat min]
[--steady-malloc]``; prints a Markdown table. Timings are medians (or minima) of
interleaved repetitions: the candidate and its baseline alternate, so background
load hits both alike. Nothing here is asserted.

On small VMs, first-touch page faults of fresh 16 MiB buffers can cost more than
the RNG itself and make results depend on allocator luck; ``--steady-malloc``
re-runs the script with glibc keeping freed memory (``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_``) so that the table measures compute, not page faults.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.func import vmap

from remat_fn import random as rnd

__all__: list[str] = []


def _time(fn: Callable[[], object], inner: int) -> float:
    t = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t) / inner


STAT = statistics.median


def compare(
    ours: Callable[[], object], base: Callable[[], object], *, reps: int, inner: int = 1
) -> tuple[float, float]:
    """Seconds per call (median, or min with --stat min) of ``ours`` and ``base``,
    measured alternately."""
    for _ in range(2):
        ours()
        base()
    a, b = [], []
    for _ in range(reps):
        a.append(_time(ours, inner))
        b.append(_time(base, inner))
    return STAT(a), STAT(b)


def fmt(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="min is steadier on a loaded machine")
    ap.add_argument("--steady-malloc", action="store_true",
                    help="re-run with glibc keeping freed memory (no page-fault noise)")
    args = ap.parse_args()
    if args.steady_malloc and "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(32 << 20),
                   MALLOC_TRIM_THRESHOLD_=str(1 << 40))
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    global STAT
    STAT = min if args.stat == "min" else statistics.median
    if args.threads:
        torch.set_num_threads(args.threads)
    reps = 5 if args.quick else 15
    rows: list[tuple[str, str, str, str, str]] = []

    def add(what: str, ours: float, base: float, base_name: str) -> None:
        rows.append((what, fmt(ours), fmt(base), base_name, f"{base / ours:.2f}x"))

    n = 4 * 1024 * 1024
    x = torch.randn(n)
    k = rnd.key(0)

    # 1. dropout on 4M floats (forward only), a fresh key per call as in training.
    keys = iter(rnd.split(k, 10_000))
    t_ours, t_base = compare(
        lambda: rnd.dropout(next(keys), x, 0.1), lambda: F.dropout(x, 0.1, True), reps=reps
    )
    add("dropout fwd, 4M fp32, p=0.1", t_ours, t_base, "F.dropout")

    xg = x.clone().requires_grad_(True)

    def ours_fb() -> None:
        rnd.dropout(next(keys), xg, 0.1).sum().backward()

    def base_fb() -> None:
        F.dropout(xg, 0.1, True).sum().backward()

    t_ours, t_base = compare(ours_fb, base_fb, reps=reps)
    add("dropout fwd+bwd, 4M fp32", t_ours, t_base, "F.dropout")

    # 2. Samplers on 4M elements vs the global-RNG natives.
    t_ours, t_base = compare(lambda: rnd.uniform(next(keys), (n,)), lambda: torch.rand(n), reps=reps)
    add("uniform, 4M fp32", t_ours, t_base, "torch.rand")
    t_ours, t_base = compare(lambda: rnd.normal(next(keys), (n,)), lambda: torch.randn(n), reps=reps)
    add("normal, 4M fp32", t_ours, t_base, "torch.randn")

    # 3. Per-call overhead on tiny outputs: cached key (same key again, as in a
    #    remat recompute) and a fresh key per call (the MT19937 state is built).
    inner = 2000
    t_ours, t_base = compare(lambda: rnd.uniform(k, (16,)), lambda: torch.rand(16), reps=reps, inner=inner)
    add("uniform(16), same key (cached state)", t_ours, t_base, "torch.rand(16)")
    fresh = iter(rnd.split(rnd.key(1), inner * (reps + 2) * 2))
    t_ours, t_base = compare(
        lambda: rnd.uniform(next(fresh), (16,)), lambda: torch.rand(16), reps=reps, inner=inner
    )
    add("uniform(16), fresh key", t_ours, t_base, "torch.rand(16)")

    def gen_seed() -> None:
        g = torch.Generator()
        g.manual_seed(1234)

    t_ours, t_base = compare(lambda: rnd.split(k), gen_seed, reps=reps, inner=inner)
    add("split(key) (Threefry, 2 blocks)", t_ours, t_base, "Generator()+manual_seed")
    t_ours, t_base = compare(lambda: rnd.fold_in(k, 7), gen_seed, reps=reps, inner=inner)
    add("fold_in(key, 7)", t_ours, t_base, "Generator()+manual_seed")

    # 4. vmap over a batch of keys (per-example dropout masks) vs a Python loop.
    b, d = 64, 4096
    xb = torch.randn(b, d)
    kb = rnd.split(k, b)
    vm = vmap(lambda kk, xx: rnd.dropout(kk, xx, 0.1))
    t_ours, t_base = compare(
        lambda: vm(kb, xb),
        lambda: torch.stack([rnd.dropout(kb[i], xb[i], 0.1) for i in range(b)]),
        reps=reps,
        inner=5,
    )
    add(f"vmap dropout over {b} keys, ({b},{d})", t_ours, t_base, "python loop")
    t_ours, t_base = compare(lambda: vm(kb, xb), lambda: F.dropout(xb, 0.1, True), reps=reps, inner=5)
    add(f"vmap dropout over {b} keys, ({b},{d})", t_ours, t_base, "F.dropout (one mask)")

    # 5. Full remat of a dropout MLP step vs torch.utils.checkpoint + nn.Dropout.
    try:
        from remat_fn import remat
    except ImportError:  # pragma: no cover - remat not built yet
        remat = None
    if remat is not None:
        rows.extend(_remat_rows(reps))

    print("| benchmark | remat_fn.random | baseline | baseline is | speed-up |")
    print("|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print(
        f"\n_torch {torch.__version__}, {torch.get_num_threads()} threads, {args.stat} of "
        f"{reps} interleaved repetitions"
        f"{', steady malloc' if 'MALLOC_TRIM_THRESHOLD_' in os.environ else ''}; speed-up = "
        "baseline time / remat_fn time (>1 means remat_fn is faster)._"
    )


def _remat_rows(reps: int) -> list[tuple[str, str, str, str, str]]:
    from torch.utils.checkpoint import checkpoint

    from remat_fn import remat

    torch.manual_seed(0)
    width, batch, depth, p = 1024, 512, 4, 0.1
    ws = [(torch.randn(width, width) / width**0.5).requires_grad_(True) for _ in range(depth)]
    x = torch.randn(batch, width)

    def block_keys(h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        ks = rnd.split(key, depth)
        for i, w in enumerate(ws):
            h = rnd.dropout(ks[i], torch.relu(h @ w), p)
        return h

    drops = [torch.nn.Dropout(p) for _ in range(depth)]

    def block_global(h: torch.Tensor) -> torch.Tensor:
        for w, drop in zip(ws, drops):
            h = drop(torch.relu(h @ w))
        return h

    rblock = remat(block_keys)
    keys = iter(rnd.split(rnd.key(3), 10_000))

    def ours() -> None:
        rblock(x, next(keys)).sum().backward()

    def base() -> None:
        checkpoint(block_global, x, use_reentrant=False, preserve_rng_state=True).sum().backward()

    t_ours, t_base = compare(ours, base, reps=reps)
    rows = [(f"remat dropout MLP step ({depth}x{width}, batch {batch})", fmt(t_ours), fmt(t_base),
             "checkpoint(reentrant=False)+nn.Dropout", f"{t_base / t_ours:.2f}x")]
    plain_keys = iter(rnd.split(rnd.key(4), 10_000))
    t_plain, _ = compare(lambda: block_keys(x, next(plain_keys)).sum().backward(), base, reps=reps)
    rows.append(("same step without remat (keys)", fmt(t_plain), fmt(t_base),
                 "checkpoint(reentrant=False)+nn.Dropout", f"{t_base / t_plain:.2f}x"))
    return rows


if __name__ == "__main__":
    main()
