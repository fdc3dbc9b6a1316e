"""``offload``: region inputs offloaded (DeepSpeed's ``cpu_checkpointing``) on an 8-block model.

An 8-block pre-LN MLP stack (:class:`models.MLPStack`), each block one remat
region, one training step (forward + backward) eager and under
``torch.func.grad``, with:

- ``no remat``: plain autograd;
- ``remat``: full recomputation; what stays on the device between forward and
  backward is the 8 block inputs;
- ``offload_inputs()``: the same, with the block inputs copied to the host
  (pinned, pooled buffers and a side stream on CUDA; synchronous copies on CPU):
  DeepSpeed's ``checkpoint_in_cpu``, torchtune's ``OffloadActivations`` with
  activation checkpointing;
- ``offload_inputs(contiguous=True)``: the host copies carved out of one buffer;
- ``offload_inputs(offload_dst=<device>, contiguous=True)``: the inputs kept on
  the device, in one contiguous buffer (DeepSpeed's ``contiguous_checkpointing``);
- ``offload_inputs(min_bytes=...)`` above the inputs' size: nothing offloaded
  (torchtune's ``min_offload_size``);
- ``remat`` inside ``remat_fn.profile()`` (DeepSpeed's ``profile``).

Bytes: on CUDA ``torch.cuda.memory_allocated`` after the forward and
``max_memory_allocated`` over the step, above the start; on CPU the
:class:`remat_fn.memory.LiveBytes` live bytes after the forward and the step's
peak (the copies, held in pooled buffers, are reported apart as host bytes).
Times: interleaved rounds, median (min-max) and the per-round ratio to
``remat``.  On CPU the "device" is the host: the copies cost time and save
nothing; the section reports that as measured.  The same code runs on CUDA when
one is available (``python -m benchmarks --only offload``).
"""

from __future__ import annotations

import gc

import torch

import remat_fn
from remat_fn import policies
from remat_fn.memory import LiveBytes, offload_pool_stats

from .harness import MiB, Spread, interleaved, ratio, spread, table
from .models import MLPStack


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _variants(dev: str, input_bytes: int) -> dict:
    """label -> (what DeepSpeed / torchtune calls it, policy or "plain"; the profile row reuses remat)."""
    off = dict(offload_src=dev, offload_dst="cpu")
    return {
        "no remat": ("-", "plain"),
        "remat": ("checkpoint(...) / AC alone", None),
        "offload_inputs()": ("checkpoint_in_cpu=True; OffloadActivations() + AC", policies.offload_inputs(**off)),
        "offload_inputs(contiguous=True)": ("checkpoint_in_cpu + contiguous_checkpointing",
                                            policies.offload_inputs(contiguous=True, **off)),
        f"offload_inputs(offload_dst={dev!r}, contiguous=True)": (
            "contiguous_checkpointing=True", policies.offload_inputs(offload_src=dev, offload_dst=dev,
                                                                     contiguous=True)),
        f"offload_inputs(min_bytes={2 * input_bytes})": (
            f"OffloadActivations(min_offload_size={2 * input_bytes})",
            policies.offload_inputs(min_bytes=2 * input_bytes, **off)),
        "remat in remat_fn.profile()": ("profile=True", None),
    }


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def _measure(dev: str, fwd, bwd) -> dict:
    """Bytes on the device after the forward and at the step's peak, and host bytes held offloaded."""
    gc.collect()
    if dev == "cuda":
        _sync(dev)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with LiveBytes() as m:
            out = fwd()
            _sync(dev)
            after = torch.cuda.memory_allocated() - base
            host = sum(m.offloaded.values())
            bwd(out)
            del out
        _sync(dev)
        peak = torch.cuda.max_memory_allocated() - base
    else:
        with LiveBytes() as m:
            out = fwd()
            after = m.live
            host = sum(m.offloaded.values())
            bwd(out)
            del out
        peak = m.peak
    return {"after_fwd_MiB": after / MiB, "peak_MiB": peak / MiB, "host_MiB": host / MiB}


