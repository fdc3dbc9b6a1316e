"""Offloading (issue 20): region inputs offloaded (DeepSpeed's ``cpu_checkpointing``),
no copy that backward does not fetch, pooled buffers reused across steps, the
contiguous arena, prefetching, accounting, and every entry point (``remat``,
``compat.checkpoint``, ``remat_sequential``, ``remat_scan``, ``remat_fn.nn``,
``remat_fn.distributed``), eager and under ``torch.func``.

On this CPU-only CI the source and destination are both ``"cpu"``: the copies,
the pool, the arena and the prefetch order run exactly as on CUDA, with the
stream events replaced by synchronous copies (``tests/test_cuda.py`` runs the
CUDA side).
"""

from __future__ import annotations

import copy
import datetime
import functools
import gc
import os
import socket
import time

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import remat_fn
from remat_fn import checkpoint_name, compat, remat, remat_scan, remat_sequential, saved_residuals
from remat_fn import policies as P
from remat_fn._offload import Offloader, Stored
from remat_fn.memory import LiveBytes, clear_offload_pool, offload_pool_stats
from remat_fn.nn import remat_module

CPU = dict(offload_src="cpu", offload_dst="cpu")
INPUTS = P.offload_inputs(leaves=True, **CPU)  # DeepSpeed's rule: every floating-point argument


def _stored(offloaders):
    return [s for o in offloaders for w in o.stored if (s := w()) is not None]


# ---------------------------------------------------------------------------
# DeepSpeed's activation-checkpointing cases, with cpu_checkpointing
# (tests/unit/activation_checkpointing/test_activation_checkpointing.py)
# ---------------------------------------------------------------------------

HIDDEN = 20


class MaskedLinear(torch.nn.Linear):
    def forward(self, x, mask):
        out = super().forward(x)
        return out * mask if mask.is_floating_point() else out * mask.type_as(out)


class MaskedLinearSeq(MaskedLinear):
    def forward(self, x, mask):
        return super().forward(x, mask), mask


class MaskedLinearSeqDup(MaskedLinearSeq):
    def forward(self, x, mask):
        dup = x.clone().detach() * 1.38
        x, mask = super().forward(x, mask)
        return dup, x, mask


class DropMaskLinear(torch.nn.Linear):
    def forward(self, x, mask):
        return super().forward(x)


class LinearNonTensorInput(torch.nn.Linear):
    def forward(self, x, non_tensor_input):
        return super().forward(x)


class LinearNonTensorOutput(torch.nn.Linear):
    def __init__(self, non_tensor_output):
        super().__init__(HIDDEN, HIDDEN)
        self.non_tensor_output = non_tensor_output

    def forward(self, x):
        return super().forward(x), self.non_tensor_output


def _mask(kind):
    g = torch.Generator().manual_seed(7)
    m = torch.randn(HIDDEN, generator=g) > 0
    return m if kind == "bool" else m.float()


def _compute(module, inputs, wrap):
    fn = wrap(module) if wrap is not None else module
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    sum(o.sum() for o in outs if torch.is_tensor(o) and o.requires_grad).backward()
    return outs, [p.grad for p in module.parameters()], [x.grad for x in inputs if torch.is_tensor(x)]


def _match(a, b):
    assert type(a) is type(b)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _match(x, y)
    elif torch.is_tensor(a):
        assert torch.equal(a, b), (a - b).abs().max()
    else:
        assert a == b


def _ds_case(module, *inputs, unread=()):
    """DeepSpeed's check (outputs, parameter and input gradients equal to no
    checkpointing), with every floating-point argument offloaded between forward
    and backward: the region holds host copies of exactly those.  ``unread``:
    positions (in the flattened arguments) of tensors the module never reads; since
    the recorded-forward redesign backward needs nothing of them, so they are neither
    held nor copied (DeepSpeed copies them anyway)."""
    module.eval()
    base = _compute(copy.deepcopy(module), copy.deepcopy(inputs), None)
    mod = copy.deepcopy(module)
    ins = copy.deepcopy(inputs)
    offl = [x for i, x in enumerate(torch.utils._pytree.tree_leaves(ins))
            if torch.is_tensor(x) and x.is_floating_point() and i not in unread]
    made = []
    orig = Offloader.put

    def put(self, t, dst, contiguous=False, input=False):
        made.append((t, input))
        return orig(self, t, dst, contiguous, input)

    Offloader.put = put
    try:
        with LiveBytes() as m:
            out = remat(mod, policy=INPUTS)(*ins)
            held = m.offloaded.get("cpu", 0)
        outs = out if isinstance(out, tuple) else (out,)
        # every floating-point argument went to the host, unless an output *is* it
        # (MaskedLinearSeq returns its mask: the output keeps it alive anyway)
        returned = {id(o) for o in outs if torch.is_tensor(o)}
        expect = [x for x in offl if id(x) not in returned]
        assert [id(t) for t, is_input in made if is_input] == [id(x) for x in expect]
        assert held == sum(x.numel() * x.element_size() for x in expect)
        sum(o.sum() for o in outs if torch.is_tensor(o) and o.requires_grad).backward()
    finally:
        Offloader.put = orig
    test = (outs, [p.grad for p in mod.parameters()], [x.grad for x in ins if torch.is_tensor(x)])
    for a, b in zip(base, test):
        _match(a, b)


