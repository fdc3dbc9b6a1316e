"""Benchmark suite: ``python -m remat_fn.bench [--quick] [--out DIR] [--only SECTIONS]``.

Sections (all measured in one run, candidates interleaved, medians reported):

``overhead``
    Per-call cost of a tiny function ((x*2).sin() on 16 floats, forward +
    backward): plain, ``torch.utils.checkpoint`` (both variants),
    ``remat_fn.compat.checkpoint`` and ``remat_fn.remat``.
``step``
    A full-remat training step of a 6-block pre-LN MLP stack against its
    physical limit, the plain step plus one extra forward with grad enabled
    (eager and under ``torch.func.grad``), and against ``torch.utils.checkpoint``.
``policies``
    One training step of the demo GPT (:mod:`remat_fn.demo`) with no remat,
    ``torch.utils.checkpoint``, torch SAC (``create_selective_checkpoint_contexts``
    saving matmuls), and ``remat`` with every policy :mod:`remat_fn.policies`
    provides: LiveBytes peak / after-forward and step time, under
    ``torch.func.grad_and_value`` and in eager autograd.
``func``
    Peak live bytes of ``torch.func.grad`` and ``vmap(grad)`` (per-sample
    gradients) with and without ``remat``; torch's checkpoint cannot run there.
``rss``
    Peak resident set size of a fresh process per configuration (``VmHWM``,
    or ``resource.getrusage`` where there is no ``/proc``, in a subprocess),
    minus a baseline process that builds the same model and batch but takes
    no full-size step.
``random``
    Throughput of :mod:`remat_fn.random` against torch's global-RNG samplers.

Results go to ``--out`` as ``results.json``, ``results.md`` (the printed
tables) and PNG plots (when matplotlib is installed).  Nothing is asserted:
timings on a shared machine are noisy, and the ratios are what to read.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import remat_fn
from remat_fn import demo
from remat_fn import random as rnd
from remat_fn.memory import LiveBytes, MiB

__all__ = ["main", "interleaved", "machine_info"]

SECTIONS = ("overhead", "step", "policies", "func", "rss", "random")


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, inner: int = 1,
                warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each candidate; candidates alternate within every
    repeat so that background load hits them alike."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(max(1, warmup)):
            fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[k].append((time.perf_counter() - t0) / inner)
    return {k: statistics.median(v) for k, v in samples.items()}


def machine_info() -> dict:
    try:
        import optree

        optree_v = optree.__version__
    except Exception:  # pragma: no cover
        optree_v = None
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"python": platform.python_version(), "torch": torch.__version__, "optree": optree_v,
            "remat_fn": remat_fn.__version__, "platform": platform.platform(),
            "machine": platform.machine(), "cpu": cpu, "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _fmt_time(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


class _Progress:
    """tqdm over the sections if installed, else one line per section."""

    def __init__(self, names: list[str]):
        try:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=len(names), desc="bench", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            self.bar = None

    def start(self, name: str) -> None:
        if self.bar is not None:
            self.bar.set_description(f"bench: {name}")
        else:
            print(f"[bench] {name} ...", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------
# 1. Per-call overhead
# ---------------------------------------------------------------------------


def bench_overhead(quick: bool) -> dict:
    from torch.utils.checkpoint import checkpoint as torch_ckpt

    from remat_fn.compat import checkpoint as compat_ckpt

    def f(x):
        return (x * 2).sin()

    rf = remat_fn.remat(f)
    x = torch.randn(16, requires_grad=True)
    fns = {
        "plain": lambda: f(x).sum().backward(),
        "torch.utils.checkpoint (use_reentrant=False)":
            lambda: torch_ckpt(f, x, use_reentrant=False).sum().backward(),
        "torch.utils.checkpoint (use_reentrant=True)":
            lambda: torch_ckpt(f, x, use_reentrant=True).sum().backward(),
        "remat_fn.compat.checkpoint": lambda: compat_ckpt(f, x).sum().backward(),
        "remat_fn.remat": lambda: rf(x).sum().backward(),
    }
    t = interleaved(fns, repeats=5 if quick else 15, inner=200 if quick else 1000, warmup=50)
    base = t["plain"]
    rows = {k: {"us": v * 1e6, "overhead_us": (v - base) * 1e6} for k, v in t.items()}
    tc = rows["torch.utils.checkpoint (use_reentrant=False)"]["overhead_us"]
    return {"rows": rows,
            "remat_overhead_over_torch_checkpoint_overhead": rows["remat_fn.remat"]["overhead_us"] / tc}


def md_overhead(r: dict) -> str:
    lines = ["| variant | time per call (us) | overhead vs plain (us) |", "|---|---:|---:|"]
    for k, v in r["rows"].items():
        lines.append(f"| {k} | {v['us']:.1f} | {v['overhead_us']:.1f} |")
    lines.append("")
    lines.append(f"remat_fn.remat overhead / torch.utils.checkpoint(use_reentrant=False) overhead = "
                 f"**{r['remat_overhead_over_torch_checkpoint_overhead']:.2f}x**")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# 2. Full-remat step against the one-extra-forward limit
# ---------------------------------------------------------------------------


class MLPBlock(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(x))))


class MLPStack(nn.Module):
    """``mode``: ``"plain"``, ``"torch"`` (torch.utils.checkpoint) or ``"remat"``."""

    def __init__(self, d: int, hidden: int, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(d, hidden) for _ in range(depth))
        self.rblocks = [remat_fn.remat(b) for b in self.blocks]
        self.mode = "plain"

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint as torch_ckpt

        for b, rb in zip(self.blocks, self.rblocks):
            if self.mode == "plain":
                x = b(x)
            elif self.mode == "torch":
                x = torch_ckpt(b, x, use_reentrant=False)
            else:
                x = rb(x)
        return x.pow(2).mean()


def bench_step(quick: bool) -> dict:
    d, hidden, tokens, depth = (128, 512, 256, 6) if quick else (256, 1024, 1024, 6)
    torch.manual_seed(0)
    net = MLPStack(d, hidden, depth)
    params = {k: v.detach() for k, v in net.named_parameters()}
    x = torch.randn(tokens, d)

    def eager(mode):
        def run():
            net.mode = mode
            net.zero_grad(set_to_none=True)
            net(x).backward()
        return run

    def forward_only():
        net.mode = "plain"
        net(x)

    def func(mode):
        g = grad(lambda p: functional_call(net, p, (x,)))

        def run():
            net.mode = mode
            g(params)
        return run

    fns = {
        "eager plain step": eager("plain"),
        "forward only (grad enabled)": forward_only,
        "eager torch.utils.checkpoint step": eager("torch"),
        "eager remat step": eager("remat"),
        "torch.func.grad plain step": func("plain"),
        "torch.func.grad remat step": func("remat"),
    }
    t = interleaved(fns, repeats=5 if quick else 15)
    limit = t["eager plain step"] + t["forward only (grad enabled)"]
    func_limit = t["torch.func.grad plain step"] + t["forward only (grad enabled)"]
    ratios = {
        "eager remat / one-extra-forward limit": t["eager remat step"] / limit,
        "eager torch.utils.checkpoint / one-extra-forward limit": t["eager torch.utils.checkpoint step"] / limit,
        "eager remat / torch.utils.checkpoint": t["eager remat step"] / t["eager torch.utils.checkpoint step"],
        "eager remat / plain": t["eager remat step"] / t["eager plain step"],
        "torch.func.grad remat / one-extra-forward limit": t["torch.func.grad remat step"] / func_limit,
        "torch.func.grad remat / plain": t["torch.func.grad remat step"] / t["torch.func.grad plain step"],
    }
    ms = {k: v * 1e3 for k, v in t.items()}
    ms["eager limit (plain + forward)"] = limit * 1e3
    ms["torch.func.grad limit (plain + forward)"] = func_limit * 1e3
    return {"model": f"{depth}-block pre-LN MLP, {tokens}x{d} activations, hidden {hidden}",
            "ms": ms, "ratios": ratios}


def md_step(r: dict) -> str:
    lines = [f"Model: {r['model']}.", "", "| measurement | ms |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in r["ms"].items()]
    lines += ["", "| ratio | value |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in r["ratios"].items()]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# 3. Policies against torch.utils.checkpoint and torch SAC on the demo GPT
# ---------------------------------------------------------------------------


def _sac_save_matmuls():
    from torch.utils.checkpoint import CheckpointPolicy

    ops = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def policy_variants() -> list[tuple[str, str, object]]:
    """The demo's variants plus torch SAC saving matmuls (the analogue of dots_saveable)."""
    rows = demo.variants()
    rows.insert(2, ("torch SAC (save mm/addmm/bmm)", "torch_sac", _sac_save_matmuls()))
    return rows


