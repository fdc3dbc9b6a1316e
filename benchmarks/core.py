"""Core sections: per-call overhead, full-remat step, policies, torch.func memory, process RSS.

``overhead``
    Per-call cost of a region, forward + backward, of two regions: a tiny
    function ((x*2).sin() on 16 floats) in eager autograd, and two 64x64
    matmuls + tanh in eager autograd and under ``torch.func.grad``: plain,
    ``torch.utils.checkpoint``, ``remat_fn.compat.checkpoint``, ``remat_fn.remat``
    and, under ``torch.func``, the floor (a bare ``autograd.Function`` whose
    backward recomputes with ``torch.func.vjp``) and remat's design floor (the
    forward under a ``vjp`` level of its own, backward its ``vjp_fn``; nothing
    recorded, replayed or threaded); in eager mode, a dispatch mode that does
    nothing.  Overheads are per-round differences to plain, reported as median
    (min-max).
``step``
    A full-remat training step of a 6-block pre-LN MLP stack against its
    physical limit, the plain step plus one extra forward with grad enabled
    (eager and under ``torch.func.grad``), and against ``torch.utils.checkpoint``.
``policies``
    One training step of the demo GPT under every row of :func:`harness.variants`:
    LiveBytes peak / after-forward and step time, under ``torch.func`` and eager.
``func``
    Peak live bytes of ``torch.func.grad`` and ``vmap(grad)`` (per-sample
    gradients) with and without ``remat``; torch's checkpoint cannot run there.
``rss``
    Peak RSS (``VmHWM``) of a fresh process per variant next to its LiveBytes
    peak, minus a baseline process that builds the same model and batch but
    takes no full-size step.
"""

from __future__ import annotations

import dataclasses
import types

import torch
from torch.func import functional_call, grad, grad_and_value, vmap
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import remat_fn
from remat_fn import random as rnd
from remat_fn.compat import checkpoint as compat_checkpoint
from remat_fn.memory import LiveBytes

from .harness import (
    MiB,
    Spread,
    barh,
    child_report,
    demo_module,
    difference,
    error_text,
    fresh_process,
    interleaved,
    ratio,
    spread,
    table,
    variant,
    variants,
)
from .models import MLPStack, tiny_region

# ---------------------------------------------------------------------------
# overhead
# ---------------------------------------------------------------------------


class _Floor(torch.autograd.Function):
    """The torch.func path's design with nothing else: an autograd.Function whose
    backward recomputes with torch.func.vjp (no captures, checks, RNG or autocast)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(f, x, a, b):
        return f(x, a, b)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.f = inputs[0]
        ctx.save_for_backward(*inputs[1:])

    @staticmethod
    def backward(ctx, g):
        _, fn = torch.func.vjp(ctx.f, *ctx.saved_tensors)
        return (None, *fn(g))


class _ForwardVjp(torch.autograd.Function):
    """remat's torch.func design with nothing else: the forward runs under a vjp level
    of its own and backward calls that level's vjp_fn (no recording, captures, replay;
    it keeps the whole graph, so a time floor only)."""

    @staticmethod
    def forward(box, f, x, a, b):
        with torch.enable_grad():
            out, box.vjp_fn = torch.func.vjp(f, x, a, b)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.box = inputs[0]

    @staticmethod
    def backward(ctx, g):
        return (None, None, *ctx.box.vjp_fn(g))


class _BareMode(TorchDispatchMode):
    """The eager floor of a recorded forward: every op through a Python dispatch mode
    that does nothing else (no tape, no hooks, no replay)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _bare_mode(fn, x):
    with _BareMode():
        y = fn(x)
    y.sum().backward()


def overhead(quick: bool) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _overhead(quick)
    finally:
        torch.set_num_threads(threads)


