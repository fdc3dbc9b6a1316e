"""``budget``: a real training step, HF GPT-2, every way of checkpointing it.

GPT-2 from a config (``n_layer=6, n_embd=256, n_head=8, n_positions=256``),
batch 4 x 256 tokens, AdamW, one thread, ``use_cache=False``.

Memory: each variant runs in a fresh process (build model and optimizer, take
``steps`` steps) that reports its peak RSS (``VmHWM``) and the LiveBytes peak
of the same steps; a baseline process builds the same model and optimizer
state (AdamW's moments made by a step on zero gradients) and runs no forward;
"RSS above baseline" subtracts its ``VmHWM``.

Time: all variants in one process, one step of each per round, rounds
interleaved; ratios are per round, median (min-max).  The physical limit of
full recomputation is one extra forward: (2F + B) / (F + B), with F the
forward (grad enabled) and B = step - F measured in the same rounds.

Variants, eager (``loss.backward()``): no checkpointing; torch's checkpoint
(``gradient_checkpointing_enable``-style, ``use_reentrant=False``);
``remat_fn.compat.checkpoint`` in its place; ``remat`` with ``dots_saveable``;
``memory_budget(0.5)`` wrapped once (``block.forward = remat(...)``) and built
per call (the form ``compat`` and Hugging Face's plug-in use).  Functional:
``torch.func.functional_call`` + ``grad_and_value`` without and with ``remat``
on every block.
"""

from __future__ import annotations

import functools

import torch

from .harness import MiB, Spread, child_report, fresh_process, interleaved, ratio, spread, table
from .models import gpt2

EAGER = ["none", "torch", "compat", "dots", "budget_once", "budget_per_call"]
FUNCTIONAL = ["func_none", "func_remat"]
LABELS = {
    "none": "eager, no checkpointing",
    "torch": "eager, torch.utils.checkpoint",
    "compat": "eager, remat_fn.compat.checkpoint",
    "dots": "eager, remat dots_saveable per block",
    "budget_once": "eager, memory_budget(0.5), remat built once",
    "budget_per_call": "eager, memory_budget(0.5), remat built per call",
    "func_none": "functional_call + grad_and_value, no remat",
    "func_remat": "functional_call + grad_and_value, remat per block",
}


class _Setup:
    """One model, its optimizer and batch, switchable between the variants."""

    def __init__(self):
        import remat_fn
        import remat_fn.compat

        torch.manual_seed(0)
        self.model = model = gpt2()
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.ids = torch.randint(0, 512, (4, 256))
        self.blocks = list(model.transformer.h)
        self.forwards = [b.forward for b in self.blocks]
        P = remat_fn.policies
        budget = P.memory_budget(0.5)

        def per_call(function, *args, **kwargs):
            return remat_fn.remat(function, policy=budget)(*args, **kwargs)

        tc = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        self.ckpt_funcs = {"torch": tc, "compat": functools.partial(remat_fn.compat.checkpoint, use_reentrant=False),
                           "budget_per_call": per_call}
        self.wrapped = {"dots": [remat_fn.remat(f, policy=P.dots_saveable) for f in self.forwards],
                        "budget_once": [remat_fn.remat(f, policy=budget) for f in self.forwards],
                        "func_remat": [remat_fn.remat(f) for f in self.forwards]}
        self.params = {k: v.detach() for k, v in model.named_parameters()}

    def use(self, variant: str) -> None:
        model = self.model
        fn = self.ckpt_funcs.get(variant)
        if fn is not None:
            model._set_gradient_checkpointing(True, gradient_checkpointing_func=fn)
        else:
            model._set_gradient_checkpointing(False)
        fwds = self.wrapped.get(variant, self.forwards)
        for b, f in zip(self.blocks, fwds):
            b.forward = f

    def loss(self):
        return self.model(input_ids=self.ids, labels=self.ids, use_cache=False).loss

    def step(self, variant: str) -> None:
        self.use(variant)
        if variant.startswith("func"):
            def loss(p):
                return torch.func.functional_call(self.model, p, (), {
                    "input_ids": self.ids, "labels": self.ids, "use_cache": False}).loss
            torch.func.grad_and_value(loss)(self.params)
            return
        self.opt.zero_grad(set_to_none=True)
        self.loss().backward()
        self.opt.step()

    def forward_only(self) -> None:
        self.use("none")
        self.loss()


def child(variant: str) -> None:
    """In a fresh process: ``steps`` steps of one variant (or the baseline)."""
    from remat_fn import _budget
    from remat_fn.memory import LiveBytes

    torch.set_num_threads(1)
    name, steps, allocator = variant.split("|")
    if allocator == "mmap":
        from remat_fn.memory import return_freed_memory_to_os

        return_freed_memory_to_os()
    st = _Setup()
    if name == "baseline":  # model and optimizer state, no activations ever
        for p in st.model.parameters():
            p.grad = torch.zeros_like(p)
        st.opt.step()
        child_report(live_MiB=0.0, plans=0)
        return
    with LiveBytes() as meter:
        for _ in range(int(steps)):
            st.step(name)
    child_report(live_MiB=meter.peak / MiB, plans=_budget.stats.get("measured", 0))