@pytest.mark.parametrize("mask", ["bool", "float"])
class TestDeepSpeedCases:
    def test_ckpt_inputs1_outputs1(self, mask):
        _ds_case(torch.nn.Linear(HIDDEN, HIDDEN), torch.rand(HIDDEN).requires_grad_())

    def test_ckpt_inputs2_outputs1(self, mask):
        _ds_case(MaskedLinear(HIDDEN, HIDDEN), torch.rand(HIDDEN).requires_grad_(), _mask(mask))

    def test_ckpt_inputs2_outputs2(self, mask):
        _ds_case(MaskedLinearSeq(HIDDEN, HIDDEN), torch.rand(HIDDEN).requires_grad_(), _mask(mask))

    def test_ckpt_inputs2_outputs3(self, mask):
        _ds_case(MaskedLinearSeqDup(HIDDEN, HIDDEN), torch.rand(HIDDEN).requires_grad_(), _mask(mask))

    def test_ckpt_arg_none(self, mask):
        _ds_case(DropMaskLinear(HIDDEN, HIDDEN), torch.rand(HIDDEN).requires_grad_(), None)


@pytest.mark.parametrize("non_tensor", [None, 2, True, (None, 2.5), (None, True, torch.randn(HIDDEN))])
def test_ckpt_non_tensor_input_and_output(non_tensor):
    # a tensor inside the non-tensor argument is never read by the module: no copy
    # of it (changed with the recorded-forward redesign: copies only for what the
    # replay reads)
    leaves = torch.utils._pytree.tree_leaves((None, non_tensor))
    unread = tuple(1 + i for i, t in enumerate(leaves[1:]) if torch.is_tensor(t))
    _ds_case(LinearNonTensorInput(HIDDEN, HIDDEN), torch.rand(HIDDEN).requires_grad_(), non_tensor, unread=unread)
    _ds_case(LinearNonTensorOutput(non_tensor), torch.rand(HIDDEN).requires_grad_())


# ---------------------------------------------------------------------------
# Four checkpointed Linear(256, 256) layers (DeepSpeed's stacked cpu-offload test,
# and the figures of issue 20)
# ---------------------------------------------------------------------------


def _layers(n=4, dim=256, seed=1234):
    torch.manual_seed(seed)
    return torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(n))


def _stack(layers, x, call):
    h = x * 1.0  # an activation (as an embedding's output would be)
    for layer in layers:
        h = call(layer, h)
    return h


def _names_call(policy):
    def call(layer, h):
        return remat(layer, policy=policy)(checkpoint_name(h, "checkpoint"))
    return call


def _sac_offload_addmm(ctx, op, *args, **kwargs):
    if op is torch.ops.aten.addmm.default:
        return CheckpointPolicy.MUST_CPU_OFFLOAD
    return CheckpointPolicy.PREFER_RECOMPUTE


CALLS = {
    "offload_inputs": lambda layer, h: remat(layer, policy=P.offload_inputs(**CPU))(h),
    "offload_dot_with_no_batch_dims": lambda layer, h: remat(layer, policy=P.offload_dot_with_no_batch_dims(**CPU))(h),
    "save_and_offload_only_these_names": _names_call(
        P.save_and_offload_only_these_names(names_which_can_be_offloaded=["checkpoint"], **CPU)),
    "compat MUST_CPU_OFFLOAD": lambda layer, h: compat.checkpoint(
        layer, h, use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, _sac_offload_addmm)),
}


def _kept_after_forward(layers, x, call):
    """(device bytes, host bytes) the stack keeps for backward after its forward
    (the output itself not counted), and the output."""
    with LiveBytes() as m:
        out = _stack(layers, x, call)
        return m.live - out.untyped_storage().nbytes(), sum(m.offloaded.values()), out


# how many of the four layer inputs each policy offloads: the first input is made by
# a multiplication, which the matmul-based policies do not offload
OFFLOADED = {"offload_inputs": 4, "offload_dot_with_no_batch_dims": 3, "save_and_offload_only_these_names": 4,
             "compat MUST_CPU_OFFLOAD": 3}