def _overhead(quick: bool) -> dict:
    inner = 100 if quick else 300
    repeats = 5 if quick else 15

    def small(x):
        return (x * 2).sin()

    rsmall = remat_fn.remat(small)
    xs = torch.randn(16, requires_grad=True)
    f, (x, w1, w2) = tiny_region()
    rf = remat_fn.remat(f)

    def eager(fn):
        a, b, c = (t.clone().requires_grad_() for t in (x, w1, w2))
        fn(a, b, c).sum().backward()

    def func(fn):
        grad(lambda a, b, c: fn(a, b, c).sum(), argnums=(0, 1, 2))(x, w1, w2)

    fns = {
        "tiny eager plain": lambda: small(xs).sum().backward(),
        "tiny eager torch.utils.checkpoint": lambda: torch_checkpoint(small, xs, use_reentrant=False).sum().backward(),
        "tiny eager compat.checkpoint": lambda: compat_checkpoint(small, xs, use_reentrant=False).sum().backward(),
        "tiny eager remat": lambda: rsmall(xs).sum().backward(),
        "tiny eager floor (do-nothing dispatch mode)": lambda: _bare_mode(small, xs),
        "2mm eager plain": lambda: eager(f),
        "2mm eager torch.utils.checkpoint": lambda: eager(lambda *a: torch_checkpoint(f, *a, use_reentrant=False)),
        "2mm eager compat.checkpoint": lambda: eager(lambda *a: compat_checkpoint(f, *a, use_reentrant=False)),
        "2mm eager remat": lambda: eager(rf),
        "2mm torch.func plain": lambda: func(f),
        "2mm torch.func compat.checkpoint": lambda: func(lambda *a: compat_checkpoint(f, *a)),
        "2mm torch.func remat": lambda: func(rf),
        "2mm torch.func floor (bare Function + vjp)": lambda: func(lambda *a: _Floor.apply(f, *a)),
        "2mm torch.func design floor (forward under vjp, backward its vjp_fn)":
            lambda: func(lambda *a: _ForwardVjp.apply(types.SimpleNamespace(), f, *a)),
    }
    s = interleaved(fns, repeats=repeats, inner=inner, warmup=20)
    rows = {k: spread(v).scaled(1e6) for k, v in s.items()}
    over = {}
    for k in s:
        base = f"{k.split(' ')[0]} {'torch.func' if 'torch.func' in k else 'eager'} plain"
        if k != base:
            over[k] = difference(s[k], s[base]).scaled(1e6)
    e, fu = over["2mm eager remat"], over["2mm torch.func remat"]
    res = {"us": {k: tuple(v) for k, v in rows.items()}, "overhead_us": {k: tuple(v) for k, v in over.items()},
           "func_over_eager_overhead": fu.median / e.median,
           "remat_over_torch_overhead_eager": over["tiny eager remat"].median
           / over["tiny eager torch.utils.checkpoint"].median,
           "mode_over_torch_overhead_eager": over["tiny eager floor (do-nothing dispatch mode)"].median
           / over["tiny eager torch.utils.checkpoint"].median,
           "remat_over_floor_overhead_func": fu.median / over["2mm torch.func floor (bare Function + vjp)"].median,
           "design_over_floor_overhead_func":
               over["2mm torch.func design floor (forward under vjp, backward its vjp_fn)"].median
               / over["2mm torch.func floor (bare Function + vjp)"].median}
    return res


def md_overhead(r: dict) -> str:
    rows = []
    for k, v in r["us"].items():
        o = r["overhead_us"].get(k)
        rows.append([k, Spread(*v).fmt(), Spread(*o).fmt() if o else "-"])
    out = table(["variant (forward + backward)", "us per call, median (min-max)", "overhead vs plain (us)"], rows)
    return out + (
        f"\n\nOverhead of a `remat` region under torch.func / in eager (2mm region, medians): "
        f"**{r['func_over_eager_overhead']:.2f}x**; remat / torch.utils.checkpoint overhead (tiny, eager): "
        f"**{r['remat_over_torch_overhead_eager']:.2f}x** (a do-nothing dispatch mode alone: "
        f"{r['mode_over_torch_overhead_eager']:.2f}x); remat / the bare Function floor (2mm, torch.func): "
        f"**{r['remat_over_floor_overhead_func']:.2f}x** (the design floor alone: "
        f"{r['design_over_floor_overhead_func']:.2f}x). Tiny = (x*2).sin() on 16 floats; 2mm = "
        "tanh(x @ w1) @ w2 on 64x64; one thread; rounds interleaved.")


# ---------------------------------------------------------------------------
# step
# ---------------------------------------------------------------------------


