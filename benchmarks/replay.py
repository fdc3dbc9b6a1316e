"""``replay``: live bytes during backward, and the cost of recording a region.

Memory (one thread): live tensor bytes counted by :class:`remat_fn.memory.LiveBytes`
right after the forward and their peak from the start of ``loss.backward()`` to
its end (the meter's peak is reset when backward starts), after one untimed
warm-up step of the same variant.  Live bytes are deterministic, so each is
one measurement.

- The 40-op chain: ``for _ in range(40): h = h * 1.01 + 0.1; return h.exp()``
  on a 256x1024 float32 input requiring grad, loss ``.sum()``: no remat,
  ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` and ``remat``
  (default policy; the chain has no matmul, so ``dots_saveable`` is the same).
- Hugging Face GPT-2 and Llama built from tiny configs (no downloads),
  forward + ``loss.backward()``, ``use_cache=False``: no checkpointing; per
  layer through Hugging Face's gradient-checkpointing hook
  (``_set_gradient_checkpointing(True, gradient_checkpointing_func=...)``)
  with torch's checkpoint, ``remat_fn.compat.checkpoint`` and torch's
  selective checkpointing saving matmuls; and ``block.forward =
  remat(block.forward, policy=dots_saveable)``.  Without ``--quick`` each
  variant also runs in a fresh process (a warm-up step on a 2 x 16 batch, then
  two full steps, no meter) that reports its peak RSS (``VmHWM``); a baseline
  process builds the same model and runs every variant on the small batch only.
  ``--quick``: 2 layers x 64, batch 2 x 64, no fresh processes.

Recording: the forward of a region records its ops, so its time is measured
forward only (grad enabled, inputs requiring grad, the output dropped) for
regions of N = 250, 500, 1000, 2000 (``--quick``: 125, 250) pairs ``h = h @ w; h.mul_(0.5)`` (16x16
float32, ``w`` orthogonal times 2 so that ``h`` keeps its norm), and the same
pairs plus an accumulator written N times (``acc.add_(h * i)``): the plain
function, ``remat`` with ``policy=None`` and with ``dots_saveable``, one call of
each per round, rounds interleaved (``gc.collect()`` untimed before each call);
time per aten op of the plain forward (counted by a dispatch mode) and the
per-round ratio remat / plain, median (min-max).  A recording linear in the
region's length keeps its time per op flat as N grows.
"""

from __future__ import annotations

import functools
import gc
import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from .harness import (
    MiB,
    Spread,
    child_report,
    error_text,
    fresh_process,
    interleaved,
    ratio,
    sac_save_matmuls,
    spread,
    table,
)

# ---------------------------------------------------------------------------
# Memory: the 40-op chain
# ---------------------------------------------------------------------------

CHAIN_LABELS = {"none": "no remat", "torch": "torch.utils.checkpoint (use_reentrant=False)",
                "remat": "remat (default policy)"}


def chain_region(h):
    for _ in range(40):
        h = h * 1.01 + 0.1
    return h.exp()


def _live(step, reset) -> dict:
    """One untimed warm-up ``step``, then the same step under LiveBytes: live bytes
    after its forward and their peak during its backward.  ``step`` returns the loss
    (its forward); ``reset`` drops the gradients of the previous step."""
    from remat_fn.memory import LiveBytes

    reset()
    step().backward()
    reset()
    with LiveBytes() as m:
        loss = step()
        after = m.live
        m.reset_peak()
        loss.backward()
        peak = m.peak
        del loss
    reset()
    return {"after_forward_MiB": after / MiB, "backward_peak_MiB": peak / MiB}


def chain_memory() -> dict:
    import remat_fn

    torch.manual_seed(0)
    x = torch.randn(256, 1024, requires_grad=True)
    calls = {"none": chain_region,
             "torch": lambda h: torch_checkpoint(chain_region, h, use_reentrant=False),
             "remat": remat_fn.remat(chain_region)}

    def reset():
        x.grad = None

    rows = {}
    for v, fn in calls.items():
        try:
            rows[v] = _live(lambda fn=fn: fn(x).sum(), reset)
        except Exception as e:
            rows[v] = {"error": error_text(e)}
    _vs(rows, "torch")
    return {"model": "40 x (h * 1.01 + 0.1), then exp, on 256x1024 float32 (1 MiB) requiring grad, loss .sum()",
            "rows": rows}


