"""remat_fn.distributed: partitioned saved activations across a process group.

Multi-process tests spawn 2 or 3 CPU ranks with the gloo backend (free port on
127.0.0.1, ``timeout=`` on the process group, and a join deadline after which
the spawned processes are killed) and run several scenarios per spawn to keep
start-up cost low.  Each scenario asserts inside the ranks; an exception on any
rank fails the test with its traceback.
"""

from __future__ import annotations

import datetime
import functools
import gc
import json
import os
import socket
import time

import pytest
import torch

import remat_fn
from remat_fn import distributed as rd
from remat_fn import random as rnd
from remat_fn.memory import LiveBytes

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)

D, NBLOCKS, ROWS = 32, 8, 64


# ---------------------------------------------------------------------------
# Model and data shared by the parent (single-process reference) and the ranks
# ---------------------------------------------------------------------------


def _params(d=D, n=NBLOCKS, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(d, d, generator=g, dtype=torch.float64) / d**0.5).to(dtype).requires_grad_()
            for _ in range(n)]


def _data(rows=ROWS, d=D, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, d, generator=g, dtype=torch.float64).to(dtype)


def _block(h, w):
    return torch.sin(h @ w) * 1.5  # sin saves its input: the matmul output (see sc_policy)


def _run(ws, x, wrap=None):
    h = x * 1.0  # an activation (has grad_fn): partitioned
    for w in ws:
        h = (wrap(_block) if wrap is not None else _block)(h, w)
    return h


def _grads(ws, x, wrap=None):
    for w in ws:
        w.grad = None
    x = x.detach().clone().requires_grad_()
    _run(ws, x, wrap).square().sum().backward()
    return [w.grad.clone() for w in ws] + [x.grad.clone()]


