"""Memory/time trade-off of each remat policy on a transformer block stack.

For every policy: live activation bytes after forward, peak bytes and step
time, in eager autograd and under ``torch.func.grad`` (functional_call), next
to no remat, ``torch.utils.checkpoint`` and torch's selective checkpointing
(SAC, saving matmuls).  Timings are medians of interleaved repeats; memory is
from ``remat_fn.memory.LiveBytes``.  Nothing is asserted.

Run: python benchmarks/bench_policies.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_ckpt

import remat_fn
from remat_fn import checkpoint_name
from remat_fn import policies as P
from remat_fn.memory import LiveBytes, MiB


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + checkpoint_name(self.proj(a), "attn_out")
        h = checkpoint_name(F.gelu(self.up(self.ln2(x))), "mlp_hidden")
        return x + self.down(h)


def _sac(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) \
        else CheckpointPolicy.PREFER_RECOMPUTE


POLICIES = {
    "nothing_saveable (default)": P.nothing_saveable,
    "dots_saveable": P.dots_saveable,
    "dots_with_no_batch_dims_saveable": P.dots_with_no_batch_dims_saveable,
    "save_only_these_names(attn_out)": P.save_only_these_names("attn_out"),
    "save_anything_except_these_names(mlp_hidden)": P.save_anything_except_these_names("mlp_hidden"),
    "offload names (cpu->cpu)": P.save_and_offload_only_these_names(
        names_which_can_be_offloaded=["attn_out", "mlp_hidden"], offload_src="cpu", offload_dst="cpu"),
    "memory_budget(0.25)": P.memory_budget(0.25),
    "memory_budget(0.5)": P.memory_budget(0.5),
    "everything_saveable": P.everything_saveable,
}


def run(quick: bool) -> dict:
    torch.manual_seed(0)
    d, heads, seq, batch, depth = (64, 4, 64, 4, 3) if quick else (128, 4, 128, 8, 4)
    blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(depth))
    x = torch.randn(batch, seq, d)
    params = {k: v.detach() for k, v in blocks.named_parameters()}
    variants: dict[str, object] = {"no remat": None, "torch.utils.checkpoint": "ckpt", "torch SAC (save mm)": "sac"}
    variants.update({f"remat {k}": v for k, v in POLICIES.items()})
    wrapped = {name: [remat_fn.remat(b, policy=pol) for b in blocks] for name, pol in variants.items()
               if name.startswith("remat ")}

    def fwd(name, h):
        for i, b in enumerate(blocks):
            if name == "no remat":
                h = b(h)
            elif name == "torch.utils.checkpoint":
                h = torch_ckpt(b, h, use_reentrant=False)
            elif name == "torch SAC (save mm)":
                h = torch_ckpt(b, h, use_reentrant=False,
                               context_fn=functools.partial(create_selective_checkpoint_contexts, _sac))
            else:
                h = wrapped[name][i](h)
        return h.pow(2).mean()

    def eager_step(name):
        blocks.zero_grad(set_to_none=True)
        fwd(name, x).backward()

    def func_step(name):
        def loss(p):
            from torch.nn.utils.stateless import _reparametrize_module

            with _reparametrize_module(blocks, p):
                return fwd(name, x)

        return torch.func.grad(loss)(params)

    results = {}
    for name in variants:
        eager_step(name)  # warm-up (and memory_budget planning)
        blocks.zero_grad(set_to_none=True)
        with LiveBytes() as m:
            loss = fwd(name, x)
            after = m.live
            loss.backward()
        del loss
        row = {"eager_after_forward_MiB": after / MiB, "eager_peak_MiB": m.peak / MiB}
        try:
            func_step(name)
            with LiveBytes() as m:
                func_step(name)
            row["grad_peak_MiB"] = m.peak / MiB
        except RuntimeError as e:
            row["grad_peak_MiB"] = None
            row["grad_error"] = str(e).splitlines()[0][:80]
        results[name] = row

    reps = 3 if quick else 9
    times = {n: [] for n in variants}
    ftimes = {n: [] for n in variants}
    for _ in range(reps):
        for n in variants:
            t0 = time.perf_counter()
            eager_step(n)
            times[n].append(time.perf_counter() - t0)
            if results[n].get("grad_peak_MiB") is not None:
                t0 = time.perf_counter()
                func_step(n)
                ftimes[n].append(time.perf_counter() - t0)
    base = statistics.median(times["no remat"])
    fbase = statistics.median(ftimes["no remat"])
    for n in variants:
        results[n]["eager_step_ms"] = statistics.median(times[n]) * 1e3
        results[n]["eager_time_vs_no_remat"] = statistics.median(times[n]) / base
        if ftimes[n]:
            results[n]["grad_step_ms"] = statistics.median(ftimes[n]) * 1e3
            results[n]["grad_time_vs_no_remat"] = statistics.median(ftimes[n]) / fbase
    return {"config": dict(d=d, heads=heads, seq=seq, batch=batch, depth=depth), "results": results}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    out = run(a.quick)
    print(f"# Policy trade-offs, transformer stack {out['config']} (torch {torch.__version__})\n")
    print("| variant | eager after fwd (MiB) | eager peak (MiB) | eager step (ms) | x no remat | grad peak (MiB) | grad step (ms) | x no remat |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for n, r in out["results"].items():
        gp = f"{r['grad_peak_MiB']:.1f}" if r.get("grad_peak_MiB") is not None else "fails"
        gs = f"{r['grad_step_ms']:.1f}" if "grad_step_ms" in r else "-"
        gx = f"{r['grad_time_vs_no_remat']:.2f}" if "grad_time_vs_no_remat" in r else "-"
        print(f"| {n} | {r['eager_after_forward_MiB']:.2f} | {r['eager_peak_MiB']:.2f} | {r['eager_step_ms']:.1f} | "
              f"{r['eager_time_vs_no_remat']:.2f} | {gp} | {gs} | {gx} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=2, default=str)
    return out


if __name__ == "__main__":
    main()
