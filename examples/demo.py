"""Demo: train a small GPT with ``remat`` + ``torch.func``, then compare memory and time.

``python examples/demo.py`` trains a GPT-style model (pre-LN causal
transformer, written out with plain matmuls) on a synthetic task generated in
code: reverse a random string of digits (``3 1 4 1 | 1 4 1 3``).  The
training loop is functional: ``torch.func.functional_call`` +
``torch.func.grad_and_value`` over a parameter dict, ``remat`` on every block,
dropout drawn from explicit :mod:`remat_fn.random` keys (``split`` once per
step, ``fold_in`` once per layer) and a hand-written AdamW update.

It then measures one training step of the same model and batch with no
rematerialisation, with ``torch.utils.checkpoint`` and with ``remat`` under
each policy that :mod:`remat_fn.policies` provides, both under
``torch.func.grad_and_value`` and in an eager ``loss.backward()`` loop
(``torch.utils.checkpoint`` fails under ``torch.func``: the table says so),
prints a table of activation memory (``LiveBytes`` peak and after-forward)
against step time, notes how full remat's step compares with the no-remat step
plus one forward of the model (the most its recompute adds) and what is left over
(per-call overhead of the regions, which weighs most on a model this small), and
writes a plot of memory against time to ``--out``.

tqdm and matplotlib (the ``demo`` extra) are optional: without tqdm progress
is printed as lines, without matplotlib the plot is skipped.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.func import functional_call, grad_and_value, vjp

import remat_fn
from remat_fn import random as rnd
from remat_fn.memory import LiveBytes, MiB

__all__ = ["Config", "SIZES", "GPT", "make_batch", "variants", "main"]

# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """Model and task size."""

    d_model: int = 64
    layers: int = 2
    heads: int = 4
    digits: int = 8  # length of the string to reverse
    batch: int = 64
    dropout: float = 0.1
    lr: float = 3e-3
    vocab: int = 11  # digits 0-9 and the separator

    @property
    def seq_len(self) -> int:  # digits, separator, reversed digits minus the last
        return 2 * self.digits


SIZES: dict[str, Config] = {
    "tiny": Config(),
    "small": Config(d_model=128, layers=4, heads=4, digits=12, batch=64, lr=2e-3),
}
SEP = 10

# ---------------------------------------------------------------------------
# The synthetic task
# ---------------------------------------------------------------------------


def make_batch(key: torch.Tensor, cfg: Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of the reversal task drawn from ``key``.

    **Returns:** ``(inputs, targets, mask)``: ``inputs`` and ``targets`` are
    ``(batch, 2 * digits)`` token ids (``targets`` shifted by one), ``mask``
    selects the positions whose target is a digit of the reversed string.
    """
    digits = rnd.randint(key, (cfg.batch, cfg.digits), 0, 10)
    sep = torch.full((cfg.batch, 1), SEP, dtype=torch.int64)
    seq = torch.cat([digits, sep, digits.flip(1)], dim=1)
    inputs, targets = seq[:, :-1], seq[:, 1:]
    mask = torch.zeros_like(targets, dtype=torch.bool)
    mask[:, cfg.digits:] = True
    return inputs, targets, mask


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, cfg: Config):
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = rnd.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        k_att, k_res1, k_res2 = rnd.split(key, 3)
        B, T, C = x.shape
        H = self.heads
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q, k, v = (t.reshape(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // H))
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        att = self.drop(att, k_att)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.drop(remat_fn.checkpoint_name(self.proj(y), "attn_out"), k_res1)
        h = remat_fn.checkpoint_name(F.gelu(self.fc(self.ln2(x))), "mlp_hidden")
        return x + self.drop(self.out(h), k_res2)


class GPT(nn.Module):
    """A small GPT.  ``wrap_blocks`` chooses how each block is called (checkpointed)."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)
        self._calls: list[Callable] = list(self.blocks)

    def wrap_blocks(self, wrap: Callable[[nn.Module], Callable]) -> GPT:
        """Call each block through ``wrap(block)`` (e.g. ``remat_fn.remat``); the
        identity gives the plain model."""
        self._calls = [wrap(b) for b in self.blocks]
        return self

    def forward(self, idx: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for i, call in enumerate(self._calls):
            h = call(h, rnd.fold_in(key, i))  # one independent dropout stream per layer
        return self.head(self.ln_f(h))


def masked_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[mask], targets[mask])


# ---------------------------------------------------------------------------
# Functional training
# ---------------------------------------------------------------------------


def adamw(params, grads, state, step, *, lr, betas=(0.9, 0.98), eps=1e-8, wd=0.01):
    """One AdamW update on a dict of tensors (returns new dicts; nothing in place)."""
    b1, b2 = betas
    new_p, new_s = {}, {}
    for k, p in params.items():
        g = grads[k]
        m, v = state.get(k, (torch.zeros_like(p), torch.zeros_like(p)))
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mhat, vhat = m / (1 - b1 ** step), v / (1 - b2 ** step)
        decay = wd if p.ndim >= 2 else 0.0
        new_p[k] = p - lr * (mhat / (vhat.sqrt() + eps) + decay * p)
        new_s[k] = (m, v)
    return new_p, new_s


def make_loss_fn(model: GPT):
    def loss_fn(params, inputs, targets, mask, key):
        logits = functional_call(model, params, (inputs, key))
        return masked_loss(logits, targets, mask)

    return loss_fn


@torch.no_grad()
def accuracy(model: GPT, params, cfg: Config, key) -> float:
    """Exact-match accuracy of greedy decoding of the reversed string (dropout off)."""
    inputs, targets, _ = make_batch(key, cfg)
    model.eval()
    try:
        seq = inputs[:, : cfg.digits + 1]
        for _ in range(cfg.digits):
            logits = functional_call(model, params, (seq, rnd.key(0)))
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    finally:
        model.train()
    return (seq[:, cfg.digits + 1:] == targets[:, cfg.digits:]).all(1).float().mean().item()


def _progress(total: int, desc: str):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, file=sys.stdout, dynamic_ncols=True, mininterval=0.5)


def train(model: GPT, cfg: Config, steps: int, seed: int, log: Callable[[str], None] = print):
    """Train with remat on every block; returns (params, list of losses, seconds, the
    remat_fn.profile() of the last step)."""
    torch.manual_seed(seed)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state: dict = {}
    model.wrap_blocks(remat_fn.remat)
    step_fn = grad_and_value(make_loss_fn(model))
    key = rnd.key(seed)
    losses = []
    bar = _progress(steps, "training (remat + torch.func)")
    every = max(1, steps // 10)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        key, k_data, k_drop = rnd.split(key, 3)
        inputs, targets, mask = make_batch(k_data, cfg)
        if step == steps:  # what each region did in one step
            with remat_fn.profile() as prof:
                grads, loss = step_fn(params, inputs, targets, mask, k_drop)
        else:
            grads, loss = step_fn(params, inputs, targets, mask, k_drop)
        warm = min(1.0, step / 20)
        params, state = adamw(params, grads, state, step, lr=cfg.lr * warm)
        losses.append(loss.item())
        if bar is not None:
            bar.update(1)
            if step % 5 == 0 or step == steps:
                bar.set_postfix(loss=f"{statistics.fmean(losses[-10:]):.3f}")
        elif step % every == 0 or step == steps or step == 1:
            log(f"  step {step:5d}/{steps}  loss {statistics.fmean(losses[-10:]):.3f}"
                f"  ({time.perf_counter() - t0:.1f} s)")
    if bar is not None:
        bar.close()
    return params, losses, time.perf_counter() - t0, prof


# ---------------------------------------------------------------------------
# Variants and measurements
# ---------------------------------------------------------------------------

def variants() -> list[tuple[str, Callable[[nn.Module], Callable]]]:
    """``(label, wrap)``: how each block is called, for the comparison table."""
    P = remat_fn.policies

    def torch_checkpoint(b):
        return functools.partial(torch.utils.checkpoint.checkpoint, b, use_reentrant=False)

    def with_policy(policy):
        return lambda b: remat_fn.remat(b, policy=policy)

    return [
        ("no remat", lambda b: b),
        ("torch.utils.checkpoint", torch_checkpoint),
        ("remat nothing_saveable (default)", remat_fn.remat),
        ("remat everything_saveable", with_policy(P.everything_saveable)),
        ("remat dots_saveable", with_policy(P.dots_saveable)),
        ("remat dots_with_no_batch_dims_saveable", with_policy(P.dots_with_no_batch_dims_saveable)),
        ("remat save_only_these_names('attn_out')", with_policy(P.save_only_these_names("attn_out"))),
        ("remat save_anything_except_these_names('mlp_hidden')",
         with_policy(P.save_anything_except_these_names("mlp_hidden"))),
        ("remat memory_budget(0.5)", with_policy(P.memory_budget(0.5))),
        ("remat memory_budget(0.2)", with_policy(P.memory_budget(0.2))),
    ]


def error_text(e: BaseException) -> str:
    """One line for a table cell: why a variant could not run."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "saved tensor hooks" in msg:
        return "(torch: saved tensor hooks unsupported)"
    msg = f"{type(e).__name__}: {msg}"
    return msg if len(msg) < 70 else msg[:67] + "..."


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each function, one sample per round; the functions
    alternate within every round, so background load hits them alike."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    bar = _progress(repeats * len(fns), "timing steps")
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[k].append(time.perf_counter() - t0)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return samples


def measure(model: GPT, params, cfg: Config, seed: int, rows, repeats: int, log=print,
            timer=interleaved, forward: dict | None = None) -> list[dict]:
    """Memory and step time of each ``(label, wrap)`` row, under torch.func and in eager
    autograd.  ``timer(fns, repeats) -> {name: seconds per round}`` times the steps of
    all rows alternating within each round; each time is reported as median and
    min-max over the rounds, and the rounds themselves (``func_rounds_ms``,
    ``eager_rounds_ms``).

    ``forward``, a dict, also gets the time of one forward of the plain model, timed
    in the same rounds: ``forward["func"]`` (``torch.func.vjp`` of the loss, which runs
    the forward only) and ``forward["eager"]`` (the loss with autograd recording),
    each ``{"ms", "ms_min", "ms_max", "rounds_ms"}``: what one extra forward costs."""
    key = rnd.key(seed + 1)
    inputs, targets, mask = make_batch(rnd.fold_in(key, 0), cfg)
    k_drop = rnd.fold_in(key, 1)
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(params[k])

    results = []
    for label, wrap in rows:
        r: dict[str, Any] = {"variant": label}
        model.wrap_blocks(wrap)
        calls = list(model._calls)
        loss_fn = make_loss_fn(model)

        # torch.func: grad_and_value of a functional_call
        def probe(p, *a, _m=None, _box=None):
            loss = loss_fn(p, *a)
            _box["after"] = _m.live
            return loss

        try:
            box: dict = {}
            with LiveBytes() as m:
                g, loss = grad_and_value(lambda p, *a: probe(p, *a, _m=m, _box=box))(
                    params, inputs, targets, mask, k_drop)
                del g, loss
            r["func_peak"], r["func_after_fwd"] = m.peak / MiB, box["after"] / MiB
            fn = grad_and_value(loss_fn)
            r["_func"] = (lambda fn=fn, calls=calls: (setattr(model, "_calls", calls),
                                                       fn(params, inputs, targets, mask, k_drop)))
        except Exception as e:
            r["func_error"] = "fails under torch.func " + error_text(e)

        # eager: loss.backward() on the module's own parameters
        def eager_step(calls=calls):
            model._calls = calls
            model.zero_grad(set_to_none=True)
            masked_loss(model(inputs, k_drop), targets, mask).backward()

        try:
            model.zero_grad(set_to_none=True)
            with LiveBytes() as m:
                loss = masked_loss(model(inputs, k_drop), targets, mask)
                after = m.live
                loss.backward()
                del loss
            r["eager_peak"], r["eager_after_fwd"] = m.peak / MiB, after / MiB
            r["_eager"] = eager_step
        except Exception as e:
            r["eager_error"] = error_text(e)
        results.append(r)

    # step times: every variant in turn within each round
    fns = {f"{i}{k}": r[k] for i, r in enumerate(results) for k in ("_func", "_eager") if k in r}
    if forward is not None:  # one forward of the plain model, in the same rounds
        plain_calls = list(model.blocks)
        plain_loss = make_loss_fn(model)

        def forward_func():
            model._calls = plain_calls
            return vjp(lambda p: plain_loss(p, inputs, targets, mask, k_drop), params)[0]

        def forward_eager():
            model._calls = plain_calls
            return masked_loss(model(inputs, k_drop), targets, mask)

        fns["forward_func"], fns["forward_eager"] = forward_func, forward_eager
    samples = timer(fns, repeats)

    def stats(seconds: list[float]) -> dict:
        v = [t * 1e3 for t in seconds]
        return {"ms": statistics.median(v), "ms_min": min(v), "ms_max": max(v), "rounds_ms": v}

    for i, r in enumerate(results):
        for k in ("_func", "_eager"):
            if k in r:
                name = k.strip("_")
                st = stats(samples[f"{i}{k}"])
                r[name + "_ms"], r[name + "_ms_min"], r[name + "_ms_max"] = st["ms"], st["ms_min"], st["ms_max"]
                r[name + "_rounds_ms"] = st["rounds_ms"]
                del r[k]
    if forward is not None:
        forward["func"], forward["eager"] = stats(samples["forward_func"]), stats(samples["forward_eager"])
    model.wrap_blocks(remat_fn.remat)
    return results


def _cell(r, key, fmt="{:.2f}"):
    return fmt.format(r[key]) if key in r else "-"


def _time(r, mode):
    if f"{mode}_ms" not in r:
        return "-"
    return f"{r[mode + '_ms']:.1f} ({r[mode + '_ms_min']:.1f}-{r[mode + '_ms_max']:.1f})"


def format_table(results: list[dict]) -> str:
    lines = [
        "| variant | torch.func peak (MiB) | torch.func after fwd (MiB) | torch.func step (ms, median (min-max)) "
        "| eager peak (MiB) | eager after fwd (MiB) | eager step (ms, median (min-max)) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if "func_error" in r:
            func = f"{r['func_error']} | | "
        else:
            func = f"{_cell(r, 'func_peak')} | {_cell(r, 'func_after_fwd')} | {_time(r, 'func')}"
        if "eager_error" in r:
            eager = f"{r['eager_error']} | | "
        else:
            eager = f"{_cell(r, 'eager_peak')} | {_cell(r, 'eager_after_fwd')} | {_time(r, 'eager')}"
        lines.append(f"| {r['variant']} | {func} | {eager} |")
    return "\n".join(lines)


def caption(cfg: Config, repeats: int) -> str:
    """What the table's columns mean (printed above it and written above it in table.md)."""
    return (
        f"One training step, batch {cfg.batch} x {cfg.seq_len} tokens, per variant. Memory is measured "
        "with LiveBytes (remat_fn.memory: the bytes of live tensors created during the step; exact, and "
        "it works inside torch.func): *peak* is the most alive at any moment of the step, *after fwd* what "
        "is still alive when the forward has returned, i.e. what the step keeps for backward. Step time is "
        f"the median of {repeats} interleaved rounds (the variants alternate within each round) with the "
        "spread, min-max over the rounds, in parentheses: a difference smaller than the spread is noise. "
        "torch.func = grad_and_value(functional_call); eager = loss.backward()."
    )


def _spread(v: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(v))} ({fmt.format(min(v))}-{fmt.format(max(v))})"


def time_notes(results: list[dict], forward: dict, cfg: Config) -> str:
    """What the step times say about remat's cost: full remat (``nothing_saveable``)
    against no remat and against the no-remat step plus one forward (the most a
    recompute of every block costs), per round (median (min-max) over rounds), and
    where the rest goes."""
    rows = {r["variant"]: r for r in results}
    plain, full = rows.get("no remat"), rows.get("remat nothing_saveable (default)")
    if not plain or not full:
        return ""
    parts, extra, noisy = [], {}, False
    for mode, name in (("func", "under torch.func"), ("eager", "in eager autograd")):
        key = f"{mode}_rounds_ms"
        if key not in plain or key not in full or mode not in forward:
            continue
        b, r, f = plain[key], full[key], forward[mode]["rounds_ms"]
        ratio = [ri / bi for ri, bi in zip(r, b)]
        bound = [(bi + fi) / bi for bi, fi in zip(b, f)]
        extra[mode] = statistics.median([ri - bi - fi for ri, bi, fi in zip(r, b, f)])
        noisy = noisy or max(ratio) > 1.5 * min(ratio)
        parts.append(f"{name} full remat takes {_spread(ratio)}x the no-remat step, against at most "
                     f"{_spread(bound)}x for one extra forward ({forward[mode]['ms']:.1f} ms here)")
    if not parts:
        return ""
    text = ("Time against one extra forward (ratios per round, median (min-max); the forward is one forward "
            "of the plain model timed in the same rounds): " + "; ".join(parts) + ". ")
    if noisy:
        text += ("The ratios vary widely between rounds in this run (other work on the machine?): run again on an "
                 "idle machine, or with --threads 1, before reading much into them. ")
    over = {m: v for m, v in extra.items() if v > 0}
    if over:
        ms = " and ".join(f"{v:.1f} ms ({v / forward[m]['ms']:.1f}x the forward) "
                          f"{'under torch.func' if m == 'func' else 'eager'}" for m, v in over.items())
        text += (f"The rest, about {ms} per step, is what the {cfg.layers} regions cost beyond recomputing: "
                 "per-call overhead (recording each call's aten ops in the forward, replaying them in backward "
                 "and, under torch.func, the capture mode), Python and dispatcher work per op and per call that "
                 "does not grow with the tensors; the forward timed is the whole model's, a little more than the "
                 "blocks remat re-runs, so this understates it. It weighs most on a model as small as this one "
                 f"(d_model {cfg.d_model}, {cfg.batch} x {cfg.seq_len} tokens); with large activations (wide layers, "
                 "long sequences, big batches) the recompute dominates and remat costs about one extra forward "
                 "or less (docs/benchmarks.md: an HF GPT-2 training step under full remat, eager, 1.30x the plain "
                 "step against 1.48x for one extra forward).")
    else:
        text += "Full remat stays within the no-remat step plus one forward here."
    return text


def place_labels(points: list[tuple[float, float]], texts: list[str], *, marker: float = 7.0,
                 char_w: float = 5.0, text_h: float = 6.0) -> list[tuple[str, int, float, float]]:
    """Where to put the number of each point so that no two labels overlap.

    ``points`` are positions in typographic points (display units), ``texts``
    their labels.  Points whose markers coincide (closer than ``marker``) share
    one label (``"1,4"``); each label goes to the first spot around its point
    that overlaps no label placed before it and no other marker and is nearer
    its own point than any other (the least bad spot if none is free).  Returns ``(text, index of the point it
    is attached to, dx, dy)``: the offset, in points, of the label's lower-left
    corner from the point.
    """
    groups: list[list[int]] = []
    for i, (x, y) in enumerate(points):
        for g in groups:
            gx, gy = points[g[0]]
            if abs(x - gx) < marker and abs(y - gy) < marker:
                g.append(i)
                break
        else:
            groups.append([i])
    r = marker / 2
    obstacles = [(x - r, y - r, x + r, y + r) for x, y in points]
    placed: list[tuple[str, int, float, float]] = []

    def overlap(a, b):
        w = min(a[2], b[2]) - max(a[0], b[0])
        h = min(a[3], b[3]) - max(a[1], b[1])
        return w * h if w > 0 and h > 0 else 0.0

    for g in groups:
        text = ",".join(texts[i] for i in g)
        x, y = points[g[0]]  # the label's offsets are from the group's first point
        w, h = char_w * len(text), text_h
        # above right, above left, above, then below, then beside, then further out
        q = r + 1  # a point of air between a marker and its label
        spots = [(r, q), (-r - w, q), (-w / 2, q + 1), (r, -q - h), (-r - w, -q - h), (-w / 2, -q - h - 1),
                 (q + 1, -h / 2), (-q - w - 1, -h / 2), (r, q + h + 2), (-r - w, q + h + 2),
                 (r, -q - 2 * h - 2), (-r - w, -q - 2 * h - 2)]
        others = [b for j, b in enumerate(obstacles) if j not in g]
        other_pts = [pt for j, pt in enumerate(points) if j not in g]
        best = None
        for dx, dy in spots:
            box = (x + dx, y + dy, x + dx + w, y + dy + h)
            cost = sum(overlap(box, b) for b in others)
            # a label nearer to another point than to its own would be read as that point's
            cx, cy = x + dx + w / 2, y + dy + h / 2
            own_d = min(math.dist((cx, cy), points[i]) for i in g)
            cost += sum(1.0 for pt in other_pts if math.dist((cx, cy), pt) < own_d)
            if cost == 0:
                best = (0.0, dx, dy, box)
                break
            if best is None or cost < best[0]:
                best = (cost, dx, dy, box)
        assert best is not None
        _, dx, dy, box = best
        obstacles.append(box)
        placed.append((text, g[0], dx, dy))
    return placed


def time_axis(medians: list[float], maxima: list[float]) -> float:
    """The right end of a time axis: every whisker when they all fit in 1.6x the
    largest median, else 1.6x the largest median (the whiskers beyond are cut and
    their maxima written under the panel), so one slow round cannot squeeze every
    median into the left edge."""
    top = max(medians)
    return max(maxima) * 1.04 if max(maxima) <= 1.6 * top else 1.6 * top


def plot(results: list[dict], path: str, title: str, forward: dict | None = None) -> bool:
    """Peak activation memory against step time: one panel per mode (torch.func,
    eager), one numbered point per variant, the numbers explained on the right
    (labels placed so that they do not overlap; coinciding points share one).

    The time axis ends at 1.6x the slowest median (``time_axis``): a whisker
    reaching past it is cut at the edge with an arrow and its maximum is written
    under the panel.  With ``forward`` (``measure``'s), a dotted line marks the
    no-remat step and a dashed one the no-remat step plus one forward, the most a
    recompute of every block costs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.4), sharey=True)
    cmap = plt.get_cmap("tab20")
    shown: list[list[tuple[float, float, str]]] = []
    plain = next((r for r in results if r["variant"] == "no remat"), None)
    for ax, (mode, name) in zip(axes, (("func", "torch.func.grad_and_value"), ("eager", "eager .backward()"))):
        shown.append([])
        timed = [(i, r) for i, r in enumerate(results) if f"{mode}_ms" in r and f"{mode}_peak" in r]
        if not timed:
            continue
        right = time_axis([r[f"{mode}_ms"] for _, r in timed], [r[f"{mode}_ms_max"] for _, r in timed])
        cut = []
        for i, r in timed:
            x, y = r[f"{mode}_ms"], r[f"{mode}_peak"]
            lo, hi = r[f"{mode}_ms_min"], r[f"{mode}_ms_max"]
            ax.errorbar([x], [y], xerr=[[x - lo], [min(hi, right) - x]], color=cmap(i % 20), fmt="o", ms=7,
                        capsize=3, zorder=3)
            if hi > right:  # the whisker goes on past the edge: an arrow there, its maximum under the panel
                ax.annotate("", xy=(right, y), xytext=(right - 0.035 * right, y), zorder=3, annotation_clip=False,
                            arrowprops=dict(arrowstyle="-|>", color=cmap(i % 20), lw=1.2))
                cut.append(f"{i + 1}: {hi:.0f}")
            shown[-1].append((x, y, str(i + 1)))
        ax.set_xlim(0, right)
        if plain is not None and forward and mode in forward and f"{mode}_ms" in plain:
            base = plain[f"{mode}_ms"]
            ax.axvline(base, color="0.45", ls=":", lw=1, zorder=1, label="no remat (median)")
            ax.axvline(base + forward[mode]["ms"], color="0.45", ls="--", lw=1, zorder=1,
                       label="no remat + one forward of the model\n(the most a full recompute adds)")
        failed = [str(i + 1) for i, r in enumerate(results) if f"{mode}_error" in r]
        sub = name + (f"  (fails here: {', '.join(failed)})" if failed else "")
        ax.set_title(sub, fontsize=9)
        ax.set_xlabel("training step time (ms): median, whiskers min-max")
        if cut:
            note = textwrap.fill("whiskers cut at the edge, their max (ms): " + ", ".join(cut), 62)
            ax.text(0.0, -0.15, note, transform=ax.transAxes, fontsize=7.5, va="top", color="0.25")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("peak live activation bytes (MiB, LiveBytes)")
    width = len(str(len(results)))
    key = "\n".join(f"{i + 1:>{width}}  {r['variant']}" for i, r in enumerate(results))
    fig.text(0.70, 0.5, key, fontsize=8, va="center", family="monospace")
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:  # the reference lines, explained under the key
        fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(0.695, 0.3), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 0.69, 1))
    fig.canvas.draw()  # final limits and layout: label positions are computed in points
    to_pt = 72.0 / fig.dpi
    for ax, pts in zip(axes, shown):
        disp = [tuple(v * to_pt for v in ax.transData.transform((x, y))) for x, y, _ in pts]
        for text, j, dx, dy in place_labels(disp, [t for _, _, t in pts]):
            ax.annotate(text, pts[j][:2], fontsize=8, xytext=(dx, dy), textcoords="offset points",
                        ha="left", va="baseline", zorder=4)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_loss(losses: list[float], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses, lw=0.8, alpha=0.5, label="loss")
    w = max(1, len(losses) // 20)
    smooth = [statistics.fmean(losses[max(0, i - w):i + 1]) for i in range(len(losses))]
    ax.plot(smooth, lw=1.5, label=f"running mean ({w})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title("remat_fn demo: reversal task, functional training with remat")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python examples/demo.py",
        description="Train a small GPT on a synthetic digit-reversal task with remat on every block "
                    "in a torch.func training loop (functional_call + grad_and_value, dropout from "
                    "remat_fn.random keys, hand-written AdamW), then print a table of activation memory "
                    "and step time without remat, with torch.utils.checkpoint and with each remat "
                    "policy, and plot memory against time.",
    )
    ap.add_argument("--steps", type=int, default=150,
                    help="training steps (default 150: the tiny task is solved after about 75)")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny",
                    help="model/task size: tiny (2 layers, d=64, 8 digits) or small (4 layers, d=128, "
                         "12 digits); default tiny")
    ap.add_argument("--out", default="demo_out",
                    help="folder for results.json, the table (table.md) and the plots (default ./demo_out)")
    ap.add_argument("--seed", type=int, default=0, help="seed for initialisation, data and dropout keys")
    ap.add_argument("--no-plot", action="store_true", help="do not write PNG plots")
    ap.add_argument("--repeats", type=int, default=7,
                    help="timed rounds per variant for the table (median reported; default 7)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads torch uses for training and the measurements (torch.set_num_threads; "
                         "default: torch's own, OMP_NUM_THREADS or else the physical cores); 1 gives steadier timings on a busy machine")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = SIZES[args.size]
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"remat_fn demo: GPT {cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads, "
          f"{nparams / 1e3:.0f}k parameters; task: reverse {cfg.digits} digits, batch {cfg.batch}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, python {platform.python_version()}")

    params, losses, secs, prof = train(model, cfg, args.steps, args.seed)
    k = max(1, min(10, len(losses) // 5))
    acc = accuracy(model, params, cfg, rnd.key(args.seed + 12345))
    print(f"loss {statistics.fmean(losses[:k]):.3f} -> {statistics.fmean(losses[-k:]):.3f} in "
          f"{args.steps} steps ({secs:.1f} s, {secs / args.steps * 1e3:.1f} ms/step); "
          f"exact-match accuracy of greedy reversal {acc:.0%}")
    print("\nremat_fn.profile() of the last training step (torch.func.grad_and_value), per region:\n")
    print(prof)

    rows = variants()
    forward: dict = {}
    results = measure(model, params, cfg, args.seed, rows, args.repeats, forward=forward)
    table = format_table(results)
    text = caption(cfg, args.repeats)
    notes = time_notes(results, forward, cfg)
    print("\n" + textwrap.fill(text, 110, break_on_hyphens=False, break_long_words=False) + "\n")
    print(table)
    print("(offload policies move tensors from a GPU to the CPU; this machine has none, so they are not shown)")
    if notes:
        print("\n" + textwrap.fill(notes, 110, break_on_hyphens=False, break_long_words=False))

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "machine": platform.machine(), "processor": platform.processor(),
            "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "remat_fn": remat_fn.__version__}
    out = {"info": info, "config": asdict(cfg), "size": args.size, "steps": args.steps,
           "seed": args.seed, "repeats": args.repeats, "losses": losses, "train_seconds": secs, "accuracy": acc,
           "forward": forward, "results": results}
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(out, fh, indent=2)
    with open(os.path.join(args.out, "table.md"), "w") as fh:
        fh.write(text + "\n\n" + table + "\n" + (f"\n{notes}\n" if notes else ""))
    written = []
    if not args.no_plot:
        p1 = os.path.join(args.out, "memory_vs_time.png")
        p2 = os.path.join(args.out, "loss.png")
        title = (f"GPT {cfg.layers}x{cfg.d_model}, batch {cfg.batch}x{cfg.seq_len}: "
                 "peak activation memory vs step time")
        if plot(results, p1, title, forward):
            written.append(p1)
        if plot_loss(losses, p2):
            written.append(p2)
        if not written:
            print("\n(matplotlib is not installed: no plots; pip install 'remat-fn[demo]')")
    print("\nwrote " + ", ".join([os.path.join(args.out, "results.json"), os.path.join(args.out, "table.md"),
                                  *written]))
    return out


if __name__ == "__main__":
    main()