@pytest.mark.parametrize("how", list(CALLS))
def test_stacked_layers_offload_their_inputs_and_no_dead_copies(how, offloaders):
    layers = _layers()
    x = torch.randn(8, 256)
    ref_layers = copy.deepcopy(layers)
    xr = x.clone().requires_grad_()
    _stack(ref_layers, xr, lambda layer, h: layer(h)).sum().backward()

    dev_plain, host_plain, out = _kept_after_forward(layers, x.clone().requires_grad_(),
                                                     lambda layer, h: remat(layer)(h))
    del out
    xt = x.clone().requires_grad_()
    dev, host, out = _kept_after_forward(layers, xt, CALLS[how])
    # without the policy the stack keeps the four layer inputs (4 x 8 KiB) on the
    # device; with it they are on the host, and nothing else is copied: not the
    # layers' outputs, which backward never fetches (issue 20: 4 such copies were made)
    n = OFFLOADED[how]
    assert (dev_plain, host_plain) == (4 * 8192, 0)
    assert (dev, host) == ((4 - n) * 8192, n * 8192)
    assert dev + host <= dev_plain + host_plain
    stored = _stored(offloaders)
    assert len(stored) == n and all(s.host.device.type == "cpu" for s in stored)
    out.sum().backward()
    # every copy was fetched exactly once
    assert [(o.to_dst, o.to_src) for o in offloaders if o.to_dst] == [(1, 1)] * n
    torch.testing.assert_close(xt.grad, xr.grad, rtol=0, atol=0)
    for p, q in zip(layers.parameters(), ref_layers.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_offload_policy_copies_only_what_autograd_saves(offloaders):
    """offload_dot_with_no_batch_dims inside a region: a copy is made only for a
    matmul output backward or its replay reads, and each copy is fetched.  (JAX's
    rule since the recorded-forward redesign: the output tanh consumes is read by
    the replay of tanh's saved output, so it is copied too; before: only 1 copy.)"""
    w = torch.randn(16, 16)

    def f(x):
        a = torch.tanh(x @ w)   # tanh saves its output, recomputed from x @ w: copied
        b = torch.sin(a @ w)    # sin saves its input: a @ w is copied
        return b + (x @ w)      # add's backward needs no value: x @ w here is not copied

    x = torch.randn(4, 16, requires_grad=True)
    y = remat(f, policy=P.offload_dot_with_no_batch_dims(**CPU))(x)
    assert [o.to_dst for o in offloaders] == [2]
    y.sum().backward()
    assert [o.to_src for o in offloaders] == [2]
    xr = x.detach().clone().requires_grad_()
    f(xr).sum().backward()
    assert torch.equal(x.grad, xr.grad)


# ---------------------------------------------------------------------------
# torch.func
# ---------------------------------------------------------------------------


def _func_model(policy, depth=4, width=64):
    torch.manual_seed(0)
    blocks = [remat_module(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()), policy=policy)
              for _ in range(depth)]
    return torch.nn.Sequential(*blocks)


@pytest.mark.parametrize("how", ["grad", "vjp"])
def test_torch_func_grad_offloads_inputs_and_matches(how, offloaders):
    x = torch.randn(8, 64)
    res = {}
    for name, pol in (("plain", None), ("offload", P.offload_inputs(**CPU))):
        net = _func_model(pol)
        params = {k: v.detach() for k, v in net.named_parameters()}

        def loss(params, x):
            return torch.func.functional_call(net, params, (x * 1.0,)).square().sum()

        if how == "grad":
            res[name] = torch.func.grad(loss, argnums=(0, 1))(params, x)
        else:
            with LiveBytes() as m:
                _, fn = torch.func.vjp(loss, params, x)
                res[name + "_kept"] = (m.live, sum(m.offloaded.values()))
                res[name] = fn(torch.ones(()))
    for a, b in zip(torch.utils._pytree.tree_leaves(res["plain"]), torch.utils._pytree.tree_leaves(res["offload"])):
        assert torch.equal(a, b)
    # every block's input was offloaded (x * 1.0 included: it depends on x) and came back
    assert sum(o.to_dst for o in offloaders) == 4 and sum(o.to_src for o in offloaders) == 4
    if how == "vjp":  # the four inputs (64 x 8 x 4 bytes each) left the device
        (dev0, host0), (dev1, host1) = res["plain_kept"], res["offload_kept"]
        assert host0 == 0 and host1 == 4 * 8 * 64 * 4
        assert dev0 - dev1 == host1