def _bench_config(size: str, batch: int | None) -> demo.Config:
    from dataclasses import replace

    cfg = demo.SIZES[size]
    return replace(cfg, batch=batch) if batch else cfg


def bench_policies(quick: bool) -> dict:
    cfg = _bench_config("tiny" if quick else "small", None)
    torch.manual_seed(0)
    model = demo.GPT(cfg)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    results = demo.measure(model, params, cfg, 0, policy_variants(), repeats=3 if quick else 9)
    return {"model": f"GPT {cfg.layers} layers, d_model {cfg.d_model}, batch {cfg.batch}x{cfg.seq_len} tokens",
            "results": results}


# ---------------------------------------------------------------------------
# 4. torch.func.grad and vmap(grad) memory
# ---------------------------------------------------------------------------


def bench_func(quick: bool) -> dict:
    d, hidden, depth = (128, 512, 6) if quick else (256, 1024, 8)
    batch, tokens = (8, 64) if quick else (16, 128)
    torch.manual_seed(0)
    net = MLPStack(d, hidden, depth)
    params = {k: v.detach() for k, v in net.named_parameters()}
    x = torch.randn(batch, tokens, d)

    def loss(p, xb):
        return functional_call(net, p, (xb,))

    cases = {
        "torch.func.grad": lambda: grad(loss)(params, x),
        "vmap(grad) per-sample gradients": lambda: vmap(grad(loss), in_dims=(None, 0))(params, x),
    }
    rows = []
    for name, fn in cases.items():
        row = {"transform": name}
        for mode, label in (("plain", "no remat"), ("torch", "torch.utils.checkpoint"), ("remat", "remat")):
            net.mode = mode
            try:
                with LiveBytes() as m:
                    out = fn()
                    del out
                row[label] = m.peak / MiB
            except Exception as e:
                row[label] = "fails" if "saved tensor hooks" in str(e) else f"error: {type(e).__name__}"
        t = interleaved({mode: (lambda mode=mode: (setattr(net, "mode", mode), fn())) for mode in ("plain", "remat")},
                        repeats=3 if quick else 7)
        row["no remat ms"], row["remat ms"] = t["plain"] * 1e3, t["remat"] * 1e3
        rows.append(row)
    net.mode = "plain"
    return {"model": f"{depth}-block pre-LN MLP (d {d}, hidden {hidden}), input {batch}x{tokens}x{d}",
            "rows": rows}