def _reference(rows, d, n, dtype):
    """Gradients of the model without remat, in this (single) process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run with one thread each
    try:
        return _grads(_params(d, n, dtype=dtype), _data(rows, d, dtype=dtype))
    finally:
        torch.set_num_threads(threads)


def _equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x - y).abs().max()


# ---------------------------------------------------------------------------
# Scenarios (run inside each rank)
# ---------------------------------------------------------------------------


def sc_grads(rank, world, out):
    """Same gradients as a single process (bitwise), and what was partitioned."""
    ref = torch.load(os.path.join(out, "ref.pt"))
    rows, d, n = ref["shape"]
    ws, x = _params(d, n, dtype=ref["dtype"]), _data(rows, d, dtype=ref["dtype"])
    for prefetch in (True, False):
        rd._reset_stats()
        g = _grads(ws, x, rd.remat(prefetch=prefetch))
        _equal(g, ref["grads"])
        # n block inputs partitioned, n weights (leaves requiring grad) kept whole
        assert rd._stats["partitioned"] == n and rd._stats["kept"] == n, rd._stats
        assert rd._stats["gathers"] == n, rd._stats
        assert rd._stats["prefetched"] == (n - 1 if prefetch else 0), rd._stats
    _equal(_grads(ws, x, remat_fn.remat), ref["grads"])


def sc_memory(rank, world, out):
    """Live bytes after forward: about 1/world of unpartitioned remat."""
    ws, x = _params(), _data().requires_grad_()  # like an embedding's output: has history
    live = {}
    for name, wrap in (("remat", remat_fn.remat), ("distributed", rd.remat)):
        with LiveBytes() as m:
            y = _run(ws, x, wrap)
            live[name] = m.live
            y.sum().backward()
            del y
    ratio = live["distributed"] / live["remat"]
    with open(os.path.join(out, f"memory{rank}.json"), "w") as f:
        json.dump(dict(live, ratio=ratio, world=world), f)
    # NBLOCKS inputs shrink to 1/world; the final output stays whole
    expect = (NBLOCKS / world + 1) / (NBLOCKS + 1)
    assert ratio <= expect + 0.01, (ratio, expect, live)


def sc_uneven(rank, world, out):
    """Byte counts not divisible by the world size, several dtypes, strides."""
    for dtype in (torch.float64, torch.float32, torch.float16):
        ws, x = _params(5, 3, dtype=dtype), _data(7, 5, dtype=dtype)  # 7x5 activations
        _equal(_grads(ws, x, rd.remat), _grads(ws, x))

    strides = []

    def f(a, b, c):
        strides.append((a.stride(), b.stride(), c.stride()))
        return (a.sin() @ b).cos() * c

    base = torch.randn(5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for wrap in (None, rd.remat):
        src = base.clone().requires_grad_()
        h = src * 2
        # transposed view; strided slice with gaps; expanded row of an activation
        a, b, c = h.t(), h[:, 1:4], h[:1, :3].expand(7, 3)
        y = (wrap(f) if wrap else f)(a, b, c)
        y.sum().backward()
        if wrap is None:
            expected = src.grad.clone()
            strides.clear()
        else:
            _equal([src.grad], [expected])
    # the function ran once: backward replays the recorded ops on the rebuilt
    # (gathered) inputs, whose layouts the gradients above show are right
    assert len(strides) == 1, strides


def sc_backward_twice(rank, world, out):
    """retain_graph: a second backward gathers again; create_graph: second order."""
    ws, x = _params(16, 3), _data(9, 16)
    x = x.requires_grad_()
    ref = torch.autograd.grad(_run(ws, x).pow(2).sum(), ws)
    y = _run(ws, x, rd.remat).pow(2).sum()
    g1 = torch.autograd.grad(y, ws, retain_graph=True)
    g2 = torch.autograd.grad(y, ws)
    _equal(g1, ref)
    _equal(g2, ref)

    def second(wrap):
        gx, = torch.autograd.grad(_run(ws, x, wrap).pow(2).sum(), x, create_graph=True)
        return torch.autograd.grad(gx.square().sum(), ws)

    for a, b in zip(second(rd.remat), second(None)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def sc_not_replicated(rank, world, out):
    """A group whose ranks hold different tensors is refused, not silently wrong."""
    ws = _params(8, 2)
    x = _data(5, 8, seed=100 + rank)  # different data on each rank
    y = _run(ws, x.requires_grad_(), rd.remat).sum()
    with pytest.raises(remat_fn.RematError, match="not identical on every rank"):
        y.backward()
    # check_replicated=False: no check (the user vouches for replication)
    for w in ws:
        w.grad = None
    xs = _data(5, 8, seed=7).requires_grad_()
    _run(ws, xs, rd.remat(check_replicated=False)).sum().backward()
    ref = _grads(ws, xs)
    _equal([w.grad for w in ws], ref[:-1])


def sc_torch_func(rank, world, out):
    """Under torch.func the function falls back to plain remat: correct, no collective."""
    ws, x = _params(8, 3), _data(6, 8)
    ps = [w.detach() for w in ws]

    def loss(ps, x, wrap):
        return _run(ps, x, wrap).square().sum()

    rd._reset_stats()
    g = torch.func.grad(loss)(ps, x, rd.remat)
    assert rd._stats["gathers"] == 0 and rd._stats["partitioned"] == 0, rd._stats
    _equal(g, torch.func.grad(loss)(ps, x, None))
    gv = torch.func.vmap(torch.func.grad(lambda xi: loss(ps, xi, rd.remat)))(x.unsqueeze(1))
    ref = torch.func.vmap(torch.func.grad(lambda xi: loss(ps, xi, None)))(x.unsqueeze(1))
    torch.testing.assert_close(gv, ref)


def sc_nesting(rank, world, out):
    """Inside / around plain remat, and under save_on_cpu: the slices go through them."""
    ws, x = _params(8, 4), _data(6, 8)
    ref = _grads(ws, x)

    def two(h, w1, w2):
        return rd.remat(_block)(_block(h, w1), w2)

    def seq(wrap_outer):
        def run(ws, x):
            h = x * 1.0
            h = wrap_outer(two)(h, ws[0], ws[1])
            h = wrap_outer(two)(h, ws[2], ws[3])
            return h
        return run

    for outer in (remat_fn.remat, rd.remat):
        for w in ws:
            w.grad = None
        xx = x.clone().requires_grad_()
        seq(outer)(ws, xx).square().sum().backward()
        _equal([w.grad for w in ws] + [xx.grad], ref)

    with torch.autograd.graph.save_on_cpu():
        _equal(_grads(ws, x, rd.remat), ref)


def sc_small_groups(rank, world, out):
    """Groups of one rank (and a 1-D mesh) degrade to plain remat; options pass through."""
    import torch.distributed as dist

    singles = [dist.new_group([r]) for r in range(world)]
    ws, x = _params(8, 3), _data(6, 8)
    ref = _grads(ws, x)
    rd._reset_stats()
    _equal(_grads(ws, x, rd.remat(group=singles[rank])), ref)
    assert rd._stats["partitioned"] == 0, rd._stats
    # explicit world group, min_bytes keeps small tensors whole
    rd._reset_stats()
    _equal(_grads(ws, x, rd.remat(group=dist.group.WORLD, min_bytes=10**6)), ref)
    assert rd._stats["partitioned"] == 0 and rd._stats["kept"] == 6, rd._stats
    # the decorator forms
    f1 = rd.remat(_block)
    f2 = rd.remat(group=None)(_block)

    @rd.remat
    def f3(h, w):
        return _block(h, w)

    assert f1.__name__ == "_block" and f1.__wrapped__ is _block and f3.__name__ == "f3"
    assert f1.remat_options["group"] is None and f1.remat_options["prefetch"] is True
    for f in (f1, f2, f3, rd.checkpoint(_block)):
        _equal(_grads(ws, x, lambda _b, f=f: f), ref)
    # a rank outside the group passed in is told so
    only0 = dist.new_group([0])
    if rank != 0:
        with pytest.raises(remat_fn.RematError, match="not a member"):
            rd.remat(_block, group=only0)(x.requires_grad_(), ws[0])


def sc_fold_in(rank, world, out):
    """fold_in(key, rank): different masks per rank, exact recompute."""
    import torch.distributed as dist

    k = rnd.fold_in(rnd.key(0), 5)  # the same base key on every rank
    local = rnd.fold_in(k, rank)
    x = _data(16, 32)  # replicated input
    w = _params(32, 1)[0]

    def f(h, w, key):
        return rnd.dropout(key, torch.tanh(h @ w), p=0.5)

    def grads(wrap):
        w.grad = None
        h = x.clone().requires_grad_()
        y = (wrap(f) if wrap else f)(h * 1.0, w, local)
        y.square().sum().backward()
        return y.detach(), [w.grad.clone(), h.grad.clone()]

    y_ref, g_ref = grads(None)
    y, g = grads(rd.remat)
    _equal([y] + g, [y_ref] + g_ref)
    masks = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(masks, (y != 0).to(y.dtype))
    for r in range(world):
        if r != rank:
            assert not torch.equal(masks[r], masks[rank]), "ranks drew the same mask"
    # the un-folded key gives the same mask everywhere (dropout on replicated values)
    same = rnd.dropout(k, torch.ones(64), 0.5)
    gathered = [torch.empty_like(same) for _ in range(world)]
    dist.all_gather(gathered, same)
    assert all(torch.equal(m, same) for m in gathered)


class _Block(torch.nn.Module):
    def __init__(self, d, wrap):
        super().__init__()
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d))
        self.wrap = wrap

    def forward(self, h):
        return h + (self.wrap(self.mlp) if self.wrap else self.mlp)(h)


class _Net(torch.nn.Module):
    """``inside``: remat runs inside each block (an FSDP unit); else it wraps the block."""

    def __init__(self, wrap, d=16, n=4, inside=True):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(d, d)
        self.blocks = torch.nn.ModuleList(_Block(d, wrap if inside else None) for _ in range(n))
        self.wrap = None if inside else wrap

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = (self.wrap(b) if self.wrap else b)(h)
        return h.square().mean()


def _step(model, x, lr=0.1):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    opt.zero_grad()
    model(x).backward()
    opt.step()


def sc_ddp(rank, world, out):
    """A DDP step with distributed remat equals one without (same data on every rank)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    x = _data(12, 16, seed=4)
    results = []
    for wrap, inside in ((None, True), (rd.remat, True), (rd.remat, False), (remat_fn.remat, True)):
        rd._reset_stats()
        # tiny buckets: DDP's asynchronous allreduces interleave with the all-gathers
        model = DDP(_Net(wrap, inside=inside), bucket_cap_mb=0.001)
        _step(model, x)
        _step(model, x)
        results.append([p.detach().clone() for p in model.parameters()])
        if wrap is rd.remat:
            assert rd._stats["gathers"] == 2 * 4, rd._stats
    for r in results[1:]:
        _equal(r, results[0])