def test_torch_func_keeps_inputs_an_outer_level_differentiates():
    """grad(grad(...)) and vmap(grad): the saved input is differentiated again or
    batched, so it is kept as is (no copy) and the result stays exact."""
    w = torch.randn(8, 8) / 3
    f = remat(lambda x: torch.sin(x @ w).sum(), policy=P.offload_inputs(leaves=True, **CPU))
    g = lambda x: torch.sin(x @ w).sum()  # noqa: E731
    x = torch.randn(3, 8)
    before = offload_pool_stats()["to_dst"]
    assert torch.allclose(torch.func.grad(lambda x: torch.func.grad(f)(x).sum())(x),
                          torch.func.grad(lambda x: torch.func.grad(g)(x).sum())(x))
    assert torch.allclose(torch.func.vmap(torch.func.grad(f))(x), torch.func.vmap(torch.func.grad(g))(x))
    assert offload_pool_stats()["to_dst"] == before


# ---------------------------------------------------------------------------
# Pooled buffers, contiguous arena
# ---------------------------------------------------------------------------


def _steps(step, n):
    allocs = []
    for _ in range(n):
        step()
        gc.collect()
        s = offload_pool_stats()
        allocs.append((s["allocations"], s["allocated_bytes"], s["arena_allocations"], s["in_use_bytes"]))
    return allocs


@pytest.mark.parametrize("path", ["eager", "grad"])
@pytest.mark.parametrize("contiguous", [False, True])
def test_buffers_are_reused_across_20_steps(path, contiguous):
    clear_offload_pool()
    s0 = offload_pool_stats()
    pol = P.offload_inputs(contiguous=contiguous, **CPU)
    net = _func_model(pol, depth=4, width=32)
    x = torch.randn(8, 32)
    params = {k: v.detach() for k, v in net.named_parameters()}

    def step():
        if path == "eager":
            net(x.requires_grad_() * 1.0).square().sum().backward()
        else:
            torch.func.grad(lambda p, x: torch.func.functional_call(net, p, (x * 1.0,)).square().sum(),
                            argnums=(0, 1))(params, x.detach())

    allocs = [(a - s0["allocations"], b - s0["allocated_bytes"], c - s0["arena_allocations"], d - s0["in_use_bytes"])
              for a, b, c, d in _steps(step, 20)]
    # every buffer is back in the pool after every step
    assert all(a[3] == 0 for a in allocs)
    if not contiguous:
        # step 1 sizes the pool (four inputs of 8 x 32 floats); no later step allocates anything
        assert allocs == [(4, 4 * 1024, 0, 0)] * 20
    else:
        # step 1 takes pooled buffers and measures; step 2 makes the one arena; then nothing
        assert allocs == [(4, 4 * 1024, 0, 0)] + [(4, 4 * 1024, 1, 0)] * 19


def test_pool_counts_allocations_once_per_shape():
    clear_offload_pool()
    before = offload_pool_stats()
    net = _func_model(P.offload_inputs(**CPU), depth=3, width=24)
    for _ in range(3):
        net(torch.randn(5, 24, requires_grad=True) * 1.0).sum().backward()
    gc.collect()
    s = offload_pool_stats()
    assert s["allocations"] - before["allocations"] == 3  # three inputs alive at once, one size
    assert s["reuses"] - before["reuses"] == 6
    clear_offload_pool()
    after = offload_pool_stats()
    # what stays reserved is what is in use (by values earlier tests keep alive), nothing idle
    assert after["reserved_bytes"] == after["in_use_bytes"] == before["in_use_bytes"]


def test_contiguous_copies_share_one_buffer(offloaders):
    clear_offload_pool()
    net = _func_model(P.offload_inputs(contiguous=True, **CPU), depth=4, width=32)
    x = torch.randn(8, 32, requires_grad=True)
    for _ in range(2):  # the first step sizes the arena
        net(x * 1.0).sum().backward()
    out = net(x * 1.0)
    stored = _stored(offloaders)
    assert len(stored) == 4
    assert len({s.host.untyped_storage().data_ptr() for s in stored}) == 1
    offsets = sorted(s.host.storage_offset() * s.host.element_size() for s in stored)
    assert offsets == [0, 1024, 2048, 3072]
    out.sum().backward()


# ---------------------------------------------------------------------------
# Prefetching: the region backward reaches next is brought back early
# ---------------------------------------------------------------------------


