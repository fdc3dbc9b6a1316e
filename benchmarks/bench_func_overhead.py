"""Per-call overhead of one tiny region, eager autograd vs torch.func.grad, and
remat_fn.compat.checkpoint vs a prebuilt remat: two 64x64 matmuls and a tanh,
forward + backward, one thread, variants interleaved, median over rounds.

    python benchmarks/bench_func_overhead.py [--rounds 11] [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.func import grad
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from remat_fn import remat
from remat_fn.compat import checkpoint


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    w1, w2, x = torch.randn(64, 64) / 8, torch.randn(64, 64) / 8, torch.randn(64, 64)

    def f(x, w1, w2):
        return torch.tanh(x @ w1) @ w2

    rf = remat(f)

    class Floor(torch.autograd.Function):
        """The torch.func path's design with nothing else: an autograd.Function whose
        backward recomputes with torch.func.vjp (no captures, checks, RNG or autocast)."""

        generate_vmap_rule = True

        @staticmethod
        def forward(x, a, b):
            return f(x, a, b)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(*inputs)

        @staticmethod
        def backward(ctx, g):
            _, fn = torch.func.vjp(f, *ctx.saved_tensors)
            return fn(g)

    def eager(fn):
        a, b, c = (t.clone().requires_grad_() for t in (x, w1, w2))
        fn(a, b, c).sum().backward()

    def func(fn):
        grad(lambda a, b, c: fn(a, b, c).sum(), argnums=(0, 1, 2))(x, w1, w2)

    variants = {  # every callable has the same shape: a lambda over the arguments
        "eager plain": lambda: eager(lambda *a: f(*a)),
        "eager remat": lambda: eager(lambda *a: rf(*a)),
        "eager compat": lambda: eager(lambda *a: checkpoint(f, *a, use_reentrant=False)),
        "eager torch checkpoint": lambda: eager(lambda *a: torch_checkpoint(f, *a, use_reentrant=False)),
        "func plain": lambda: func(lambda *a: f(*a)),
        "func remat": lambda: func(lambda *a: rf(*a)),
        "func compat": lambda: func(lambda *a: checkpoint(f, *a)),
        "func bare Function + vjp (floor)": lambda: func(lambda *a: Floor.apply(*a)),
    }
    res: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for k, v in variants.items():
            for _ in range(20):
                v()
            t = time.perf_counter()
            for _ in range(args.calls):
                v()
            res[k].append((time.perf_counter() - t) / args.calls * 1e6)
    med = {k: statistics.median(v) for k, v in res.items()}
    print("| variant | median (us) | min | max |\n|---|---:|---:|---:|")
    for k in variants:
        print(f"| {k} | {med[k]:.1f} | {min(res[k]):.1f} | {max(res[k]):.1f} |")
    eo = med["eager remat"] - med["eager plain"]
    fo = med["func remat"] - med["func plain"]
    print(f"\noverhead per call: eager {eo:.1f} us, torch.func {fo:.1f} us (ratio {fo / eo:.2f}); "
          f"compat - remat: eager {med['eager compat'] - med['eager remat']:+.1f} us, "
          f"torch.func {med['func compat'] - med['func remat']:+.1f} us; the design's floor under "
          f"torch.func: {med['func bare Function + vjp (floor)'] - med['func plain']:.1f} us")
    return med


if __name__ == "__main__":
    main()
