"""``distributed``: all-gather cost against memory saved by ``remat_fn.distributed.remat``.

Spawns N CPU ranks (2 with ``--quick``, else 2 and 4) with the gloo backend on
127.0.0.1.  Every rank runs the same MLP stack (replicated activations, as in a
tensor-parallel group) with ``remat_fn.remat`` and with
``remat_fn.distributed.remat`` (with and without prefetch and the replication
check), and reports on rank 0 the live activation bytes per rank after the
forward (LiveBytes), the step time (median (min-max) of interleaved rounds, a
barrier before each step), the extra time per MiB saved, and the cost of one
bare all-gather of one activation's slice.  Ranks run one thread each; with
more ranks than cores the times include oversubscription, the memory does not.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import remat_fn
from remat_fn import distributed as rd
from remat_fn.memory import LiveBytes

from .harness import MiB, Spread, interleaved, spread, table


def _block(h, w1, w2):
    return h + torch.relu(h @ w1) @ w2


def _model(ws, x, wrap):
    h = x * 1.0
    for w1, w2 in ws:
        h = wrap(_block)(h, w1, w2)
    return h


def _worker(rank, world, port, cfg, q):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    g = torch.Generator().manual_seed(0)
    d, rows, n, repeats = cfg["dim"], cfg["rows"], cfg["blocks"], cfg["repeats"]
    ws = [(torch.randn(d, 2 * d, generator=g) / d**0.5, torch.randn(2 * d, d, generator=g) / (2 * d) ** 0.5)
          for _ in range(n)]
    ws = [(a.requires_grad_(), b.requires_grad_()) for a, b in ws]
    x = torch.randn(rows, d, generator=g).requires_grad_()
    wraps = {
        "remat": remat_fn.remat,
        "distributed": rd.remat,
        "distributed, no prefetch": rd.remat(prefetch=False),
        "distributed, no check": rd.remat(check_replicated=False),
    }
    live = {}
    for name, wrap in wraps.items():
        with LiveBytes() as m:
            y = _model(ws, x, wrap)
            live[name] = m.live
            y.square().mean().backward()
            del y
    steps = {name: (lambda wrap=wrap: _model(ws, x, wrap).square().mean().backward()) for name, wrap in wraps.items()}
    t = interleaved(steps, repeats=repeats, before=dist.barrier)
    nbytes = rows * d * 4
    chunk = -(-nbytes // world)
    shard = torch.zeros(chunk, dtype=torch.uint8)
    buf = torch.empty(chunk * world, dtype=torch.uint8)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    tg = interleaved({"gather": lambda: gather(buf, shard)}, repeats=repeats * 4, before=dist.barrier)
    if rank == 0:
        q.put({"world": world, "live": live, "times": t, "gather": tg["gather"], "nbytes": nbytes})
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(quick: bool) -> dict:
    if not dist.is_available() or not dist.is_gloo_available():
        return {"skipped": "torch.distributed with gloo is not available"}
    cfg = dict(rows=256, dim=256, blocks=4, repeats=3) if quick else dict(rows=512, dim=512, blocks=8, repeats=7)
    ctx = mp.get_context("spawn")
    out = []
    for world in ([2] if quick else [2, 4]):
        q = ctx.SimpleQueue()
        mp.start_processes(_worker, args=(world, _free_port(), cfg, q), nprocs=world, start_method="spawn",
                           join=True)
        r = q.get()
        base_live, base_t = r["live"]["remat"], r["times"]["remat"]
        rows = {}
        for name, live in r["live"].items():
            t = r["times"][name]
            saved = (base_live - live) / MiB
            extra = spread([(a - b) * 1e3 for a, b in zip(t, base_t)])
            rows[name] = {"live_MiB": live / MiB, "vs_remat": live / base_live, "ms": tuple(spread(t).scaled(1e3)),
                          "extra_ms": tuple(extra), "saved_MiB": saved,
                          "ms_per_MiB_saved": extra.median / saved if saved > 0.01 else None}
        out.append({"world": world, "rows": rows, "gather_ms": tuple(spread(r["gather"]).scaled(1e3)),
                    "nbytes": r["nbytes"]})
    return {"config": cfg, "cpus": os.cpu_count(), "worlds": out}


def md(r: dict) -> str:
    if "skipped" in r:
        return r["skipped"]
    c = r["config"]
    act = c["rows"] * c["dim"] * 4 / MiB
    rows, gathers = [], []
    for w in r["worlds"]:
        for name, v in w["rows"].items():
            per = f"{v['ms_per_MiB_saved']:.2f}" if v["ms_per_MiB_saved"] is not None else "-"
            rows.append([w["world"], name, f"{v['live_MiB']:.2f}", f"{v['vs_remat']:.2f}x", Spread(*v["ms"]).fmt(),
                         Spread(*v["extra_ms"]).fmt(), f"{v['saved_MiB']:.2f}", per])
        g = Spread(*w["gather_ms"])
        gathers.append([w["world"], g.fmt(digits=2), f"{w['nbytes'] / (g.median / 1e3) / 1e9:.2f}"])
    return (f"MLP stack: {c['blocks']} blocks, activations f32[{c['rows']},{c['dim']}] ({act:.2f} MiB each), "
            f"gloo on CPU, {r['cpus']} cores, 1 thread per rank.\n\n"
            + table(["ranks", "variant", "live after fwd / rank (MiB)", "vs remat", "step (ms)",
                     "extra / step (ms)", "saved (MiB)", "extra ms per MiB saved"], rows, "|---|---|" + "---:|" * 6)
            + "\n\n" + table(["ranks", f"one all-gather of a {act:.2f} MiB activation (ms)", "GB/s (output bytes)"],
                             gathers))


SECTIONS = {"distributed": (run, md, "Activation partitioning across ranks (gloo, CPU)")}
CHILDREN: dict = {}