def sc_fsdp2(rank, world, out):
    """FSDP2 (fully_shard) steps with distributed remat equal steps without.

    Verified: remat inside each FSDP unit (default reshard_after_forward=True),
    and remat around each FSDP unit with reshard_after_forward=False.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # a CPU mesh: on a machine with CUDA the default mesh would be a CUDA one
    mesh = init_device_mesh("cpu", (world,))

    x = _data(12, 16, seed=4)

    def train(wrap, inside, reshard):
        rd._reset_stats()
        model = _Net(wrap, inside=inside)
        for b in model.blocks:
            fully_shard(b, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh)
        _step(model, x)
        _step(model, x)
        if wrap is rd.remat:
            assert rd._stats["gathers"] == 2 * 4, rd._stats
        return [p.full_tensor().detach().clone() for p in model.parameters()]

    ref = train(None, True, True)
    _equal(train(rd.remat, True, True), ref)
    _equal(train(rd.remat, False, False), ref)


def sc_checkpoint_wrapper_fsdp2(rank, world, out):
    """torch's apply_activation_checkpointing (the FSDP2 / torchtitan pattern) with
    checkpoint_fn=remat_fn.compat.checkpoint: FSDP2 steps equal steps without
    checkpointing, and the blocks really went through remat_fn."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # a CPU mesh: on a machine with CUDA the default mesh would be a CUDA one
    mesh = init_device_mesh("cpu", (world,))

    x = _data(12, 16, seed=5)
    calls = [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return remat_fn.compat.checkpoint(*args, **kwargs)

    def train(ckpt):
        model = _Net(None)
        if ckpt:
            apply_activation_checkpointing(
                model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_fn=counted),
                check_fn=lambda m: isinstance(m, _Block))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        _step(model, x)
        _step(model, x)
        return [p.full_tensor().detach().clone() for p in model.parameters()]

    ref = train(False)
    _equal(train(True), ref)
    assert calls[0] == 2 * 4, calls


