"""Levels above a vmap: MAML's meta-gradient (``grad(vmap(grad))``) and per-task
Hessian-vector products (``vmap(jvp(grad))``) over a pre-LN MLP whose blocks are regions; and
a vmap keeping apart the per-task gradients of weights it does not batch where the forward
level's graph does not serve; each also with pairs of block regions nested in a region (``vmap(jacrev)``; ``vmap(grad)`` given parameters that require
grad, which eager autograd may differentiate).  Backward replays the forward's torch calls
there (``remat_fn/_logical.py``): measured are the live-bytes peak of one step, the blocks'
Python calls (plain code's count: once per forward), and the step time against no remat,
interleaved."""

from __future__ import annotations

import torch

from .harness import interleaved, ratio, spread, table
from .models import MLPStack

MiB = 2**20


def run(quick: bool) -> dict:
    from torch.func import functional_call, grad, jacrev, jvp, vmap

    from remat_fn import remat
    from remat_fn.memory import LiveBytes

    torch.manual_seed(0)
    d, hidden, depth, tasks, rows = (32, 128, 4, 2, 32) if quick else (64, 256, 6, 4, 128)
    net = MLPStack(d, hidden, depth)
    params = {k: v.detach() for k, v in net.named_parameters()}
    own = dict(net.named_parameters())  # (they require grad)
    xs, ys = torch.randn(tasks, rows, d), torch.randn(tasks, rows, d)
    v = {k: torch.randn_like(t) for k, t in params.items()}
    calls = [0]

    def counted(block):
        def f(h):
            calls[0] += 1
            return block(h)
        return f

    def pair(a, b):  # (a region holding two regions: nested, replayed as regions of their own)
        return remat(lambda h: b(a(h)))

    inner = [remat(counted(b)) for b in net.blocks]
    variants = {"no remat": [counted(b) for b in net.blocks], "remat": inner,
                "remat, nested (pairs of block regions in a region)": [pair(inner[i], inner[i + 1]) for i in range(0, depth - 1, 2)]}

    def loss(p, x, y):
        return (functional_call(net, p, (x,)) - y).pow(2).mean()

    def task(p, x, y):
        g = grad(loss)(p, x, y)
        return loss({k: p[k] - 0.1 * g[k] for k in p}, x, y)

    steps = {
        "MAML grad(vmap(grad))": lambda: grad(lambda p: vmap(task, in_dims=(None, 0, 0))(p, xs, ys).mean())(params),
        "per-task HVP vmap(jvp(grad))": lambda: vmap(lambda x, y: jvp(lambda p: grad(loss)(p, x, y), (params,), (v,))[1])(xs, ys),
        "per-task gradients vmap(jacrev)": lambda: vmap(jacrev(loss), in_dims=(None, 0, 0))(params, xs, ys),
        "per-task gradients vmap(grad), parameters requiring grad": lambda: vmap(grad(loss), in_dims=(None, 0, 0))(own, xs, ys),
    }
    out = []
    for sname, step in steps.items():
        rows_: dict = {}
        for vname, blocks in variants.items():
            net.calls = blocks
            step()  # (warm)
            calls[0] = 0
            with LiveBytes() as m:
                step()
            rows_[vname] = {"peak_MiB": m.peak / MiB, "calls": calls[0]}

        def timed(blocks):
            def f():
                net.calls = blocks
                step()
            return f

        t = interleaved({k: timed(b) for k, b in variants.items()}, repeats=3 if quick else 9)
        for vname in variants:
            rows_[vname]["time"] = tuple(spread(t[vname]))
            rows_[vname]["vs_plain"] = tuple(ratio(t[vname], t["no remat"]))
            out.append({"step": sname, "variant": vname, **rows_[vname]})
    return {"model": f"{depth}-block pre-LN MLP (d {d}, hidden {hidden}), {tasks} tasks of {rows} rows, each block a region",
            "rows": out}


def md(r: dict) -> str:
    head = ["step", "variant", "peak live MiB", "blocks' Python calls", "time ms, median (min-max)", "vs no remat"]
    body = [[x["step"], x["variant"], f"{x['peak_MiB']:.1f}", x["calls"],
             "{:.1f} ({:.1f}-{:.1f})".format(*(s * 1e3 for s in x["time"])),
             "{:.2f}x ({:.2f}-{:.2f})".format(*x["vs_plain"])] for x in r["rows"]]
    return f"{r['model']}.\n\n" + table(head, body)


SECTIONS = {"above_vmap": (run, md, "Levels above a vmap (MAML, per-task HVPs): the forward's torch calls replayed")}
CHILDREN: dict = {}