def test_first_fetch_of_a_region_prefetches_the_region_before_it(monkeypatch):
    events = []
    tags: dict[int, int] = {}
    orig_prefetch, orig_fetch, orig_put = Offloader.prefetch, Offloader.fetch, Offloader.put

    def prefetch(self, s):
        if not s.prefetched:
            events.append(("prefetch", tags[id(s)]))
        return orig_prefetch(self, s)

    def fetch(self, s):
        out = orig_fetch(self, s)
        events.append(("fetch", tags[id(s)]))  # (after the prefetches it started)
        return out

    def put(self, *a, **k):
        s = orig_put(self, *a, **k)
        tags[id(s)] = len(tags)
        return s

    monkeypatch.setattr(Offloader, "prefetch", prefetch)
    monkeypatch.setattr(Offloader, "fetch", fetch)
    monkeypatch.setattr(Offloader, "put", put)
    net = _func_model(P.offload_inputs(**CPU), depth=4, width=16)
    out = net(torch.randn(2, 16, requires_grad=True) * 1.0)
    assert isinstance(Stored, type) and len(tags) == 4
    out.sum().backward()
    # inputs 0..3 (forward order); backward: region 3 prefetches itself and region 2,
    # region 2's first fetch prefetches region 1, and so on
    assert events == [("prefetch", 3), ("prefetch", 2), ("fetch", 3), ("prefetch", 1), ("fetch", 2),
                      ("prefetch", 0), ("fetch", 1), ("fetch", 0)]


# ---------------------------------------------------------------------------
# Entry points: remat_sequential, remat_scan, remat_fn.nn, compat, names
# ---------------------------------------------------------------------------


def _same_grads(run, inputs, params):
    """``run(wrap)`` with and without offloading: same outputs and gradients."""
    got = []
    for offl in (False, True):
        for t in (*inputs, *params):
            t.grad = None
        out = run(offl)
        out.sum().backward()
        got.append([out.detach()] + [t.grad.clone() for t in (*inputs, *params)])
    for a, b in zip(*got):
        assert torch.equal(a, b)


def test_remat_sequential_and_remat_scan(offloaders):
    torch.manual_seed(0)
    seq = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(6)])
    x = torch.randn(4, 16, requires_grad=True)
    _same_grads(lambda offl: remat_sequential(seq, 3, x * 1.0, policy=P.offload_inputs(**CPU) if offl else None),
                [x], list(seq.parameters()))
    assert sum(o.to_dst for o in offloaders) == 2  # the inputs of the two rematerialised segments

    w = torch.randn(16, 16, requires_grad=True)
    xs = torch.randn(9, 16)

    def step(c, x):
        c = torch.tanh(c @ w + x)
        return c, c.sum()

    for checkpoints in ("all", "sqrt", 3):
        offloaders.clear()

        def run(offl, checkpoints=checkpoints):
            c, ys = remat_scan(step, x * 1.0, xs, checkpoints=checkpoints,
                               policy=P.offload_inputs(**CPU) if offl else None)
            return c.sum() + ys.sum()

        _same_grads(run, [x], [w])
        assert sum(o.to_dst for o in offloaders) > 0
        assert sum(o.to_dst for o in offloaders) == sum(o.to_src for o in offloaders)


def test_remat_module_apply_remat_and_compat(offloaders):
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()) for _ in range(3)]
    x = torch.randn(4, 16, requires_grad=True)
    params = [p for b in blocks for p in b.parameters()]

    def run(offl):
        h = x * 1.0
        for b in blocks:
            h = remat_module(copy.copy(b), policy=P.offload_inputs(**CPU))(h) if offl else b(h)
        return h

    _same_grads(run, [x], params)
    assert sum(o.to_dst for o in offloaders) == 3
    offloaders.clear()

    def run_compat(offl):
        h = x * 1.0
        for b in blocks:
            if offl:
                h = compat.checkpoint(b, checkpoint_name(h, "ckpt"), use_reentrant=False,
                                      context_fn=functools.partial(
                                          create_selective_checkpoint_contexts,
                                          P.save_and_offload_only_these_names(
                                              names_which_can_be_offloaded=["ckpt"], **CPU)))
            else:
                h = b(h)
        return h

    _same_grads(run_compat, [x], params)
    assert sum(o.to_dst for o in offloaders) == 3


def test_named_input_is_offloaded_only_with_an_offload_name(offloaders):
    w = torch.randn(8, 8, requires_grad=True)
    f = lambda h: torch.sin(h @ w)  # noqa: E731
    x = torch.randn(2, 8, requires_grad=True)
    keep = P.save_and_offload_only_these_names(names_which_can_be_saved=["h"], **CPU)
    offl = P.save_and_offload_only_these_names(names_which_can_be_offloaded=["h"], **CPU)
    remat(f, policy=keep)(checkpoint_name(x * 2, "h")).sum().backward()
    remat(f, policy=offl)(checkpoint_name(x * 2, "other")).sum().backward()
    assert sum(o.to_dst for o in offloaders) == 0
    remat(f, policy=offl)(checkpoint_name(x * 2, "h")).sum().backward()
    assert sum(o.to_dst for o in offloaders) == 1 and sum(o.to_src for o in offloaders) == 1


