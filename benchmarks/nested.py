"""Nested regions under ``torch.func``: binomial ``remat_scan`` (regions nested in regions)
under ``grad`` and ``grad`` of ``grad``.  Each region nested in a replayed one replays as a
region of its own (``docs/design.md``): measured are the live-bytes peak of one step, the
step function's Python calls (once per forward step, as plain code), and the step time
against no remat, interleaved."""

from __future__ import annotations

import torch

from .harness import interleaved, ratio, spread, table

MiB = 2**20


def _setup(quick: bool):
    torch.manual_seed(0)
    n, steps = (64, 16) if quick else (256, 64)
    w = torch.randn(n, n) / n**0.5
    xs = torch.randn(steps, 128, n)
    c0 = torch.randn(128, n)
    calls = [0]

    def step(c, x):
        calls[0] += 1
        h = torch.tanh(c @ w + x)
        return torch.sin(h) * h, None

    return step, c0, xs, calls, f"{steps} steps of tanh(c @ W + x) on 128x{n} float32, binomial checkpoints=3"


def run(quick: bool) -> dict:
    from torch.func import grad

    from remat_fn import remat_scan
    from remat_fn.memory import LiveBytes

    step, c0, xs, calls, model = _setup(quick)

    def plain(c):
        for x in xs:
            c, _ = step(c, x)
        return c

    scans = {"no remat": plain, "remat_scan(checkpoints=3)": lambda c: remat_scan(step, c, xs, checkpoints=3)[0]}
    transforms = {"grad": lambda f: grad(lambda c: f(c).sum())(c0),
                  "grad of grad": lambda f: grad(lambda c: grad(lambda c: f(c).sum())(c).pow(2).sum())(c0)}
    rows: dict = {}
    for tname, tr in transforms.items():
        for sname, f in scans.items():
            tr(f)  # (warm)
            calls[0] = 0
            with LiveBytes() as m:
                tr(f)
            rows[(tname, sname)] = {"peak_MiB": m.peak / MiB, "calls": calls[0]}
        t = interleaved({k: (lambda f=f, tr=tr: tr(f)) for k, f in scans.items()}, repeats=3 if quick else 7)
        for sname in scans:
            rows[(tname, sname)]["time"] = tuple(spread(t[sname]))
            rows[(tname, sname)]["vs_plain"] = tuple(ratio(t[sname], t["no remat"]))
    return {"model": model, "forward_calls": len(xs),
            "rows": [{"transform": k[0], "variant": k[1], **v} for k, v in rows.items()]}


def md(r: dict) -> str:
    head = ["transform", "variant", "peak live MiB", "step Python calls", "time ms, median (min-max)", "vs no remat"]
    body = [[x["transform"], x["variant"], f"{x['peak_MiB']:.2f}", x["calls"],
             "{:.1f} ({:.1f}-{:.1f})".format(*(v * 1e3 for v in x["time"])),
             "{:.2f}x ({:.2f}-{:.2f})".format(*x["vs_plain"])] for x in r["rows"]]
    return (f"{r['model']}; the forward calls the step {r['forward_calls']} times.\n\n" + table(head, body))


SECTIONS = {"nested": (run, md, "Nested regions under torch.func: binomial remat_scan, memory, Python calls, time")}
CHILDREN: dict = {}
