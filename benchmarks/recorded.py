"""``gpt2``: a Hugging Face GPT-2 training step, full remat and ``dots_saveable``.

GPT-2 from a config (``n_layer=6, n_embd=256, n_head=8``), batch 4 x 256
tokens (``--quick``: 2 x 128), one thread, ``use_cache=False``, SGD-free (the
step is forward + ``loss.backward()``).  Every block is wrapped the same way:
torch's checkpoint through Hugging Face's ``gradient_checkpointing_enable``
hook (``use_reentrant=False``), or ``block.forward = remat(block.forward,
policy=...)``.

Time: one step of each variant per round, rounds interleaved, median
(min-max); ratios per round.  The physical limit of full recomputation is
one extra forward per step: (2F + B) / (F + B), F the forward (grad enabled)
measured in the same rounds.

Op counts: the aten ops that run during ``loss.backward()`` (a dispatch-mode
counter), matmul-like ops (``mm``, ``addmm``, ``bmm``, ``baddbmm`` and the
attention kernels) counted apart; "recomputed" is the count minus plain
backward's.  Memory: live tensor bytes after the forward (LiveBytes).
"""

from __future__ import annotations

import functools

import torch

from .harness import MiB, Spread, interleaved, ratio, spread, table
from .models import gpt2

VARIANTS = ["none", "torch", "nothing", "dots"]
LABELS = {
    "none": "no checkpointing",
    "torch": "torch.utils.checkpoint (HF gradient checkpointing)",
    "nothing": "remat, nothing_saveable (full remat)",
    "dots": "remat, dots_saveable",
}
_MATMUL = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear")
_ATTENTION = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_attention_math",
              "_scaled_dot_product_cudnn_attention")


class _Setup:
    def __init__(self, quick: bool):
        import remat_fn

        torch.manual_seed(0)
        self.model = gpt2()
        b, t = (2, 128) if quick else (4, 256)
        self.ids = torch.randint(0, 512, (b, t))
        self.blocks = list(self.model.transformer.h)
        self.forwards = [blk.forward for blk in self.blocks]
        P = remat_fn.policies
        self.wrapped = {"nothing": [remat_fn.remat(f, policy=P.nothing_saveable) for f in self.forwards],
                        "dots": [remat_fn.remat(f, policy=P.dots_saveable) for f in self.forwards]}
        self.tc = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)

    def use(self, variant: str) -> None:
        if variant == "torch":
            self.model._set_gradient_checkpointing(True, gradient_checkpointing_func=self.tc)
        else:
            self.model._set_gradient_checkpointing(False)
        for blk, f in zip(self.blocks, self.wrapped.get(variant, self.forwards)):
            blk.forward = f

    def loss(self):
        return self.model(input_ids=self.ids, labels=self.ids, use_cache=False).loss

    def step(self, variant: str) -> None:
        self.use(variant)
        self.model.zero_grad(set_to_none=True)
        self.loss().backward()

    def forward_only(self) -> None:
        self.use("none")
        self.loss()

    def counts(self, variant: str) -> dict:
        from remat_fn.memory import LiveBytes

        self.use(variant)
        self.model.zero_grad(set_to_none=True)
        with LiveBytes() as m:
            loss = self.loss()
            live = m.live
        from remat_fn._debug import OpTrace

        with OpTrace() as tr:
            loss.backward()
        n: dict[str, int] = {}
        for op in tr.ops:  # "aten.mm.default  file:line (function)"
            k = op.split()[0].split(".")[1]
            n[k] = n.get(k, 0) + 1
        return {"matmul": sum(n.get(k, 0) for k in _MATMUL), "attention": sum(n.get(k, 0) for k in _ATTENTION),
                "ops": sum(n.values()), "after_forward_MiB": live / MiB}


def run(quick: bool) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        st = _Setup(quick)
        counts = {v: st.counts(v) for v in VARIANTS}
        fns = {v: functools.partial(st.step, v) for v in VARIANTS}
        fns["forward"] = st.forward_only
        s = interleaved(fns, repeats=3 if quick else 11)
    finally:
        torch.set_num_threads(threads)
    F = s["forward"]
    limit = [(2 * f + (n - f)) / n for f, n in zip(F, s["none"])]
    base = counts["none"]
    rows = {}
    for v in VARIANTS:
        c = counts[v]
        rows[v] = {**c, "recomputed_matmul": c["matmul"] - base["matmul"],
                   "recomputed_attention": c["attention"] - base["attention"],
                   "ms": tuple(spread(s[v]).scaled(1e3)), "vs_no_remat": tuple(ratio(s[v], s["none"])),
                   "vs_torch": tuple(ratio(s[v], s["torch"]))}
    return {"model": f"HF GPT-2 6x256, batch {tuple(st.ids.shape)}, 1 thread, forward + loss.backward()",
            "forward_ms": tuple(spread(F).scaled(1e3)), "limit": tuple(Spread.of(limit)),
            "dots_over_nothing": tuple(ratio(s["dots"], s["nothing"])), "rows": rows}


def md(r: dict) -> str:
    out = [[LABELS[v], Spread(*row["ms"]).fmt(digits=0), Spread(*row["vs_no_remat"]).fmt(digits=2),
            Spread(*row["vs_torch"]).fmt(digits=2), f"{row['matmul']} ({row['recomputed_matmul']:+d})",
            f"{row['attention']} ({row['recomputed_attention']:+d})", row["ops"], f"{row['after_forward_MiB']:.1f}"]
           for v, row in r["rows"].items()]
    return (f"{r['model']}. Time: one step of each variant per round, rounds interleaved, median (min-max); "
            "ratios per round. Ops: aten ops run by `loss.backward()` (recomputation included), in brackets "
            "the difference to plain backward.\n\n"
            + table(["variant", "step (ms)", "time / no remat", "time / torch checkpoint",
                     "backward matmuls", "backward attention kernels", "backward aten ops",
                     "live after forward (MiB)"], out)
            + f"\n\nPhysical limit of full recompute, (2F+B)/(F+B) with F = forward "
            f"{Spread(*r['forward_ms']).fmt(digits=0)} ms: **{Spread(*r['limit']).fmt(digits=2)}**. "
            f"dots_saveable / nothing_saveable step time: **{Spread(*r['dots_over_nothing']).fmt(digits=2)}**.")


SECTIONS = {"gpt2": (run, md, "HF GPT-2 step: full remat and dots_saveable, recomputed ops")}
CHILDREN: dict = {}