def _named_inside(layer, h):
    h = checkpoint_name(h, "checkpoint")  # the layer's input, named inside the region
    return torch.tanh(layer(h))


# DeepSpeed's cpu_checkpointing as docs/migration.md maps it, the name given inside the layer
NAMED_INSIDE = P.save_and_offload_only_these_names(names_which_can_be_saved=[],
                                                   names_which_can_be_offloaded=["checkpoint"], **CPU)


@pytest.mark.parametrize("how", ["eager", "grad", "vjp"])
def test_argument_named_inside_the_region_is_offloaded(how, offloaders):
    """checkpoint_name on a region's argument inside the region: the policy offloads it as
    it offloads an argument named before the call (it was kept on the device, reported as
    'saved'), eager and under torch.func, with the gradients of plain code."""
    layers = _layers()
    x = torch.randn(8, 256)
    params = {k: v.detach() for k, v in layers.named_parameters()}
    remat_call = lambda layer, h: remat(_named_inside, policy=NAMED_INSIDE)(layer, h)  # noqa: E731

    def loss(p, x, use):
        return torch.func.functional_call(layers, p, (x, remat_call if use else _named_inside),
                                          strict=True).square().sum()

    layers.forward = lambda x, call: _stack(layers, x, call)  # (functional_call swaps the parameters)
    if how == "eager":
        ref_layers = copy.deepcopy(layers)
        xr = x.clone().requires_grad_()
        _stack(ref_layers, xr, lambda layer, h: _named_inside(layer, h)).square().sum().backward()
        xt = x.clone().requires_grad_()
        dev, host, out = _kept_after_forward(layers, xt, remat_call)
        assert (dev, host) == (0, 4 * 8192)  # the four layer inputs left the device
        out.square().sum().backward()
        got, want = [xt.grad, *(p.grad for p in layers.parameters())], \
            [xr.grad, *(p.grad for p in ref_layers.parameters())]
    elif how == "grad":
        want = torch.func.grad(loss, argnums=(0, 1))(params, x, False)
        got = torch.func.grad(loss, argnums=(0, 1))(params, x, True)
    else:
        with LiveBytes() as m0:
            y0, fn0 = torch.func.vjp(lambda p, x: loss(p, x, False), params, x)
        with LiveBytes() as m1:
            y1, fn1 = torch.func.vjp(lambda p, x: loss(p, x, True), params, x)
            kept = m1.live, sum(m1.offloaded.values())
        assert kept[1] == 4 * 8192 and m0.live - kept[0] >= 4 * 8192
        want, got = fn0(torch.ones(())), fn1(torch.ones(()))
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert torch.equal(a, b), (a - b).abs().max()
    # each layer's input was copied once and fetched once
    assert [(o.to_dst, o.to_src) for o in offloaders if o.to_dst] == [(1, 1)] * 4
    res = saved_residuals(lambda x: _stack(layers, x, remat_call), x)
    assert [(r.kind, r.name, r.device.type) for r in res if r.kind != "closure"] == \
        [("offloaded", "checkpoint", "cpu")] * 4


def test_argument_named_inside_after_a_use_and_closures(offloaders):
    """Named after an op saved it: that op's save keeps the argument as is, the later
    ones read the copy (gradients as plain code); a tensor the region closes over,
    named the same, is not an argument and is never offloaded."""
    w = torch.randn(16, 16, requires_grad=True)

    def f(h):
        a = torch.sin(h)  # saves h before it is named
        h = checkpoint_name(h, "checkpoint")
        v = checkpoint_name(w, "checkpoint")
        return a * torch.tanh(h @ v)

    x = torch.randn(4, 16)
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = torch.autograd.grad((f(xr * 1.0)).sum(), [xr, w])
    got = torch.autograd.grad(remat(f, policy=NAMED_INSIDE)(xt * 1.0).sum(), [xt, w])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert [(o.to_dst, o.to_src) for o in offloaders if o.to_dst] == [(1, 1)]
    g = torch.func.grad(lambda x: remat(f, policy=NAMED_INSIDE)(x * 1.0).sum())(x)
    assert torch.equal(g, torch.func.grad(lambda x: f(x * 1.0).sum())(x))


