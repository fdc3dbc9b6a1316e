"""All-gather cost vs memory saved by ``remat_fn.distributed.remat`` (gloo, CPU).

Spawns N CPU ranks (default 2 and 4) with the gloo backend on 127.0.0.1. Every
rank runs the same MLP stack (replicated activations, as in a tensor-parallel
group) three ways: ``remat_fn.remat``, ``remat_fn.distributed.remat`` with and
without prefetch.  It reports, on rank 0:

* live activation bytes per rank after forward (``remat_fn.memory.LiveBytes``),
* median forward+backward step time, and the extra time per step,
* the cost of one bare ``all_gather`` of one activation's slice,
* the extra time per MiB of activation memory saved.

Usage::

    python benchmarks/bench_distributed.py                 # 2 and 4 ranks
    python benchmarks/bench_distributed.py --ranks 2 --rows 1024 --dim 1024 --blocks 8

Ranks run one thread each. With more ranks than cores the timings include
oversubscription; the memory figures do not depend on it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import remat_fn  # noqa: E402
from remat_fn import distributed as rd  # noqa: E402
from remat_fn.memory import LiveBytes, MiB  # noqa: E402


def _block(h, w1, w2):
    return h + torch.relu(h @ w1) @ w2


def _model(ws, x, wrap):
    h = x * 1.0
    for w1, w2 in ws:
        h = wrap(_block)(h, w1, w2)
    return h


def _step_times(ws, x, variants, repeats):
    """Median step time of each variant, the variants interleaved to cancel drift."""
    import torch.distributed as dist

    times = {name: [] for name in variants}
    for i in range(repeats + 1):
        for name, wrap in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            _model(ws, x, wrap).square().mean().backward()
            if i:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def _worker(rank, world, port, args, q):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    g = torch.Generator().manual_seed(0)
    d, rows, n = args.dim, args.rows, args.blocks
    ws = [(torch.randn(d, 2 * d, generator=g) / d**0.5, torch.randn(2 * d, d, generator=g) / (2 * d) ** 0.5)
          for _ in range(n)]
    ws = [(a.requires_grad_(), b.requires_grad_()) for a, b in ws]
    x = torch.randn(rows, d, generator=g).requires_grad_()
    variants = {
        "remat": remat_fn.remat,
        "distributed": rd.remat,
        "distributed, no prefetch": rd.remat(prefetch=False),
        "distributed, no check": rd.remat(check_replicated=False),
    }
    res = {}
    for name, wrap in variants.items():
        with LiveBytes() as m:
            y = _model(ws, x, wrap)
            live = m.live
            y.square().mean().backward()
            del y
        res[name] = live
    t = _step_times(ws, x, variants, args.repeats)
    res = {name: (res[name], t[name]) for name in variants}
    # one bare all-gather of one activation's slice
    nbytes = rows * d * 4
    chunk = -(-nbytes // world)
    shard = torch.zeros(chunk, dtype=torch.uint8)
    buf = torch.empty(chunk * world, dtype=torch.uint8)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    ts = []
    for _ in range(args.repeats * 4):
        dist.barrier()
        t0 = time.perf_counter()
        gather(buf, shard)
        ts.append(time.perf_counter() - t0)
    if rank == 0:
        q.put((world, res, statistics.median(ts), nbytes))
    dist.barrier()
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    rows = []
    for world in args.ranks:
        q = ctx.SimpleQueue()
        mp.start_processes(_worker, args=(world, _free_port(), args, q), nprocs=world,
                           start_method="spawn", join=True)
        rows.append(q.get())
    act = args.rows * args.dim * 4 / MiB
    print(f"\nMLP stack: {args.blocks} blocks, activations f32[{args.rows},{args.dim}] "
          f"({act:.2f} MiB each), gloo on CPU, {os.cpu_count()} cores, 1 thread per rank, "
          f"torch {torch.__version__}\n")
    print("| ranks | variant | live after fwd / rank (MiB) | vs remat | step (ms) | extra / step (ms) "
          "| saved (MiB) | extra ms per MiB saved |")
    print("|---|---|---|---|---|---|---|---|")
    for world, res, _gather_s, _nbytes in rows:
        base_live, base_t = res["remat"]
        for name, (live, t) in res.items():
            saved = (base_live - live) / MiB
            extra = (t - base_t) * 1e3
            per = f"{extra / saved:.2f}" if saved > 0.01 else "-"
            print(f"| {world} | {name} | {live / MiB:.2f} | {live / base_live:.2f}x | {t * 1e3:.1f} "
                  f"| {extra:+.1f} | {saved:.2f} | {per} |")
    print("\n| ranks | one all-gather of a " f"{act:.2f} MiB activation (ms) | GB/s (output bytes) |")
    print("|---|---|---|")
    for world, _res, gather_s, nbytes in rows:
        print(f"| {world} | {gather_s * 1e3:.2f} | {nbytes / gather_s / 1e9:.2f} |")


if __name__ == "__main__":
    main()
