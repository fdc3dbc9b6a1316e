"""``random``: :mod:`remat_fn.random` against torch's global-RNG samplers.

Each row times a keyed sampler and its baseline in the same rounds; speed-up is
the per-round ratio baseline / remat_fn (> 1: remat_fn.random is faster),
median (min-max).  On small VMs first-touch page faults of fresh multi-MiB
buffers can cost more than the RNG itself; set ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` high to measure compute rather than page faults.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import vmap
from torch.utils.checkpoint import checkpoint

import remat_fn
from remat_fn import random as rnd

from .harness import Spread, fmt_time, interleaved, ratio, spread, table


def run(quick: bool) -> dict:
    reps = 5 if quick else 15
    n = (1 if quick else 4) * 1024 * 1024
    m = f"{n // (1024 * 1024)}M"
    x = torch.randn(n)
    k = rnd.key(0)
    keys = iter(rnd.split(k, 50_000))
    rows = []

    def add(what, ours, base, base_name, inner=1):
        s = interleaved({"ours": ours, "base": base}, repeats=reps, inner=inner, warmup=2)
        rows.append({"benchmark": what, "ours": tuple(spread(s["ours"])), "base": tuple(spread(s["base"])),
                     "baseline": base_name, "speedup": tuple(ratio(s["base"], s["ours"]))})

    add(f"dropout fwd, {m} fp32, p=0.1", lambda: rnd.dropout(next(keys), x, 0.1),
        lambda: F.dropout(x, 0.1, True), "F.dropout")
    xg = x.clone().requires_grad_()
    add(f"dropout fwd+bwd, {m} fp32", lambda: rnd.dropout(next(keys), xg, 0.1).sum().backward(),
        lambda: F.dropout(xg, 0.1, True).sum().backward(), "F.dropout")
    add(f"uniform, {m} fp32", lambda: rnd.uniform(next(keys), (n,)), lambda: torch.rand(n), "torch.rand")
    add(f"normal, {m} fp32", lambda: rnd.normal(next(keys), (n,)), lambda: torch.randn(n), "torch.randn")
    inner = 200 if quick else 1000
    add("uniform(16), same key (cached state)", lambda: rnd.uniform(k, (16,)), lambda: torch.rand(16),
        "torch.rand(16)", inner=inner)

    def gen_seed():
        g = torch.Generator()
        g.manual_seed(1234)

    add("split(key)", lambda: rnd.split(k), gen_seed, "Generator()+manual_seed", inner=inner)
    add("fold_in(key, 7)", lambda: rnd.fold_in(k, 7), gen_seed, "Generator()+manual_seed", inner=inner)
    b, d = 64, 4096
    xb = torch.randn(b, d)
    kb = rnd.split(k, b)
    vm = vmap(lambda kk, xx: rnd.dropout(kk, xx, 0.1))
    add(f"vmap dropout over {b} keys, ({b},{d})", lambda: vm(kb, xb),
        lambda: torch.stack([rnd.dropout(kb[i], xb[i], 0.1) for i in range(b)]), "python loop over keys", inner=3)

    # a remat'd dropout MLP step with keys vs torch's checkpoint + nn.Dropout (global RNG state)
    torch.manual_seed(0)
    width, batch, depth, p = (512, 256, 4, 0.1) if quick else (1024, 512, 4, 0.1)
    ws = [(torch.randn(width, width) / width**0.5).requires_grad_(True) for _ in range(depth)]
    h0 = torch.randn(batch, width)

    def block_keys(h, key):
        ks = rnd.split(key, depth)
        for i, w in enumerate(ws):
            h = rnd.dropout(ks[i], torch.relu(h @ w), p)
        return h

    drops = [torch.nn.Dropout(p) for _ in range(depth)]

    def block_global(h):
        for w, drop in zip(ws, drops):
            h = drop(torch.relu(h @ w))
        return h

    rblock = remat_fn.remat(block_keys)
    add(f"remat dropout MLP step ({depth}x{width}, batch {batch})",
        lambda: rblock(h0, next(keys)).sum().backward(),
        lambda: checkpoint(block_global, h0, use_reentrant=False).sum().backward(),
        "torch checkpoint + nn.Dropout")
    return {"rows": rows}


def md(r: dict) -> str:
    def t(v):
        s = Spread(*v)
        return f"{fmt_time(s.median)} ({fmt_time(s.lo)}-{fmt_time(s.hi)})"

    return (table(["benchmark", "remat_fn.random", "baseline", "baseline is", "speed-up"],
                  [[row["benchmark"], t(row["ours"]), t(row["base"]), row["baseline"],
                    Spread(*row["speedup"]).fmt(digits=2, unit="x")] for row in r["rows"]],
                  "|---|---:|---:|---|---:|")
            + "\n\nspeed-up = baseline time / remat_fn time per round (> 1: remat_fn.random is faster).")


SECTIONS = {"random": (run, md, "remat_fn.random throughput")}
CHILDREN: dict = {}