def _vs(rows: dict, ref: str) -> None:
    base = rows.get(ref, {}).get("backward_peak_MiB")
    for r in rows.values():
        if "backward_peak_MiB" in r and base:
            r["backward_peak_vs_torch"] = r["backward_peak_MiB"] / base


# ---------------------------------------------------------------------------
# Memory: Hugging Face GPT-2 and Llama
# ---------------------------------------------------------------------------

HF_VARIANTS = ["none", "torch", "compat", "torch_sac", "dots"]
HF_LABELS = {
    "none": "no checkpointing",
    "torch": "torch.utils.checkpoint per layer (HF hook, use_reentrant=False)",
    "compat": "remat_fn.compat.checkpoint per layer (HF hook)",
    "torch_sac": "torch SAC per layer, save mm/addmm/bmm (HF hook)",
    "dots": "remat dots_saveable per block (block.forward = remat(...))",
}
HF_SIZES = {  # quick: (layers, width, heads, batch, tokens)
    True: (2, 64, 4, 2, 64),
    False: (6, 256, 8, 4, 256),
}
VOCAB = 512


def hf_model(kind: str, quick: bool):
    """GPT-2 (LM head) or Llama (causal LM) from a tiny config, dropout off, training mode."""
    import transformers

    layers, width, heads, _, tokens = HF_SIZES[quick]
    torch.manual_seed(0)
    if kind == "gpt2":
        from .models import gpt2

        return gpt2(n_layer=layers, n_embd=width, n_head=heads, n_positions=tokens, vocab=VOCAB)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=width * 8 // 3,
                                   num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=heads // 2, max_position_embeddings=tokens,
                                   attention_dropout=0.0)
    model = transformers.LlamaForCausalLM(cfg)
    model.train()
    return model


def hf_description(kind: str, quick: bool) -> str:
    layers, width, heads, batch, tokens = HF_SIZES[quick]
    name = {"gpt2": "GPT-2", "llama": "Llama"}[kind]
    extra = f", {heads // 2} KV heads, MLP {width * 8 // 3}" if kind == "llama" else ""
    return f"HF {name} {layers} layers x {width}, {heads} heads{extra}, vocab {VOCAB}, batch {batch}x{tokens}"