def sc_policy(rank, world, out):
    """Values a policy saves (dots_saveable: the matmul outputs) are partitioned too."""
    ws, x = _params(), _data().requires_grad_()
    ref = _grads(ws, x)
    dots = remat_fn.policies.dots_saveable
    rd._reset_stats()
    _equal(_grads(ws, x, rd.remat(policy=dots)), ref)
    # 8 block inputs + 8 saved matmul outputs partitioned; 8 weights kept whole
    assert rd._stats["partitioned"] == 2 * NBLOCKS and rd._stats["kept"] == NBLOCKS, rd._stats
    live = {}
    for name, wrap in (("remat", remat_fn.remat(policy=dots)), ("distributed", rd.remat(policy=dots))):
        with LiveBytes() as m:
            y = _run(ws, x, wrap)
            live[name] = m.live
            y.sum().backward()
            del y
    assert live["distributed"] <= (0.5 + 0.5 / (2 * NBLOCKS + 1)) * live["remat"] + 256, live


SCENARIOS = {f.__name__[3:]: f for f in (
    sc_policy,
    sc_grads, sc_memory, sc_uneven, sc_backward_twice, sc_not_replicated, sc_torch_func,
    sc_nesting, sc_small_groups, sc_fold_in, sc_ddp, sc_fsdp2, sc_checkpoint_wrapper_fsdp2,
)}