def step(quick: bool) -> dict:
    d, hidden, tokens, depth = (128, 512, 256, 6) if quick else (256, 1024, 1024, 6)
    torch.manual_seed(0)
    net = MLPStack(d, hidden, depth)
    params = {k: v.detach() for k, v in net.named_parameters()}
    x = torch.randn(tokens, d)
    wraps = {"plain": variant("no remat"), "torch": variant("torch.utils.checkpoint"),
             "remat": variant("remat nothing_saveable (default)")}
    calls = {k: [w(b) for b in net.blocks] for k, w in wraps.items()}

    def eager(mode):
        def run():
            net.calls = calls[mode]
            net.zero_grad(set_to_none=True)
            net(x).backward()
        return run

    def forward_only():
        net.calls = calls["plain"]
        net(x)

    def func(mode):
        g = grad(lambda p: functional_call(net, p, (x,)))

        def run():
            net.calls = calls[mode]
            g(params)
        return run

    s = interleaved({
        "eager plain": eager("plain"),
        "forward only (grad enabled)": forward_only,
        "eager torch.utils.checkpoint": eager("torch"),
        "eager remat": eager("remat"),
        "torch.func.grad plain": func("plain"),
        "torch.func.grad remat": func("remat"),
    }, repeats=5 if quick else 15)
    limit = [a + b for a, b in zip(s["eager plain"], s["forward only (grad enabled)"])]
    flimit = [a + b for a, b in zip(s["torch.func.grad plain"], s["forward only (grad enabled)"])]
    ratios = {
        "eager remat / one-extra-forward limit": ratio(s["eager remat"], limit),
        "eager torch.utils.checkpoint / one-extra-forward limit": ratio(s["eager torch.utils.checkpoint"], limit),
        "eager remat / torch.utils.checkpoint": ratio(s["eager remat"], s["eager torch.utils.checkpoint"]),
        "eager remat / plain": ratio(s["eager remat"], s["eager plain"]),
        "torch.func.grad remat / one-extra-forward limit": ratio(s["torch.func.grad remat"], flimit),
        "torch.func.grad remat / plain": ratio(s["torch.func.grad remat"], s["torch.func.grad plain"]),
    }
    ms = {k: tuple(spread(v).scaled(1e3)) for k, v in s.items()}
    ms["eager limit (plain + forward)"] = tuple(spread(limit).scaled(1e3))
    ms["torch.func.grad limit (plain + forward)"] = tuple(spread(flimit).scaled(1e3))
    return {"model": f"{depth}-block pre-LN MLP, {tokens}x{d} activations, hidden {hidden}",
            "ms": ms, "ratios": {k: tuple(v) for k, v in ratios.items()}}


def md_step(r: dict) -> str:
    return (f"Model: {r['model']}.\n\n"
            + table(["step", "ms, median (min-max)"], [[k, Spread(*v).fmt(digits=2)] for k, v in r["ms"].items()])
            + "\n\n"
            + table(["ratio (per round)", "median (min-max)"],
                    [[k, Spread(*v).fmt(digits=2)] for k, v in r["ratios"].items()]))


# ---------------------------------------------------------------------------
# policies (demo GPT)
# ---------------------------------------------------------------------------


def _demo_config(size: str, batch: int | None):
    demo = demo_module()
    cfg = demo.SIZES[size]
    return dataclasses.replace(cfg, batch=batch) if batch else cfg


def policies(quick: bool) -> dict:
    demo = demo_module()
    cfg = _demo_config("tiny" if quick else "small", None)
    torch.manual_seed(0)
    model = demo.GPT(cfg)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    results = demo.measure(model, params, cfg, 0, variants(), repeats=3 if quick else 9, log=lambda *_: None,
                           timer=interleaved)
    return {"model": f"GPT {cfg.layers} layers, d_model {cfg.d_model}, batch {cfg.batch}x{cfg.seq_len} tokens",
            "results": results}


def md_policies(r: dict) -> str:
    return (f"Model: {r['model']}. One training step; memory from LiveBytes; step time median (min-max) "
            "of interleaved rounds.\n\n" + demo_module().format_table(r["results"]))


# ---------------------------------------------------------------------------
# func
# ---------------------------------------------------------------------------