class _HF:
    """One model and batch, switchable between :data:`HF_VARIANTS`."""

    def __init__(self, kind: str, quick: bool):
        import remat_fn
        import remat_fn.compat

        self.model = model = hf_model(kind, quick)
        _, _, _, batch, tokens = HF_SIZES[quick]
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (batch, tokens), generator=g)
        self.small = self.ids[:2, :16]
        self.blocks = list(model.transformer.h if kind == "gpt2" else model.model.layers)
        self.forwards = [b.forward for b in self.blocks]
        sac = functools.partial(create_selective_checkpoint_contexts, sac_save_matmuls())
        self.ckpt_funcs = {
            "torch": functools.partial(torch_checkpoint, use_reentrant=False),
            "compat": functools.partial(remat_fn.compat.checkpoint, use_reentrant=False),
            "torch_sac": functools.partial(torch_checkpoint, use_reentrant=False, context_fn=sac),
        }
        self.wrapped = {"dots": [remat_fn.remat(f, policy=remat_fn.policies.dots_saveable)
                                 for f in self.forwards]}

    def use(self, variant: str) -> None:
        fn = self.ckpt_funcs.get(variant)
        if fn is not None:
            self.model._set_gradient_checkpointing(True, gradient_checkpointing_func=fn)
        else:
            self.model._set_gradient_checkpointing(False)
        for b, f in zip(self.blocks, self.wrapped.get(variant, self.forwards)):
            b.forward = f

    def loss(self, ids=None):
        ids = self.ids if ids is None else ids
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss

    def reset(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def step(self, ids=None) -> None:
        self.reset()
        self.loss(ids).backward()
        self.reset()


def hf_memory(kind: str, quick: bool) -> dict:
    st = _HF(kind, quick)
    rows = {}
    for v in HF_VARIANTS:
        st.use(v)
        try:
            rows[v] = _live(st.loss, st.reset)
        except Exception as e:
            rows[v] = {"error": error_text(e)}
    st.use("none")
    _vs(rows, "torch")
    sac = rows.get("torch_sac", {}).get("backward_peak_MiB")
    if sac and "backward_peak_MiB" in rows.get("dots", {}):
        rows["dots"]["backward_peak_vs_torch_sac"] = rows["dots"]["backward_peak_MiB"] / sac
    if not quick:
        base = fresh_process("replay", f"{kind}|baseline")
        rss = {v: fresh_process("replay", f"{kind}|{v}") for v in HF_VARIANTS}
        for v, r in rss.items():
            row = rows[v]
            if r.get("error") or base.get("error"):
                row["rss_error"] = r.get("error") or base.get("error")
                continue
            row["rss_MiB"] = r["rss_MiB"]
            row["rss_above_baseline_MiB"] = r["rss_MiB"] - base["rss_MiB"]
            row["child_remat_fn"] = r["remat_fn"]
        torch_rss = rows["torch"].get("rss_above_baseline_MiB")
        for row in rows.values():
            if "rss_above_baseline_MiB" in row and torch_rss:
                row["rss_vs_torch"] = row["rss_above_baseline_MiB"] / torch_rss
        return {"model": hf_description(kind, quick), "baseline_rss_MiB": base.get("rss_MiB"), "rows": rows}
    return {"model": hf_description(kind, quick), "rows": rows}


def child(spec: str) -> None:
    """In a fresh process: a small warm-up step of the variant (the baseline: of every
    variant), then two full steps (none for the baseline); report the peak RSS."""
    import torch._dynamo  # noqa: F401  (torch.utils.checkpoint imports it on first use: load it everywhere)

    import remat_fn

    kind, variant = spec.split("|")
    torch.set_num_threads(1)
    err = None
    try:
        st = _HF(kind, False)
        for v in (HF_VARIANTS if variant == "baseline" else [variant]):
            st.use(v)
            st.step(st.small)
        if variant != "baseline":
            for _ in range(2):
                st.step()
    except Exception as e:
        err = error_text(e)
    child_report(error=err, remat_fn=os.path.dirname(remat_fn.__file__))


# ---------------------------------------------------------------------------
# Recording time against region length
# ---------------------------------------------------------------------------

REC_N = {True: (125, 250), False: (250, 500, 1000, 2000)}
REC_REPEATS = {250: 9, 500: 7, 1000: 5, 2000: 3}  # --quick: 3
REC_VARIANTS = {"plain": "plain forward", "none": "remat, policy=None", "dots": "remat, dots_saveable"}


def mm_pairs(n: int):
    def region(h, w):
        for _ in range(n):
            h = h @ w
            h.mul_(0.5)
        return h

    return region


def mm_pairs_acc(n: int):
    def region(h, w):
        acc = torch.zeros_like(h)
        for i in range(n):
            h = h @ w
            h.mul_(0.5)
            acc.add_(h * i)
        return h, acc

    return region


REGIONS = {"mm_mul": ("h = h @ w; h.mul_(0.5)", mm_pairs),
           "mm_mul_acc": ("h = h @ w; h.mul_(0.5); acc.add_(h * i)", mm_pairs_acc)}


class _OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def recording(quick: bool) -> dict:
    import remat_fn

    g = torch.Generator().manual_seed(0)
    w = (torch.linalg.qr(torch.randn(16, 16, generator=g)).Q * 2).requires_grad_()
    h = torch.randn(16, 16, generator=g).requires_grad_()
    dots = remat_fn.policies.dots_saveable
    rows = []
    for n in REC_N[quick]:
        for region, (_, make) in REGIONS.items():
            fn = make(n)
            with _OpCount() as c:
                fn(h, w)
            calls = {"plain": fn, "none": remat_fn.remat(fn), "dots": remat_fn.remat(fn, policy=dots)}
            fns = {v: (lambda f=f: f(h, w)) for v, f in calls.items()}
            reps = 3 if quick else REC_REPEATS[n]
            s = interleaved(fns, repeats=reps, before=gc.collect)
            rows.append({"region": region, "n": n, "ops": c.n, "rounds": reps,
                         "ms": {v: tuple(spread(t).scaled(1e3)) for v, t in s.items()},
                         "us_per_op": {v: tuple(spread(t).scaled(1e6 / c.n)) for v, t in s.items()},
                         "vs_plain": {v: tuple(ratio(s[v], s["plain"])) for v in ("none", "dots")}})
    growth = {}
    for region in REGIONS:
        rs = [r for r in rows if r["region"] == region]
        lo, hi = rs[0], rs[-1]
        growth[region] = {"from": lo["n"], "to": hi["n"],
                          **{v: hi["us_per_op"][v][0] / lo["us_per_op"][v][0] for v in REC_VARIANTS}}
    return {"tensors": "16x16 float32, h and w requiring grad, grad enabled", "rows": rows,
            "growth": growth}


# ---------------------------------------------------------------------------
# Section
# ---------------------------------------------------------------------------


def run(quick: bool) -> dict:
    import remat_fn

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {"remat_fn": os.path.dirname(remat_fn.__file__), "chain": chain_memory(),
                "gpt2": hf_memory("gpt2", quick), "llama": hf_memory("llama", quick), "recording": recording(quick)}
    finally:
        torch.set_num_threads(threads)


def _mem_table(rows: dict, labels: dict, rss: bool) -> str:
    header = ["variant", "live after forward (MiB)", "peak during backward (MiB)", "peak / torch checkpoint"]
    if rss:
        header += ["fresh-process peak RSS above baseline (MiB)", "RSS / torch checkpoint"]
    out = []
    for v, r in rows.items():
        if "error" in r:
            out.append([labels[v], r["error"]] + [""] * (len(header) - 2))
            continue
        vs = f"{r['backward_peak_vs_torch']:.2f}x" if "backward_peak_vs_torch" in r else "-"
        if "backward_peak_vs_torch_sac" in r:
            vs += f" ({r['backward_peak_vs_torch_sac']:.2f}x torch SAC)"
        line = [labels[v], f"{r['after_forward_MiB']:.1f}", f"{r['backward_peak_MiB']:.1f}", vs]
        if rss:
            if "rss_above_baseline_MiB" in r:
                line += [f"{r['rss_above_baseline_MiB']:.0f}",
                         f"{r['rss_vs_torch']:.2f}x" if "rss_vs_torch" in r else "-"]
            else:
                line += [r.get("rss_error", "-"), ""]
        out.append(line)
    return table(header, out)


def md(r: dict) -> str:
    parts = ["Live tensor bytes (LiveBytes, one thread): after the forward, and the peak from the start of "
             "`loss.backward()` to its end; one measurement after a warm-up step (live bytes are deterministic).",
             "", f"**40-op chain**: {r['chain']['model']}.", "",
             _mem_table(r["chain"]["rows"], CHAIN_LABELS, False)]
    for kind in ("gpt2", "llama"):
        m = r[kind]
        rss = "baseline_rss_MiB" in m
        note = (f" Peak RSS (`VmHWM`): a fresh process per variant (warm-up step on a 2x16 batch, then two "
                f"full steps), minus the baseline process ({m['baseline_rss_MiB']:.0f} MiB: same model, "
                "every variant on the small batch only)." if rss and m["baseline_rss_MiB"] else "")
        parts += ["", f"**{m['model']}**, forward + `loss.backward()`.{note}", "",
                  _mem_table(m["rows"], HF_LABELS, rss)]
    rec = r["recording"]
    parts += ["", f"**Recording time** (forward only; {rec['tensors']}): time per aten op of the plain forward "
              "and the per-round ratio to the plain forward, median (min-max) over interleaved rounds.", ""]
    out = []
    for row in rec["rows"]:
        us, vs = row["us_per_op"], row["vs_plain"]
        out.append([REGIONS[row["region"]][0], row["n"], row["ops"], row["rounds"],
                    Spread(*row["ms"]["plain"]).fmt(digits=1), Spread(*us["plain"]).fmt(digits=2),
                    Spread(*row["ms"]["none"]).fmt(digits=1), Spread(*us["none"]).fmt(digits=2),
                    Spread(*vs["none"]).fmt(digits=1),
                    Spread(*row["ms"]["dots"]).fmt(digits=1), Spread(*us["dots"]).fmt(digits=2),
                    Spread(*vs["dots"]).fmt(digits=1)])
    parts.append(table(["region (per step)", "N", "ops", "rounds", "plain (ms)", "plain (us/op)",
                        "policy=None (ms)", "policy=None (us/op)", "None / plain",
                        "dots_saveable (ms)", "dots_saveable (us/op)", "dots / plain"], out))
    growth = "; ".join(f"`{REGIONS[k][0]}` N={g['from']}->{g['to']}: "
                       + ", ".join(f"{REC_VARIANTS[v]} {g[v]:.1f}x" for v in REC_VARIANTS)
                       for k, g in rec["growth"].items())
    parts += ["", f"Time per op at the largest N over the smallest (1.0x: linear): {growth}."]
    return "\n".join(parts)


SECTIONS = {"replay": (run, md, "Replay: live bytes during backward and recording time vs region length")}
CHILDREN = {"replay": child}