def test_custom_policy_offloading_a_name_under_torch_func(offloaders):
    """A custom policy that offloads a name: eager, the argument named inside is
    offloaded; under torch.func only if the policy says so (``offloads_names``), else a
    warning names the fix and the argument stays on the device (gradients exact)."""
    w = torch.randn(16, 16)

    def pol(ctx, op, *args, **kwargs):
        return P.Offload("cpu", "cpu") if op is P.NAMED and kwargs.get("name") == "c" else False

    class Declared:
        offloads_names = True

        def __call__(self, ctx, op, *args, **kwargs):
            return pol(ctx, op, *args, **kwargs)

    def f(h):
        return torch.tanh(checkpoint_name(h, "c") @ w)

    x = torch.randn(4, 16)
    want = torch.func.grad(lambda x: f(x * 1.0).sum())(x)
    with pytest.warns(UserWarning, match="offloads_names = True"):
        g = torch.func.grad(lambda x: remat(f, policy=pol)(x * 1.0).sum())(x)
    assert torch.equal(g, want) and sum(o.to_dst for o in offloaders) == 0
    g = torch.func.grad(lambda x: remat(f, policy=Declared())(x * 1.0).sum())(x)
    assert torch.equal(g, want) and sum(o.to_dst for o in offloaders) == 1
    xt = x.clone().requires_grad_()
    remat(f, policy=pol)(xt * 1.0).sum().backward()
    assert torch.equal(xt.grad, want) and sum(o.to_dst for o in offloaders) == 2


def test_offload_inputs_rules():
    w = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4)
    a = (x * 1.0).requires_grad_()
    act = a * 2
    ctx = P.PolicyContext()
    pol = P.offload_inputs(**CPU)
    ask = functools.partial(pol, ctx, P.INPUT)
    assert isinstance(ask(act, name=None), P.Offload)  # an activation
    assert ask(x, name=None) is False  # a leaf: held by the caller anyway
    assert ask(act[0], name=None) is not False  # a view of an activation
    assert ask(w.t(), name=None) is False  # a view of a parameter
    assert isinstance(P.offload_inputs(leaves=True, **CPU)(ctx, P.INPUT, x, name=None), P.Offload)
    assert P.offload_inputs(min_bytes=1 << 20, **CPU)(ctx, P.INPUT, act, name=None) is False
    # other ops go to the wrapped policy
    assert P.offload_inputs(P.dots_saveable, **CPU)(ctx, torch.ops.aten.mm.default, x, x) is True
    with pytest.raises(remat_fn.PolicyError, match="memory_budget"):
        P.offload_inputs(P.memory_budget(0.5))
    with pytest.raises(remat_fn.PolicyError, match="min_bytes"):
        P.offload_inputs(min_bytes=-1)
    with pytest.raises(remat_fn.PolicyError, match="device"):
        P.offload_inputs(offload_dst="nowhere")
    # offload_src restricts: a CPU input is not offloaded from "cuda"
    f = remat(lambda h: torch.sin(h), policy=P.offload_inputs(offload_src="cuda", offload_dst="cpu"))
    before = offload_pool_stats()["to_dst"]
    f(act).sum().backward()
    assert offload_pool_stats()["to_dst"] == before


def test_retain_graph_fetches_again_and_create_graph_is_exact():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(3, 8, requires_grad=True)
    f = lambda h: torch.sin(h @ w)  # noqa: E731
    rf = remat(f, policy=P.offload_inputs(**CPU))
    y = rf(x * 1.0).square().sum()
    g1 = torch.autograd.grad(y, (x, w), retain_graph=True)
    g2 = torch.autograd.grad(y, (x, w))
    ref = torch.autograd.grad(f(x * 1.0).square().sum(), (x, w))
    for a, b, c in zip(g1, g2, ref):
        assert torch.equal(a, c) and torch.equal(b, c)
    gx, = torch.autograd.grad(rf(x * 1.0).square().sum(), x, create_graph=True)
    gx_ref, = torch.autograd.grad(f(x * 1.0).square().sum(), x, create_graph=True)
    assert torch.allclose(torch.autograd.grad(gx.sum(), w)[0], torch.autograd.grad(gx_ref.sum(), w)[0])


# ---------------------------------------------------------------------------
# Accounting: LiveBytes, profile(), saved_residuals
# ---------------------------------------------------------------------------


