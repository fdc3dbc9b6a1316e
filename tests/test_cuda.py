"""The CUDA paths, run on a GPU (skipped where there is none, as in CI).

What these check needs a real device: autocast on ``cuda``, the CUDA RNG state
snapshot around recomputation, offloading into pinned host memory on a side
stream, keys drawn on the device, and memory as the CUDA caching allocator
counts it (``torch.cuda.max_memory_allocated``), eager and under ``torch.func``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tc

import remat_fn
from remat_fn import policies
from remat_fn import random as rnd

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = "cuda"


def _block(x, w1, w2):
    return torch.tanh(torch.tanh(x @ w1) @ w2)


def _params(n=64, dtype=torch.float32, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(32, n, device=DEV, dtype=dtype, generator=g, requires_grad=True)
    w1 = torch.randn(n, n, device=DEV, dtype=dtype, generator=g, requires_grad=True)
    w2 = torch.randn(n, n, device=DEV, dtype=dtype, generator=g, requires_grad=True)
    return x, w1, w2


def _grads(loss, ts):
    return torch.autograd.grad(loss, ts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_autocast_eager_matches_torch_checkpoint(dtype):
    x, w1, w2 = _params()
    with torch.autocast("cuda", dtype=dtype):
        ours = remat_fn.remat(_block)(x, w1, w2)
        theirs = tc.checkpoint(_block, x, w1, w2, use_reentrant=False)
    assert ours.dtype == dtype
    g1 = _grads(ours.float().sum(), (x, w1, w2))
    g2 = _grads(theirs.float().sum(), (x, w1, w2))
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_cuda_autocast_under_torch_func_grad_matches_plain():
    x, w1, w2 = _params()

    def loss(f, w1):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return f(x.detach(), w1, w2.detach()).float().sum()

    plain = torch.func.grad(lambda w: loss(_block, w))(w1.detach())
    ours = torch.func.grad(lambda w: loss(remat_fn.remat(_block), w))(w1.detach())
    assert torch.equal(plain, ours)


def _dropout_block(x, w):
    return F.dropout(torch.tanh(x @ w), p=0.5, training=True) @ w


@pytest.mark.parametrize("policy", [None, policies.dots_saveable])
def test_cuda_rng_state_replayed_eager(policy):
    x, w, _ = _params()
    torch.cuda.manual_seed(7)
    ref = _dropout_block(x, w)
    g_ref = _grads(ref.sum(), (x, w))
    after_ref = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(7)
    out = remat_fn.remat(_dropout_block, policy=policy)(x, w)
    after = torch.cuda.get_rng_state()
    g = _grads(out.sum(), (x, w))
    assert torch.equal(out, ref)
    assert torch.equal(after, after_ref)  # recompute restored the state it changed
    assert torch.equal(torch.cuda.get_rng_state(), after_ref)
    for a, b in zip(g, g_ref):
        assert torch.equal(a, b)


def test_cuda_rng_state_replayed_under_torch_func_grad():
    x, w, _ = _params()
    xd = x.detach()
    torch.cuda.manual_seed(3)
    ref = torch.func.grad(lambda w: _dropout_block(xd, w).sum())(w.detach())
    after_ref = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(3)
    ours = torch.func.grad(lambda w: remat_fn.remat(_dropout_block)(xd, w).sum())(w.detach())
    assert torch.equal(ours, ref)
    assert torch.equal(torch.cuda.get_rng_state(), after_ref)


def test_cuda_keys_draw_on_device_and_replay():
    x, w, _ = _params()
    k = rnd.key(0)

    def f(x, w, k):
        return rnd.dropout(k, torch.tanh(x @ w), p=0.3) @ w

    out = remat_fn.remat(f)(x, w, k)
    assert out.device.type == "cuda"
    g = _grads(out.sum(), (x, w))
    g_ref = _grads(f(x, w, k).sum(), (x, w))
    for a, b in zip(g, g_ref):
        assert torch.equal(a, b)
    grad_func = torch.func.grad(lambda w: remat_fn.remat(f)(x.detach(), w, k).sum())(w.detach())
    assert torch.equal(grad_func, g_ref[1])


def test_cuda_offload_to_pinned_host_on_side_stream():
    from remat_fn._offload import Offloader

    t = torch.randn(256, 256, device=DEV)
    off = Offloader()
    s = off.put(t, torch.device("cpu"))
    assert s.host.device.type == "cpu" and s.host.is_pinned()
    side = Offloader._streams[str(t.device)]
    assert side != torch.cuda.current_stream() and s.event is not None
    off.prefetch(s)
    assert s.back is not None and s.back_event is not None  # issued on the side stream
    back = off.fetch(s)
    assert back.device == t.device and torch.equal(back, t)
    assert (off.to_dst, off.to_src) == (1, 1)
    # a transposed (dense) tensor comes back with its strides
    tt = t.t()
    back = off.fetch(off.put(tt, torch.device("cpu")))
    assert back.stride() == tt.stride() and torch.equal(back, tt)


def _sin_block(x, w1, w2):
    return torch.sin(torch.sin(x @ w1) @ w2)  # sin saves its input: the matmul outputs


@pytest.mark.parametrize("path", ["eager", "grad"])
def test_cuda_offload_policy_gradients(path):
    x, w1, w2 = _params()
    pol = policies.offload_dot_with_no_batch_dims(offload_src="cuda", offload_dst="cpu")
    f = remat_fn.remat(_sin_block, policy=pol)
    if path == "eager":
        g = _grads(f(x, w1, w2).sum(), (x, w1, w2))
        g_ref = _grads(_sin_block(x, w1, w2).sum(), (x, w1, w2))
    else:
        args = (x.detach(), w1.detach(), w2.detach())
        g = torch.func.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2))(*args)
        g_ref = torch.func.grad(lambda *a: _sin_block(*a).sum(), argnums=(0, 1, 2))(*args)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b)
    res = remat_fn.saved_residuals(f, x, w1, w2)
    offloaded = [r for r in res if r.kind == "offloaded"]
    assert len(offloaded) == 2 and all(r.device.type == "cpu" for r in offloaded), res
    # tanh saves its output, not the matmul's: _block offloads nothing (no dead copy)
    res = remat_fn.saved_residuals(remat_fn.remat(_block, policy=pol), x, w1, w2)
    assert not [r for r in res if r.kind == "offloaded"], res


def _blocks(n=8, width=1024, policy=None):
    torch.manual_seed(0)
    return torch.nn.ModuleList(
        remat_fn.nn.remat_module(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()), policy=policy)
        for _ in range(n)).to(DEV)


def _run_blocks(blocks, x):
    h = x * 1.0  # an activation, as an embedding's output
    for b in blocks:
        h = b(h)
    return h.square().mean()


@pytest.mark.parametrize("path", ["eager", "grad"])
@pytest.mark.parametrize("dst", ["cpu", "cuda"])
def test_cuda_offload_inputs_device_memory_falls_by_offloaded_bytes(path, dst):
    """cpu_checkpointing: the 8 block inputs leave the device (dst="cpu", pinned and
    pooled) or move into one contiguous device buffer (dst="cuda", DeepSpeed's
    contiguous_memory_optimization); gradients equal remat without offloading."""
    from remat_fn.memory import LiveBytes

    x = torch.randn(2048, 1024, device=DEV)
    kept, grads = {}, {}
    for name, pol in (("remat", None),
                      ("offload", policies.offload_inputs(offload_src="cuda", offload_dst=dst,
                                                          contiguous=dst == "cuda"))):
        blocks = _blocks(policy=pol)
        params = {k: v.detach() for k, v in blocks.named_parameters()}
        for _step in range(3):  # the last step is measured (pool and arena sized by then)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            with LiveBytes() as m:
                if path == "eager":
                    xr = x.clone().requires_grad_()
                    loss = _run_blocks(blocks, xr)
                    torch.cuda.synchronize()
                    kept[name] = (torch.cuda.memory_allocated() - base, m.offloaded)
                    for p in blocks.parameters():
                        p.grad = None
                    loss.backward()
                    grads[name] = [xr.grad] + [p.grad for p in blocks.parameters()]
                else:
                    loss, fn = torch.func.vjp(lambda p, x: _functional(blocks, p, x), params, x)
                    torch.cuda.synchronize()
                    kept[name] = (torch.cuda.memory_allocated() - base, m.offloaded)
                    grads[name] = list(fn(torch.ones((), device=DEV)))
                    del fn  # the step's graph (and what it keeps) goes before the next step
            del loss
    for a, b in zip(torch.utils._pytree.tree_leaves(grads["remat"]), torch.utils._pytree.tree_leaves(grads["offload"])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    (dev0, host0), (dev1, host1) = kept["remat"], kept["offload"]
    nbytes = 8 * 2048 * 1024 * 4
    key = "cpu" if dst == "cpu" else str(torch.device(DEV, torch.cuda.current_device()))
    assert host0 == {} and host1 == {key: nbytes}, kept
    if dst == "cpu":
        assert dev0 - dev1 >= nbytes - (1 << 20), kept  # device memory fell by the offloaded bytes


def _functional(blocks, params, x):
    h = x * 1.0
    for i, b in enumerate(blocks):
        sub = {k.split(".", 1)[1]: v for k, v in params.items() if k.startswith(f"{i}.")}
        h = torch.func.functional_call(b, sub, (h,))
    return h.square().mean()


def test_cuda_offload_pool_pinned_and_reused_over_20_steps():
    import gc

    from remat_fn.memory import clear_offload_pool, offload_pool_stats

    clear_offload_pool()
    in_use0 = offload_pool_stats()["in_use_bytes"]  # held by values other tests keep alive
    blocks = _blocks(n=4, width=256, policy=policies.offload_inputs(offload_src="cuda", offload_dst="cpu"))
    x = torch.randn(512, 256, device=DEV, requires_grad=True)
    seen = []
    for _ in range(20):
        _run_blocks(blocks, x).backward()
        gc.collect()
        s = offload_pool_stats()
        seen.append((s["allocations"], s["allocated_bytes"], s["in_use_bytes"] - in_use0))
    assert seen == [seen[0]] * 20 and seen[0][2] == 0, seen
    from remat_fn import _offload

    assert all(b.buf.is_pinned() for blocks_ in _offload.POOL.free.values() for b in blocks_)


def test_cuda_prefetch_brings_the_next_region_back_during_backward(monkeypatch):
    """When backward first fetches a region's inputs, the H2D copies of the region
    before it (the one backward reaches next) are already issued on the side stream."""
    from remat_fn._offload import Offloader

    ready = []
    orig = Offloader.fetch

    def fetch(self, s):
        prev = self.prev() if self.prev is not None else None
        out = orig(self, s)
        if prev is not None:
            ready.append(all(p.back is not None for p in prev._live()))
        return out

    monkeypatch.setattr(Offloader, "fetch", fetch)
    blocks = _blocks(n=6, width=512, policy=policies.offload_inputs(offload_src="cuda", offload_dst="cpu"))
    x = torch.randn(1024, 512, device=DEV, requires_grad=True)
    ref = torch.autograd.grad(_run_blocks(_blocks(n=6, width=512), x), x)[0]
    got = torch.autograd.grad(_run_blocks(blocks, x), x)[0]
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert ready and all(ready), ready


def test_cuda_record_stream_keeps_sources_alive_under_pressure():
    """Many steps with allocations between forward and backward: a source freed
    before its D2H copy finished (or a fetched copy before its H2D) would corrupt
    gradients; they stay bitwise equal to remat without offloading."""
    blocks = _blocks(n=6, width=512, policy=policies.offload_inputs(offload_src="cuda", offload_dst="cpu"))
    plain = _blocks(n=6, width=512)
    for i in range(10):
        x = torch.randn(1024, 512, device=DEV, generator=torch.Generator(device=DEV).manual_seed(i),
                        requires_grad=True)
        loss = _run_blocks(blocks, x)
        junk = [torch.randn(1024, 512, device=DEV) for _ in range(8)]  # reuse freed blocks now
        got = torch.autograd.grad(loss, x)[0]
        del junk
        ref = torch.autograd.grad(_run_blocks(plain, x), x)[0]
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


def _mlp(n_layers, width, batch):
    g = torch.Generator(device=DEV).manual_seed(0)
    ws = [torch.randn(width, width, device=DEV, generator=g) / width**0.5 for _ in range(n_layers)]
    x = torch.randn(batch, width, device=DEV, generator=g)
    return x, ws


def _layer(h, w):
    for _ in range(4):
        h = torch.tanh(h @ w)
    return h


def _peak_mib(step) -> float:
    step()  # warm-up: one-time allocations (cuBLAS workspaces, pools) are not the step's
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


@pytest.mark.parametrize("path", ["eager", "grad", "vmap_grad"])
def test_cuda_memory_peak_below_no_remat(path):
    if path == "vmap_grad":  # per-sample gradients of 8 sequences of 2048 tokens
        x, ws = _mlp(8, 512, 8 * 2048)
        x = x.view(8, 2048, 512)
    else:
        x, ws = _mlp(8, 1024, 4096)

    def loss(ws, x, layer):
        h = x
        for w in ws:
            h = layer(h, w)
        return h.square().mean()

    def step(layer):
        if path == "eager":
            wr = [w.clone().requires_grad_() for w in ws]
            return lambda: loss(wr, x, layer).backward()
        if path == "grad":
            return lambda: torch.func.grad(loss)(ws, x, layer)
        return lambda: torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, None))(ws, x, layer)

    plain = _peak_mib(step(_layer))
    ours = _peak_mib(step(remat_fn.remat(_layer)))
    print(f"\n[{path}] max_memory_allocated above start: no remat {plain:.0f} MiB, remat {ours:.0f} MiB")
    # Without remat each layer keeps its four tanh outputs; with remat only the
    # 8 layer inputs plus the layer being recomputed.
    assert ours < 0.6 * plain, (plain, ours)
    if path == "eager":
        theirs = _peak_mib(step(lambda h, w: tc.checkpoint(_layer, h, w, use_reentrant=False)))
        print(f"[{path}] torch.utils.checkpoint {theirs:.0f} MiB")
        assert ours <= theirs * 1.05 + 1, (ours, theirs)