def run(quick: bool) -> dict:
    steps = 2 if quick else 4
    processes = 1 if quick else 3
    names = ["baseline", *EAGER, *FUNCTIONAL]
    mem: dict[str, list[dict]] = {v: [] for v in names}
    mmap: dict[str, list[dict]] = {v: [] for v in names}
    for i in range(processes):  # interleaved
        for v in names:
            mem[v].append(fresh_process("budget", f"{v}|{steps}|default"))
            if i < max(1, processes - 1):
                mmap[v].append(fresh_process("budget", f"{v}|{steps}|mmap"))
    base = spread([r["rss_MiB"] for r in mem["baseline"]]).median
    mbase = spread([r["rss_MiB"] for r in mmap["baseline"]]).median
    torch.set_num_threads(1)
    st = _Setup()
    fns = {v: functools.partial(st.step, v) for v in [*EAGER, *FUNCTIONAL]}
    fns["forward"] = st.forward_only
    s = interleaved(fns, repeats=3 if quick else 9)
    F = s["forward"]
    limit = [(2 * f + (n - f)) / n for f, n in zip(F, s["none"])]  # (2F+B)/(F+B), B = step - F
    rows = {}
    for v in [*EAGER, *FUNCTIONAL]:
        if mem[v][0].get("error"):
            rows[v] = {"error": mem[v][0]["error"]}
            continue
        ref = "func_none" if v.startswith("func") else "none"
        rows[v] = {
            "rss_above_baseline_MiB": spread([r["rss_MiB"] - base for r in mem[v]]).median,
            "rss_mmap_above_baseline_MiB": spread([r["rss_MiB"] - mbase for r in mmap[v]]).median,
            "live_MiB": spread([r["live_MiB"] for r in mem[v]]).median,
            "plans": mem[v][0].get("plans", 0),
            "ms": tuple(spread(s[v]).scaled(1e3)),
            "vs_no_remat": tuple(ratio(s[v], s[ref])),
            "vs_torch": tuple(ratio(s[v], s["torch"])) if not v.startswith("func") else None,
        }
    for v, r in rows.items():
        if "rss_above_baseline_MiB" in r:
            ref = rows["func_none" if v.startswith("func") else "none"]
            r["rss_vs_no_remat"] = r["rss_above_baseline_MiB"] / ref["rss_above_baseline_MiB"]
            r["rss_mmap_vs_no_remat"] = r["rss_mmap_above_baseline_MiB"] / ref["rss_mmap_above_baseline_MiB"]
            r["live_vs_no_remat"] = r["live_MiB"] / ref["live_MiB"]
    return {"model": "HF GPT-2 6x256, batch 4x256, AdamW, 1 thread", "steps": steps, "processes": processes,
            "baseline_MiB": base, "baseline_mmap_MiB": mbase, "forward_ms": tuple(spread(F).scaled(1e3)),
            "limit": tuple(Spread.of(limit)), "rows": rows}


def md(r: dict) -> str:
    out = []
    for v, row in r["rows"].items():
        if "error" in row:
            out.append([LABELS[v], row["error"], "", "", "", "", "", ""])
            continue
        out.append([LABELS[v], f"{row['rss_above_baseline_MiB']:.0f} ({row['rss_vs_no_remat']:.2f}x)",
                    f"{row['rss_mmap_above_baseline_MiB']:.0f} ({row['rss_mmap_vs_no_remat']:.2f}x)",
                    f"{row['live_MiB']:.0f} ({row['live_vs_no_remat']:.2f}x)", Spread(*row["ms"]).fmt(digits=0),
                    Spread(*row["vs_no_remat"]).fmt(digits=2),
                    Spread(*row["vs_torch"]).fmt(digits=2) if row["vs_torch"] else "-", row["plans"]])
    return (f"{r['model']}. Memory: {r['steps']} steps in a fresh process per variant (median of "
            f"{r['processes']}), peak RSS (`VmHWM`) minus the baseline process ({r['baseline_MiB']:.0f} MiB), "
            "next to the LiveBytes peak of the same steps; the third column calls "
            "`remat_fn.memory.return_freed_memory_to_os()` first (its own baseline). Time: one step of each variant per round, rounds "
            "interleaved, median (min-max); ratios per round.\n\n"
            + table(["variant", "RSS above baseline (MiB)", "same, return_freed_memory_to_os()",
                     "LiveBytes peak (MiB)", "step (ms)", "time / no remat", "time / torch checkpoint",
                     "planning passes"], out)
            + f"\n\nPhysical limit of full recompute, (2F+B)/(F+B) with F = forward "
            f"{Spread(*r['forward_ms']).fmt(digits=0)} ms: **{Spread(*r['limit']).fmt(digits=2)}**.")


SECTIONS = {"budget": (run, md, "HF GPT-2 training step: memory_budget, compat and torch.func")}
CHILDREN = {"budget": child}