def md_func(r: dict) -> str:
    lines = [f"Model: {r['model']}. Peak live bytes (LiveBytes, MiB) of one gradient computation.", "",
             "| transform | no remat (MiB) | torch.utils.checkpoint | remat (MiB) | remat / no remat "
             "| no remat (ms) | remat (ms) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        a, b, c = row["no remat"], row["torch.utils.checkpoint"], row["remat"]
        fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else v  # noqa: E731
        ratio = f"{c / a:.2f}" if isinstance(a, float) and isinstance(c, float) else "-"
        lines.append(f"| {row['transform']} | {fmt(a)} | {fmt(b)} | {fmt(c)} | {ratio} "
                     f"| {row['no remat ms']:.1f} | {row['remat ms']:.1f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# 5. Peak RSS of a fresh process per configuration
# ---------------------------------------------------------------------------

RSS_BATCH = {True: 128, False: 384}


def _rss_child(spec: str) -> None:
    """Run in a subprocess: build the model, take steps, print the peak RSS.

    Lazy imports and first-call set-up (``torch.utils.checkpoint`` imports
    ``torch._dynamo`` on first use) would count as activation memory, so every
    process first runs its variant on a 2-example batch; the baseline process
    runs every variant that way and takes no full-size step.
    """
    from dataclasses import replace

    import torch._dynamo  # noqa: F401  (imported by torch.utils.checkpoint's first call: load it everywhere)

    size, batch, mode, label = spec.split("|", 3)
    torch.set_num_threads(1)
    cfg = _bench_config(size, int(batch))
    torch.manual_seed(0)
    model = demo.GPT(cfg)
    inputs, targets, mask = demo.make_batch(rnd.key(1), cfg)
    small = demo.make_batch(rnd.key(1), replace(cfg, batch=2))
    k_drop = rnd.key(2)
    variants = {lab: (kind, pol) for lab, kind, pol in policy_variants()}

    def run(kind, pol, mode, batch, steps):
        model.set_variant(kind, pol)
        if mode == "func":
            params = {k: v.detach() for k, v in model.named_parameters()}
            step = torch.func.grad(demo.make_loss_fn(model))
            for _ in range(steps):
                g = step(params, *batch, k_drop)
                del g
        else:
            for _ in range(steps):
                model.zero_grad(set_to_none=True)
                demo.masked_loss(model(batch[0], k_drop), batch[1], batch[2]).backward()

    err = None
    warm = list(variants.items()) if label == "baseline" else [(label, variants[label])]
    for _, (kind, pol) in warm:
        for m in (("eager", "func") if label == "baseline" else (mode,)):
            try:
                run(kind, pol, m, small, 1)
            except Exception:
                pass
    if label != "baseline":
        try:
            run(*variants[label], mode, (inputs, targets, mask), 2)
        except Exception as e:
            err = "fails" if "saved tensor hooks" in str(e) else f"{type(e).__name__}: {str(e)[:80]}"
    print(json.dumps({"maxrss_MiB": _peak_rss_mib(), "error": err,
                      "ru_maxrss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def _peak_rss_mib() -> float:
    """This process's peak resident set size.

    Linux keeps ``getrusage``'s ``ru_maxrss`` across fork + exec, so a child
    started from a large parent reports the parent's peak; ``VmHWM`` in
    ``/proc/self/status`` belongs to the new address space and does not.
    Elsewhere ``ru_maxrss`` is used (KiB on Linux, bytes on macOS).
    """
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / (1 << 20) if sys.platform == "darwin" else r / 1024


def bench_rss(quick: bool) -> dict:
    size, batch = "small", RSS_BATCH[quick]
    labels = [lab for lab, _, _ in policy_variants()]
    if quick:
        labels = ["no remat", "torch.utils.checkpoint", "remat nothing_saveable (default)"]
    configs = [("eager", "baseline")] + [(m, lab) for m in ("eager", "func") for lab in labels]
    # large blocks through mmap, returned to the OS when freed: RSS then follows live memory
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    rows = []
    for mode, label in configs:
        spec = f"{size}|{batch}|{mode}|{label}"
        proc = subprocess.run([sys.executable, "-m", "remat_fn.bench", "--_rss-child", spec],
                              capture_output=True, text=True, env=env, timeout=600)
        try:
            res = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            res = {"maxrss_MiB": float("nan"), "error": f"child failed: {proc.stderr.strip()[-200:]}"}
        rows.append({"mode": mode, "variant": label, **res})
    base = rows[0]["maxrss_MiB"]
    for r in rows:
        r["over_baseline_MiB"] = r["maxrss_MiB"] - base
    cfg = _bench_config(size, batch)
    return {"model": f"GPT {cfg.layers} layers, d_model {cfg.d_model}, batch {cfg.batch}x{cfg.seq_len} "
                     "tokens, 2 training steps, 1 thread",
            "rows": rows}


def md_rss(r: dict) -> str:
    lines = [f"Model: {r['model']}. Peak RSS (`VmHWM`) of a fresh process per row; the baseline "
             "process imports the same modules, builds the model and batch and runs every variant on a "
             "2-example batch, but takes no full-size step.", "",
             "| mode | variant | peak RSS (MiB) | above baseline (MiB) |", "|---|---|---:|---:|"]
    for row in r["rows"]:
        if row.get("error"):
            extra = "fails under torch.func" if row["error"] == "fails" else row["error"]
            lines.append(f"| {row['mode']} | {row['variant']} | {extra} | |")
        else:
            lines.append(f"| {row['mode']} | {row['variant']} | {row['maxrss_MiB']:.0f} "
                         f"| {row['over_baseline_MiB']:.0f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# 6. RNG throughput (the core of benchmarks/bench_random.py)
# ---------------------------------------------------------------------------


def bench_random(quick: bool) -> dict:
    reps = 5 if quick else 15
    n = (1 if quick else 4) * 1024 * 1024
    x = torch.randn(n)
    k = rnd.key(0)
    keys = iter(rnd.split(k, 20_000))
    rows = []

    def add(what, ours, base, base_name, inner=1):
        t = interleaved({"ours": ours, "base": base}, repeats=reps, inner=inner, warmup=2)
        rows.append({"benchmark": what, "remat_fn.random_s": t["ours"], "baseline_s": t["base"],
                     "baseline": base_name, "speedup": t["base"] / t["ours"]})

    m = f"{n // (1024 * 1024)}M"
    add(f"dropout fwd, {m} fp32, p=0.1", lambda: rnd.dropout(next(keys), x, 0.1),
        lambda: F.dropout(x, 0.1, True), "F.dropout")
    add(f"uniform, {m} fp32", lambda: rnd.uniform(next(keys), (n,)), lambda: torch.rand(n), "torch.rand")
    add(f"normal, {m} fp32", lambda: rnd.normal(next(keys), (n,)), lambda: torch.randn(n), "torch.randn")

    def gen_seed():
        g = torch.Generator()
        g.manual_seed(1234)

    inner = 200 if quick else 1000
    add("split(key)", lambda: rnd.split(k), gen_seed, "Generator()+manual_seed", inner=inner)
    add("fold_in(key, 7)", lambda: rnd.fold_in(k, 7), gen_seed, "Generator()+manual_seed", inner=inner)
    b, d = 64, 4096
    xb = torch.randn(b, d)
    kb = rnd.split(k, b)
    vm = vmap(lambda kk, xx: rnd.dropout(kk, xx, 0.1))
    add(f"vmap dropout over {b} keys, ({b},{d})", lambda: vm(kb, xb),
        lambda: torch.stack([rnd.dropout(kb[i], xb[i], 0.1) for i in range(b)]), "python loop over keys",
        inner=3)
    return {"rows": rows}


def md_random(r: dict) -> str:
    lines = ["| benchmark | remat_fn.random | baseline | baseline is | speed-up |", "|---|---:|---:|---|---:|"]
    for row in r["rows"]:
        lines.append(f"| {row['benchmark']} | {_fmt_time(row['remat_fn.random_s'])} | "
                     f"{_fmt_time(row['baseline_s'])} | {row['baseline']} | {row['speedup']:.2f}x |")
    lines.append("")
    lines.append("speed-up = baseline time / remat_fn time (> 1: remat_fn.random is faster).")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _barh(plt, labels, values, xlabel, title, path, color="tab:blue"):
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(labels) + 1.4))
    ax.barh(range(len(labels)), values, color=color)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.1f}", va="center", fontsize=7)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(res: dict, out: str) -> list[str]:
    plt = _plt()
    if plt is None:
        return []
    paths = []
    if "overhead" in res:
        p = os.path.join(out, "overhead.png")
        rows = res["overhead"]["rows"]
        _barh(plt, list(rows), [v["us"] for v in rows.values()], "time per call, forward + backward (us)",
              "Per-call cost, (x*2).sin() on 16 floats", p)
        paths.append(p)
    if "step" in res:
        p = os.path.join(out, "step.png")
        ms = res["step"]["ms"]
        _barh(plt, list(ms), list(ms.values()), "ms per step (median)",
              f"Training step: {res['step']['model']}", p, color="tab:green")
        paths.append(p)
    if "policies" in res:
        p = os.path.join(out, "policies.png")
        demo.plot(res["policies"]["results"], p,
                  f"{res['policies']['model']}: peak activation memory vs step time")
        paths.append(p)
    if "func" in res:
        p = os.path.join(out, "func_memory.png")
        rows = res["func"]["rows"]
        fig, ax = plt.subplots(figsize=(7, 3.8))
        w = 0.38
        for j, (label, color) in enumerate((("no remat", "tab:gray"), ("remat", "tab:blue"))):
            vals = [r[label] if isinstance(r[label], float) else 0.0 for r in rows]
            ax.bar([i + (j - 0.5) * w for i in range(len(rows))], vals, w, label=label, color=color)
            for i, v in enumerate(vals):
                ax.text(i + (j - 0.5) * w, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rows)), [r["transform"] for r in rows], fontsize=8)
        ax.set_ylabel("peak live bytes (MiB)")
        ax.set_title("torch.func memory (torch.utils.checkpoint fails here)", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    if "rss" in res:
        rows = [r for r in res["rss"]["rows"] if not r.get("error") and r["variant"] != "baseline"]
        if rows:
            p = os.path.join(out, "rss.png")
            _barh(plt, [f"{r['mode']}: {r['variant']}" for r in rows], [r["over_baseline_MiB"] for r in rows],
                  "peak RSS above the baseline process (MiB)", f"Fresh-process peak RSS: {res['rss']['model']}",
                  p, color="tab:purple")
            paths.append(p)
    return paths


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------

_RUNNERS = {"overhead": (bench_overhead, md_overhead, "Per-call overhead"),
            "step": (bench_step, md_step, "Full-remat training step vs the one-extra-forward limit"),
            "policies": (bench_policies, None, "Policies vs torch.utils.checkpoint and torch SAC"),
            "func": (bench_func, md_func, "torch.func.grad and vmap(grad) memory"),
            "rss": (bench_rss, md_rss, "Peak RSS of a fresh process"),
            "random": (bench_random, md_random, "remat_fn.random throughput")}


def render(res: dict) -> str:
    info = res["info"]
    parts = [f"# remat_fn benchmarks{' (--quick)' if res.get('quick') else ''}", "",
             f"torch {info['torch']}, python {info['python']}, optree {info['optree']}, "
             f"remat_fn {info['remat_fn']}; {info['cpu']} ({info['cpus']} CPUs, "
             f"{info['torch_threads']} torch threads); {info['platform']}; {info['date']}.",
             "Times are medians of interleaved repeats on a shared machine: read the ratios."]
    for name in SECTIONS:
        if name not in res:
            continue
        fn, md, title = _RUNNERS[name]
        parts += ["", f"## {title}", ""]
        if name == "policies":
            parts += [f"Model: {res[name]['model']}. One training step; memory from LiveBytes.", "",
                      demo.format_table(res[name]["results"])]
        else:
            parts.append(md(res[name]))
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m remat_fn.bench", description=__doc__.split("\n\n")[0],
                                 epilog="Sections: " + ", ".join(SECTIONS))
    ap.add_argument("--quick", action="store_true", help="small models, few repeats (CI smoke run, < 60 s)")
    ap.add_argument("--out", default="bench_out", help="output folder (default ./bench_out)")
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help="comma-separated sections to run (default: all)")
    ap.add_argument("--no-plot", action="store_true", help="do not write PNG plots")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--_rss-child", dest="rss_child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rss_child:
        _rss_child(args.rss_child)
        return {}
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        ap.error(f"unknown section(s) {bad}; choose from {', '.join(SECTIONS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    res: dict = {"info": machine_info(), "quick": args.quick}
    t_all = time.perf_counter()
    prog = _Progress(sections)
    for name in sections:
        prog.start(name)
        t0 = time.perf_counter()
        res[name] = _RUNNERS[name][0](args.quick)
        res[name]["seconds"] = time.perf_counter() - t0
        prog.done()
    prog.close()
    res["seconds"] = time.perf_counter() - t_all
    text = render(res)
    print(text)
    with open(os.path.join(args.out, "results.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(res, fh, indent=2, default=str)
    plots = [] if args.no_plot else write_plots(res, args.out)
    print(f"wrote {args.out}/results.json, {args.out}/results.md"
          + "".join(f", {p}" for p in plots) + f"  ({res['seconds']:.0f} s)")
    return res


if __name__ == "__main__":
    main()
