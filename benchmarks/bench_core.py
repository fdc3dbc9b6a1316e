"""Core benchmark: per-call overhead and full-remat training-step cost.

Prints, side by side from one run:

1. per-call overhead of a tiny function ((x*2).sin() on 16 floats, forward +
   backward): plain, ``torch.utils.checkpoint(use_reentrant=False)`` and
   ``remat_fn.remat``; the overhead is time minus plain.
2. a full-remat training step of a 6-block pre-LN MLP stack, eager, as a ratio
   of the physical limit (plain step + one extra forward with grad enabled),
   against ``torch.utils.checkpoint``; and the same under ``torch.func.grad``
   where torch's checkpoint cannot run.
3. live activation bytes after forward and peak bytes (remat_fn.memory.LiveBytes).

Timings are medians over interleaved repeats.  Nothing here is asserted.

Run: python benchmarks/bench_core.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from torch.utils.checkpoint import checkpoint as torch_ckpt

import remat_fn
from remat_fn.memory import LiveBytes, MiB


def _median_time(fns: dict, repeats: int, inner: int) -> dict:
    """Interleave the candidates so machine noise hits them equally."""
    samples = {k: [] for k in fns}
    for fn in fns.values():  # warm-up
        for _ in range(max(1, inner // 10)):
            fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[k].append((time.perf_counter() - t0) / inner)
    return {k: statistics.median(v) for k, v in samples.items()}


def bench_overhead(repeats: int, inner: int) -> dict:
    f = lambda x: (x * 2).sin()
    rf = remat_fn.remat(f)
    x = torch.randn(16, requires_grad=True)
    fns = {
        "plain": lambda: f(x).sum().backward(),
        "torch.utils.checkpoint": lambda: torch_ckpt(f, x, use_reentrant=False).sum().backward(),
        "remat_fn.remat": lambda: rf(x).sum().backward(),
    }
    t = _median_time(fns, repeats, inner)
    base = t["plain"]
    return {k: {"us": v * 1e6, "overhead_us": (v - base) * 1e6} for k, v in t.items()}


class Block(torch.nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, hidden)
        self.down = torch.nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln(x))))


def bench_step(repeats: int, d: int, hidden: int, tokens: int, depth: int = 6) -> dict:
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block(d, hidden) for _ in range(depth))
    rblocks = [remat_fn.remat(b) for b in blocks]
    x = torch.randn(tokens, d)

    def fwd(mode):
        h = x
        for b, rb in zip(blocks, rblocks):
            if mode == "plain":
                h = b(h)
            elif mode == "ckpt":
                h = torch_ckpt(b, h, use_reentrant=False)
            else:
                h = rb(h)
        return h.pow(2).mean()

    def step(mode):
        blocks.zero_grad(set_to_none=True)
        fwd(mode).backward()

    def forward_only():  # what a full recompute costs: one forward with grad enabled
        fwd("plain")

    params = {k: v.detach() for k, v in blocks.named_parameters()}

    def func_loss(p, use):
        h = x
        for i, (b, rb) in enumerate(zip(blocks, rblocks)):
            h = torch.func.functional_call(b, {k[len(f"{i}."):]: v for k, v in p.items() if k.startswith(f"{i}.")}, (h,)) \
                if not use else _swap(b, p, i, rb, h)
        return h.pow(2).mean()

    fns = {
        "plain step": lambda: step("plain"),
        "forward (grad enabled)": forward_only,
        "torch.utils.checkpoint step": lambda: step("ckpt"),
        "remat_fn step": lambda: step("remat"),
        "torch.func.grad plain": lambda: torch.func.grad(func_loss)(params, False),
        "torch.func.grad remat_fn": lambda: torch.func.grad(func_loss)(params, True),
    }
    t = _median_time(fns, repeats, 1)
    limit = t["plain step"] + t["forward (grad enabled)"]
    res = {k: v * 1e3 for k, v in t.items()}
    res["one-extra-forward limit"] = limit * 1e3
    res["remat_fn / limit"] = t["remat_fn step"] / limit
    res["torch.utils.checkpoint / limit"] = t["torch.utils.checkpoint step"] / limit
    res["remat_fn / torch.utils.checkpoint"] = t["remat_fn step"] / t["torch.utils.checkpoint step"]
    res["remat_fn / plain"] = t["remat_fn step"] / t["plain step"]
    grad_limit = t["torch.func.grad plain"] + t["forward (grad enabled)"]
    res["torch.func.grad remat_fn / limit"] = t["torch.func.grad remat_fn"] / grad_limit

    mem = {}
    for mode in ("plain", "ckpt", "remat"):
        blocks.zero_grad(set_to_none=True)
        with LiveBytes() as m:
            loss = fwd(mode)
            after = m.live
            loss.backward()
        mem[mode] = {"after_forward_MiB": after / MiB, "peak_MiB": m.peak / MiB}
        del loss
    for use in (False, True):
        with LiveBytes() as m:
            torch.func.grad(func_loss)(params, use)
        mem["torch.func.grad " + ("remat" if use else "plain")] = {"peak_MiB": m.peak / MiB}
    res["memory"] = mem
    return res


def _swap(block, p, i, rb, h):
    from torch.nn.utils.stateless import _reparametrize_module

    sub = {k[len(f"{i}."):]: v for k, v in p.items() if k.startswith(f"{i}.")}
    with _reparametrize_module(block, sub):
        return rb(h)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few repeats, small model (CI smoke run)")
    ap.add_argument("--json", help="write the results to this JSON file")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    q = args.quick
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "machine": platform.machine(), "threads": torch.get_num_threads()}
    ov = bench_overhead(repeats=5 if q else 15, inner=200 if q else 2000)
    st = bench_step(repeats=3 if q else 15, d=128 if q else 256, hidden=512 if q else 1024,
                    tokens=256 if q else 1024)
    print(f"# remat_fn core benchmark  ({info})\n")
    print("## Per-call overhead, tiny function (x*2).sin() on 16 floats, fwd+bwd\n")
    print("| variant | time (us) | overhead vs plain (us) |\n|---|---:|---:|")
    for k, v in ov.items():
        print(f"| {k} | {v['us']:.1f} | {v['overhead_us']:.1f} |")
    ratio = ov["remat_fn.remat"]["overhead_us"] / ov["torch.utils.checkpoint"]["overhead_us"]
    print(f"\nremat_fn overhead / torch.utils.checkpoint overhead = **{ratio:.2f}x**\n")
    print("## Full-remat training step, 6-block pre-LN MLP stack\n")
    print("| measurement | value |\n|---|---:|")
    for k, v in st.items():
        if k == "memory":
            continue
        unit = "" if "/" in k else " ms"
        print(f"| {k} | {v:.3f}{unit} |")
    print("\n| memory | after forward (MiB) | peak (MiB) |\n|---|---:|---:|")
    for k, v in st["memory"].items():
        print(f"| {k} | {v.get('after_forward_MiB', float('nan')):.1f} | {v['peak_MiB']:.1f} |")
    out = {"info": info, "overhead": ov, "overhead_ratio_vs_torch_checkpoint": ratio, "step": st}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return out


if __name__ == "__main__":
    main()
