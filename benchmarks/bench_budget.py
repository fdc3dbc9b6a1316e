"""memory_budget in a real training step: fresh-process peak RSS vs the live-bytes meter,
planning passes, and per-call wrapping.

HF GPT-2 from a config (n_layer=6, n_embd=256, n_head=8, n_positions=256), batch 4,
seq 256, AdamW, one thread, ``use_cache=False``.  Each variant runs in a fresh
process: build the model and optimizer, run ``--steps`` steps and report the
process's peak RSS (VmHWM).  A baseline process builds the same model and
optimizer state (AdamW's moments created by a step on zero gradients) and runs
no forward; "RSS above baseline" subtracts its VmHWM.

    python benchmarks/bench_budget.py [--steps 4] [--json out.json]

Variants: no checkpointing, torch's checkpoint, memory_budget(0.5) wrapped once
(``remat(block.forward, policy=...)`` built at set-up) and built per call (the
``compat`` form Hugging Face uses).  Also printed: how many planning passes ran
and the step time of each variant (median over steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

VARIANTS = ["baseline", "none", "torch", "budget_once", "budget_per_call"]

CHILD = r"""
import functools, gc, json, os, sys, time
import torch
torch.set_num_threads(1)
import transformers
import remat_fn, remat_fn.compat
from remat_fn.memory import LiveBytes

variant, steps = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
cfg = transformers.GPT2Config(n_layer=6, n_embd=256, n_head=8, n_positions=256, vocab_size=512,
                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = transformers.GPT2LMHeadModel(cfg)
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
ids = torch.randint(0, 512, (4, 256))
budget = remat_fn.policies.memory_budget(0.5)
if variant == "torch":
    model._set_gradient_checkpointing(True, gradient_checkpointing_func=functools.partial(
        torch.utils.checkpoint.checkpoint, use_reentrant=False))
elif variant == "budget_per_call":
    def per_call(function, *args, **kwargs):
        return remat_fn.remat(function, policy=budget)(*args, **kwargs)
    model._set_gradient_checkpointing(True, gradient_checkpointing_func=per_call)
elif variant == "budget_once":
    for block in model.transformer.h:
        block.forward = remat_fn.remat(block.forward, policy=budget)

def step():
    opt.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    opt.step()

if variant == "baseline":  # model and optimizer state, no activations ever
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    steps = 0
times = []
with LiveBytes() as meter:
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
hwm = 0
with open("/proc/self/status") as f:
    for line in f:
        if line.startswith("VmHWM"):
            hwm = int(line.split()[1]) * 1024
from remat_fn import _budget
plans = dict(_budget.stats) if hasattr(_budget, "stats") else {}
print(json.dumps({"hwm": hwm, "live_peak": meter.peak, "times": times, "plans": plans}))
"""


def run(variant: str, steps: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, variant, str(steps)], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"variant {variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1, help="processes per variant (median reported)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):  # interleaved
        for v in VARIANTS:
            res[v].append(run(v, args.steps))
    base = statistics.median(r["hwm"] for r in res["baseline"])
    MiB = 2**20
    rows = {}
    print(f"GPT-2 6x256, batch 4x256, AdamW, 1 thread, {args.steps} steps; RSS = VmHWM of a fresh "
          f"process minus the baseline process ({base / MiB:.0f} MiB); step time: median of the steps "
          "after the first\n")
    print("| variant | RSS above baseline (MiB) | vs none | LiveBytes peak (MiB) | step (ms) | planning passes |")
    print("|---|---:|---:|---:|---:|---:|")
    none = statistics.median(r["hwm"] for r in res["none"]) - base
    for v in VARIANTS[1:]:
        rss = statistics.median(r["hwm"] for r in res[v]) - base
        live = statistics.median(r["live_peak"] for r in res[v])
        t = statistics.median(t for r in res[v] for t in r["times"][1:])
        plans = res[v][0]["plans"].get("measured", "-")
        rows[v] = {"rss_above_baseline": rss, "live_peak": live, "step_s": t, "plans": plans}
        print(f"| {v} | {rss / MiB:.0f} | {rss / none:.2f}x | {live / MiB:.0f} | {t * 1e3:.0f} | {plans} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"baseline": base, "rows": rows, "raw": res}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