def run(quick: bool) -> dict:
    dev = _device()
    if dev == "cuda":
        # activations well above the parameters, so that the step's device peak (at the
        # start of backward, with every block input held) shows what offloading saves
        d, hidden, rows, reps = (1024, 4096, 16384, 5) if quick else (1024, 4096, 65536, 15)
    else:
        d, hidden, rows, reps = (128, 512, 256, 3) if quick else (512, 2048, 2048, 11)
    torch.manual_seed(0)
    net = MLPStack(d, hidden, 8).to(dev)
    x = torch.randn(rows, d, device=dev)
    params = {k: v.detach() for k, v in net.named_parameters()}
    variants = _variants(dev, rows * d * 4)

    def calls(policy):
        if isinstance(policy, str):
            return list(net.blocks)
        return [remat_fn.remat(b, policy=policy) for b in net.blocks]

    wrapped = {k: calls(pol) for k, (_, pol) in variants.items()}
    profiled = {k: k.endswith("profile()") for k in variants}

    def eager_step(k):
        def fwd():
            net.calls = wrapped[k]
            if profiled[k]:
                with remat_fn.profile():
                    return net(x.requires_grad_(True) * 1.0)
            return net(x.requires_grad_(True) * 1.0)  # the first block's input is an activation too

        def bwd(loss):
            net.zero_grad(set_to_none=True)
            x.grad = None
            if profiled[k]:
                with remat_fn.profile():
                    loss.backward()
            else:
                loss.backward()

        return fwd, bwd

    def func_step(k):
        def loss(p, x):
            net.calls = wrapped[k]
            return torch.func.functional_call(net, p, (x * 1.0,))

        def fwd():
            if profiled[k]:
                with remat_fn.profile():
                    return torch.func.vjp(loss, params, x.detach())
            return torch.func.vjp(loss, params, x.detach())

        def bwd(out):
            if profiled[k]:
                with remat_fn.profile():
                    out[1](torch.ones((), device=dev))
            else:
                out[1](torch.ones((), device=dev))

        return fwd, bwd

    rows_out = []
    for path, step in (("eager", eager_step), ("torch.func", func_step)):
        mem = {}
        for k in variants:
            fwd, bwd = step(k)
            for _ in range(2):  # warm-up: pools and arenas are sized by the first step
                bwd(fwd())
            mem[k] = _measure(dev, fwd, bwd)

        def timed(k, step=step):
            fwd, bwd = step(k)

            def go():
                bwd(fwd())
                _sync(dev)

            return go

        s = interleaved({k: timed(k) for k in variants}, repeats=reps, warmup=1)
        for k in variants:
            rows_out.append({"path": path, "variant": k, "maps": variants[k][0], **mem[k],
                             "ms": tuple(spread(s[k]).scaled(1e3)), "vs_remat": tuple(ratio(s[k], s["remat"]))})
    pool = offload_pool_stats()
    return {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "shape": [d, hidden, rows, 8],
            "rows": rows_out, "pool": {k: pool[k] for k in ("allocations", "allocated_bytes", "reuses",
                                                          "arena_allocations", "reserved_bytes")}}


def md(r: dict) -> str:
    d, hidden, rows, n = r["shape"]
    head = (f"Device: {r['device']}. {n} blocks (d={d}, hidden={hidden}), {rows} rows, fp32; "
            "bytes above the start of the step; time: median (min-max) of interleaved rounds, "
            "ratio to `remat` per round.\n\n")
    body = table(["path", "remat_fn", "DeepSpeed / torchtune", "device after fwd (MiB)", "device peak (MiB)",
                  "host (MiB)", "step (ms)", "step / remat"],
                 [[row["path"], f"`{row['variant']}`", row["maps"], f"{row['after_fwd_MiB']:.1f}",
                   f"{row['peak_MiB']:.1f}", f"{row['host_MiB']:.1f}", Spread(*row["ms"]).fmt(digits=1),
                   Spread(*row["vs_remat"]).fmt(digits=2, unit="x")] for row in r["rows"]],
                 "|---|---|---|---:|---:|---:|---:|---:|")
    p = r["pool"]
    tail = (f"\n\nOffload pool over the whole section: {p['allocations']} buffers allocated "
            f"({p['allocated_bytes'] / MiB:.1f} MiB), {p['reuses']} reuses, {p['arena_allocations']} "
            "contiguous arenas.")
    return head + body + tail


SECTIONS = {"offload": (run, md, "Offloading region inputs (cpu_checkpointing), 8 blocks")}
CHILDREN: dict = {}