def func(quick: bool) -> dict:
    d, hidden, depth = (128, 512, 6) if quick else (256, 1024, 8)
    batch, tokens = (8, 64) if quick else (16, 128)
    torch.manual_seed(0)
    net = MLPStack(d, hidden, depth)
    params = {k: v.detach() for k, v in net.named_parameters()}
    x = torch.randn(batch, tokens, d)
    calls = {m: [variant(label)(b) for b in net.blocks] for m, label in (
        ("none", "no remat"), ("torch", "torch.utils.checkpoint"), ("remat", "remat nothing_saveable (default)"))}

    def loss(p, xb):
        return functional_call(net, p, (xb,))

    cases = {
        "torch.func.grad": lambda: grad(loss)(params, x),
        "vmap(grad) per-sample gradients": lambda: vmap(grad(loss), in_dims=(None, 0))(params, x),
    }
    rows = []
    for name, fn in cases.items():
        row: dict = {"transform": name}
        for mode, label in (("none", "no remat"), ("torch", "torch.utils.checkpoint"), ("remat", "remat")):
            net.calls = calls[mode]
            try:
                with LiveBytes() as m:
                    out = fn()
                    del out
                row[label] = m.peak / MiB
            except Exception as e:
                row[label] = error_text(e)
        s = interleaved({m: (lambda m=m: (setattr(net, "calls", calls[m]), fn())) for m in ("none", "remat")},
                        repeats=3 if quick else 7)
        row["no remat ms"], row["remat ms"] = tuple(spread(s["none"]).scaled(1e3)), tuple(spread(s["remat"]).scaled(1e3))
        rows.append(row)
    return {"model": f"{depth}-block pre-LN MLP (d {d}, hidden {hidden}), input {batch}x{tokens}x{d}", "rows": rows}


def md_func(r: dict) -> str:
    def fmt(v):
        return f"{v:.1f}" if isinstance(v, float) else v

    out = []
    for row in r["rows"]:
        a, b, c = row["no remat"], row["torch.utils.checkpoint"], row["remat"]
        rel = f"{c / a:.2f}" if isinstance(a, float) and isinstance(c, float) else "-"
        out.append([row["transform"], fmt(a), fmt(b), fmt(c), rel, Spread(*row["no remat ms"]).fmt(),
                    Spread(*row["remat ms"]).fmt()])
    return (f"Model: {r['model']}. Peak live bytes (LiveBytes, MiB) of one gradient computation.\n\n"
            + table(["transform", "no remat (MiB)", "torch.utils.checkpoint", "remat (MiB)", "remat / no remat",
                     "no remat (ms)", "remat (ms)"], out))


# ---------------------------------------------------------------------------
# rss (fresh processes, demo GPT)
# ---------------------------------------------------------------------------

RSS_BATCH = {True: 128, False: 384}


def rss_child(spec: str) -> None:
    """In a fresh process: build the demo GPT, take two steps, report peak RSS and LiveBytes.

    Lazy imports and first-call set-up (``torch.utils.checkpoint`` imports
    ``torch._dynamo`` on first use) would count as activation memory, so every
    process first runs its variant on a 2-example batch; the baseline process
    runs every variant that way and takes no full-size step.
    """
    import torch._dynamo  # noqa: F401  (imported by torch.utils.checkpoint's first call: load it everywhere)

    demo = demo_module()
    size, batch, mode, label = spec.split("|", 3)
    torch.set_num_threads(1)
    cfg = _demo_config(size, int(batch))
    torch.manual_seed(0)
    model = demo.GPT(cfg)
    full = demo.make_batch(rnd.key(1), cfg)
    small = demo.make_batch(rnd.key(1), dataclasses.replace(cfg, batch=2))
    k_drop = rnd.key(2)
    table_ = dict(variants())

    def run(wrap, mode, batch, steps):
        model.wrap_blocks(wrap)
        if mode == "func":
            params = {k: v.detach() for k, v in model.named_parameters()}
            step = grad_and_value(demo.make_loss_fn(model))
            for _ in range(steps):
                g = step(params, *batch, k_drop)
                del g
        else:
            for _ in range(steps):
                model.zero_grad(set_to_none=True)
                demo.masked_loss(model(batch[0], k_drop), batch[1], batch[2]).backward()

    warm = list(table_.values()) if label == "baseline" else [table_[label]]
    for wrap in warm:
        for m in (("eager", "func") if label == "baseline" else (mode,)):
            try:
                run(wrap, m, small, 1)
            except Exception:
                pass
    err, live = None, 0
    if label != "baseline":
        try:
            with LiveBytes() as meter:
                run(table_[label], mode, full, 2)
            live = meter.peak
        except Exception as e:
            err = error_text(e)
    child_report(live_MiB=live / MiB, error=err)