def test_accounting_reports_offloaded_bytes_by_destination():
    layers = _layers(dim=64)
    x = torch.randn(8, 64, requires_grad=True)
    call = CALLS["offload_dot_with_no_batch_dims"]
    with remat_fn.profile() as prof, LiveBytes() as m:
        out = _stack(layers, x, call)
        assert m.offloaded == {"cpu": 3 * 8 * 64 * 4}  # the inputs of layers 2-4 (matmul outputs)
        out.sum().backward()
    del out
    assert m.offloaded == {} and m.offloaded_peak == {"cpu": 3 * 8 * 64 * 4}
    r = prof.regions["Linear"]
    assert r.offloaded_bytes == {"cpu": 3 * 8 * 64 * 4}
    assert r.kept_bytes == 8 * 64 * 4  # only layer 1's input (made by a multiplication) stays
    assert prof.offloaded_bytes() == {"cpu": 3 * 8 * 64 * 4}
    assert "offloaded (MiB)" in prof.table() and "to cpu" in prof.table()

    res = saved_residuals(lambda x: _stack(layers, x, call).sum(), x)
    kinds = [(r.kind, r.op, r.source) for r in res if r.kind != "closure"]
    assert kinds[0][:2] == ("saved", "aten.mul")
    assert [k[:2] for k in kinds[1:]] == [("offloaded", "aten.addmm")] * 3
    assert all(str(r).endswith("(offloaded to cpu)") for r in res if r.kind == "offloaded")


def test_saved_residuals_shows_an_offloaded_argument_with_its_path():
    f = remat(lambda h: torch.sin(h), policy=P.offload_inputs(leaves=True, **CPU))
    res = saved_residuals(f, torch.randn(4, 4))
    assert [(r.kind, r.source, r.device.type, r.nbytes) for r in res] == [("offloaded", "args[0]", "cpu", 64)]


# ---------------------------------------------------------------------------
# remat_fn.distributed: partitioned and offloaded together
# ---------------------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist_model(h, ws, wrap):
    h = h * 1.0
    for w in ws:
        h = wrap(lambda h, w: torch.sin(h @ w))(h, w)
    return h.square().sum()


def _dist_worker(rank, world, port, out):
    import torch.distributed as dist

    from remat_fn import distributed as rd

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        g = torch.Generator().manual_seed(0)
        ws = [(torch.randn(16, 16, generator=g) / 4).requires_grad_() for _ in range(4)]
        x = torch.randn(10, 16, generator=g).requires_grad_()
        ref = torch.autograd.grad(_dist_model(x, ws, lambda f: f), [x, *ws])
        rd._reset_stats()
        made = []
        orig = Offloader.put

        def put(self, t, *a, **k):
            made.append((t.dtype, t.numel()))
            return orig(self, t, *a, **k)

        Offloader.put = put
        pol = P.offload_inputs(**CPU)
        with LiveBytes() as m:
            y = _dist_model(x, ws, lambda f: rd.remat(f, policy=pol))
            host = m.offloaded.get("cpu", 0)
        got = torch.autograd.grad(y, [x, *ws])
        for a, b in zip(got, ref):
            assert torch.equal(a, b), (a - b).abs().max()
        # the 4 block inputs are partitioned, and each rank's slice went to the host
        assert rd._stats["partitioned"] == 4 and rd._stats["offloaded"] == 4, rd._stats
        assert made == [(torch.uint8, 10 * 16 * 4 // world)] * 4, made
        assert host == 4 * (10 * 16 * 4 // world), host
        open(os.path.join(out, f"ok{rank}"), "w").close()
    finally:
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_distributed_partitions_and_offloads_the_slices(tmp_path):
    import torch.multiprocessing as mp

    world = 2
    ctx = mp.start_processes(_dist_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    try:
        while not ctx.join(timeout=1.0):
            assert time.monotonic() < deadline, "the 2-rank run did not finish"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert sorted(os.listdir(tmp_path)) == ["ok0", "ok1"]


@pytest.mark.parametrize("inplace", ["unsqueeze_transpose_", "t_"])
def test_offloaded_matmul_output_changed_by_an_in_place_metadata_op(inplace):
    """An offload policy kept the matmul's output itself (where it is not on the offload source
    device, and until the copy on it), so a later in-place metadata op in the region (``h.t_()``,
    ``h.unsqueeze_(0)``) changed the kept value's shape: gradients 9.95 off, or a shape error
    (found by a hostile pass).  It keeps an alias of its own now, as the save path does."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 4, dtype=torch.float64, generator=g), torch.randn(4, 6, dtype=torch.float64, generator=g)

    def body(x, w):
        h = x @ w
        if inplace == "t_":
            h.t_()
            return torch.tanh(h) @ x
        h.unsqueeze_(0)
        h.transpose_(0, 1)
        h.mul_(2)
        return torch.tanh(h)

    def grads(f):
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        f(a, b).pow(2).sum().backward()
        return a.grad, b.grad

    for got, want in zip(grads(remat(body, policy=P.offload_dot_with_no_batch_dims())), grads(body)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