# ---------------------------------------------------------------------------
# Spawning
# ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, names, out):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        for name in names:
            try:
                SCENARIOS[name](rank, world, out)
            except BaseException as e:
                _note(out, name, rank, f"failed on rank {rank}: {e!r}")
                raise  # the collectives of the remaining scenarios would not line up
            _note(out, name, rank, None)
            dist.barrier()
    finally:
        # DDP/FSDP objects left in reference cycles hold the process group and its
        # threads; collect them while the group is alive, not at interpreter exit
        # (where gloo's threads abort the process: "terminate called without an
        # active exception", seen about once in six runs).
        gc.collect()
        dist.destroy_process_group()


def _note(out, name, rank, error):
    with open(os.path.join(out, f"result-{name}-{rank}.json"), "w") as f:
        json.dump({"error": error}, f)


def _spawn(world, names, out, deadline_s=90.0):
    """Run ``names`` in order on ``world`` ranks; returns ``None`` or why the run failed."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(
        _worker, args=(world, _free_port(), list(names), str(out)), nprocs=world,
        join=False, start_method="spawn",
    )
    deadline = time.monotonic() + deadline_s
    try:
        while True:
            try:
                if ctx.join(timeout=1.0):
                    return None
            except Exception as e:  # a rank failed: the scenario's own note says which
                return repr(e)
            if time.monotonic() > deadline:
                return f"the {world}-rank run did not finish in {deadline_s:.0f} s"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


def _write_ref(out, rows, d, n, dtype):
    torch.save(dict(grads=_reference(rows, d, n, dtype), shape=(rows, d, n), dtype=dtype),
                os.path.join(out, "ref.pt"))


# One spawned group per world size runs every scenario in turn (starting ranks
# costs seconds); each scenario is then reported as its own test.
RUNS = {
    2: dict(shape=(ROWS, D, NBLOCKS), max_memory_ratio=0.65, scenarios=[
        "grads", "memory", "uneven", "backward_twice", "not_replicated", "torch_func", "nesting",
        "small_groups", "fold_in", "ddp", "fsdp2", "policy", "checkpoint_wrapper_fsdp2"]),
    # 7x5 activations: 140 bytes over 3 ranks (47-byte slices, 1 byte of padding)
    3: dict(shape=(7, 5, 4), max_memory_ratio=0.45, scenarios=["grads", "memory", "uneven", "fold_in", "ddp"]),
}
_runs: dict[int, tuple] = {}


def _run_group(world, tmp_path_factory):
    if world not in _runs:
        out = tmp_path_factory.mktemp(f"ranks{world}")
        spec = RUNS[world]
        _write_ref(out, *spec["shape"], torch.float32)
        _runs[world] = (out, _spawn(world, spec["scenarios"], out))
    return _runs[world]


@pytest.mark.parametrize("world,name", [(w, n) for w, spec in RUNS.items() for n in spec["scenarios"]],
                         ids=lambda v: f"{v}ranks" if isinstance(v, int) else v)
def test_scenario(world, name, tmp_path_factory):
    out, failure = _run_group(world, tmp_path_factory)
    for r in range(world):
        path = os.path.join(out, f"result-{name}-{r}.json")
        if not os.path.exists(path):
            pytest.fail(f"scenario {name!r} did not run on rank {r} ({failure or 'no result'})")
        with open(path) as f:
            err = json.load(f)["error"]
        assert err is None, f"scenario {name!r} {err}"
    if name == "memory":
        for r in range(world):
            with open(os.path.join(out, f"memory{r}.json")) as f:
                m = json.load(f)
            assert m["ratio"] <= RUNS[world]["max_memory_ratio"], m


# ---------------------------------------------------------------------------
# Single process: no process group
# ---------------------------------------------------------------------------


def test_no_process_group_is_plain_remat():
    assert not torch.distributed.is_initialized()
    ws, x = _params(8, 3), _data(6, 8)
    ref = _grads(ws, x)
    rd._reset_stats()
    for f in (rd.remat, rd.remat(), rd.remat(prefetch=False, min_bytes=4)):
        _equal(_grads(ws, x, f if f is not rd.remat else rd.remat), ref)
    assert rd._stats == {k: 0 for k in rd._stats}
    g = torch.func.grad(lambda x: _run([w.detach() for w in ws], x, rd.remat).sum())(x)
    torch.testing.assert_close(g, torch.func.grad(lambda x: _run([w.detach() for w in ws], x).sum())(x))


def test_wrapper_pickles_and_deep_copies_with_what_it_wraps():
    import copy
    import io
    import pickle

    f = rd.remat(_block, prefetch=False, min_bytes=4, policy=remat_fn.policies.dots_saveable)
    g = pickle.loads(pickle.dumps(f))
    assert g is not f and g.__wrapped__ is _block and g.remat_options == f.remat_options
    assert g._opts.outer_hooks is not None  # rebuilt by remat_fn.distributed.remat: still partitions
    ws, x = _params(8, 3), _data(6, 8)
    _equal(_grads(ws, x, lambda _b: g), _grads(ws, x))
    # a module holding a distributed remat of its submodule: the copy calls its own submodule
    holder = torch.nn.Module()
    holder.sub = torch.nn.Linear(3, 3)
    holder.f = rd.remat(holder.sub, min_bytes=4)
    buf = io.BytesIO()
    torch.save(holder, buf)
    buf.seek(0)
    h = torch.randn(2, 3)
    for twin in (copy.deepcopy(holder), torch.load(buf, weights_only=False)):
        assert twin.f.__wrapped__ is twin.sub and twin.f.remat_options == holder.f.remat_options
        assert twin.f._opts.outer_hooks is not None
        with torch.no_grad():
            twin.sub.weight.add_(1.0)
        assert torch.equal(twin.f(h), twin.sub(h)) and not torch.equal(twin.f(h), holder.f(h))
    # an option that does not pickle (a lambda) fails loudly, as for any object holding one
    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickle.dumps(rd.remat(_block, should_partition=lambda t: True))


def test_default_should_partition():
    w = torch.nn.Parameter(torch.randn(4, 4))
    leaf = torch.randn(4, 4, requires_grad=True)
    act = leaf * 2
    assert rd.default_should_partition(act)
    assert rd.default_should_partition(act.t())  # view of an activation
    assert rd.default_should_partition(act[:, 1:3])  # strided view with gaps (qkv.split)
    assert rd.default_should_partition(act[:1].expand(3, 4))  # sent unexpanded
    assert not rd.default_should_partition(act.as_strided((3, 3), (1, 1)))  # overlapping
    assert not rd.default_should_partition(w)
    assert not rd.default_should_partition(leaf)
    assert not rd.default_should_partition(w.t())  # alias of a parameter
    assert not rd.default_should_partition(torch.randn(4))  # data, no history
    assert not rd.default_should_partition(act[:0])


def test_bad_arguments():
    with pytest.raises(TypeError):
        rd.remat(_block, min_bytes=-1)
    with pytest.raises(TypeError):
        rd.remat(_block, should_partition=3)
    with pytest.raises(TypeError):
        rd.remat(3)