def rss(quick: bool) -> dict:
    size, batch = "small", RSS_BATCH[quick]
    labels = [lab for lab, _ in variants()]
    if quick:
        labels = ["no remat", "torch.utils.checkpoint", "remat nothing_saveable (default)"]
    configs = [("eager", "baseline")] + [(m, lab) for m in ("eager", "func") for lab in labels]
    rows = []
    for mode, label in configs:
        res = fresh_process("rss", f"{size}|{batch}|{mode}|{label}")
        rows.append({"mode": mode, "variant": label, **res})
    base = rows[0].get("rss_MiB", float("nan"))
    for r in rows:
        r["over_baseline_MiB"] = r.get("rss_MiB", float("nan")) - base
    cfg = _demo_config(size, batch)
    return {"model": f"GPT {cfg.layers} layers, d_model {cfg.d_model}, batch {cfg.batch}x{cfg.seq_len} "
                     "tokens, 2 training steps, 1 thread", "rows": rows}


def md_rss(r: dict) -> str:
    out = []
    for row in r["rows"][1:]:
        if row.get("error"):
            out.append([row["mode"], row["variant"], row["error"], "", ""])
        else:
            out.append([row["mode"], row["variant"], f"{row['rss_MiB']:.0f}", f"{row['over_baseline_MiB']:.0f}",
                        f"{row['live_MiB']:.0f}"])
    return (f"Model: {r['model']}. Peak RSS (`VmHWM`) of a fresh process per row; the baseline process "
            f"({r['rows'][0].get('rss_MiB', float('nan')):.0f} MiB) imports the same modules, builds the model "
            "and batch and runs every variant on a 2-example batch, but takes no full-size step. LiveBytes: "
            "peak live tensor bytes over the two steps in the same process.\n\n"
            + table(["mode", "variant", "peak RSS (MiB)", "above baseline (MiB)", "LiveBytes peak (MiB)"], out,
                    "|---|---|---:|---:|---:|"))


def plots(res: dict, out: str) -> list[str]:
    import os

    paths = []
    if "overhead" in res:
        p = os.path.join(out, "overhead.png")
        us = res["overhead"]["us"]
        if barh(list(us), [v[0] for v in us.values()], [(v[1], v[2]) for v in us.values()],
                "us per call, forward + backward (median, whiskers min-max)", "Per-call cost of a region", p):
            paths.append(p)
    if "step" in res:
        p = os.path.join(out, "step.png")
        ms = res["step"]["ms"]
        if barh(list(ms), [v[0] for v in ms.values()], [(v[1], v[2]) for v in ms.values()],
                "ms per step (median, whiskers min-max)", f"Training step: {res['step']['model']}", p,
                color="tab:green"):
            paths.append(p)
    if "policies" in res:
        p = os.path.join(out, "policies.png")
        if demo_module().plot(res["policies"]["results"], p,
                              f"{res['policies']['model']}: peak activation memory vs step time"):
            paths.append(p)
    if "func" in res:
        labels, values = [], []
        for row in res["func"]["rows"]:
            for label in ("no remat", "remat"):
                if isinstance(row[label], float):
                    labels.append(f"{row['transform']}: {label}")
                    values.append(row[label])
        p = os.path.join(out, "func_memory.png")
        if labels and barh(labels, values, None, "peak live bytes (MiB)",
                           "torch.func memory (torch.utils.checkpoint fails here)", p, color="tab:orange"):
            paths.append(p)
    if "rss" in res:
        rows = [r for r in res["rss"]["rows"][1:] if not r.get("error")]
        p = os.path.join(out, "rss.png")
        if rows and barh([f"{r['mode']}: {r['variant']}" for r in rows], [r["over_baseline_MiB"] for r in rows],
                         None, "peak RSS above the baseline process (MiB)",
                         f"Fresh-process peak RSS: {res['rss']['model']}", p, color="tab:purple"):
            paths.append(p)
    return paths


SECTIONS = {
    "overhead": (overhead, md_overhead, "Per-call overhead of a region"),
    "step": (step, md_step, "Full-remat training step vs the one-extra-forward limit"),
    "policies": (policies, md_policies, "Policies vs torch.utils.checkpoint and torch SAC (demo GPT)"),
    "func": (func, md_func, "torch.func.grad and vmap(grad) memory"),
    "rss": (rss, md_rss, "Peak RSS of a fresh process (demo GPT)"),
}
CHILDREN = {"rss": rss_child}
