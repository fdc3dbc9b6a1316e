"""Behaviours of PyTorch's own checkpoint tests, ported to :mod:`remat_fn.compat`.

Sources (pytorch/pytorch): ``test/test_utils.py`` (``TestCheckpoint``),
``test/test_autograd.py`` (the ``test_checkpoint*`` tests of ``TestAutograd``,
``TestNestedCheckpoint`` and the selective-checkpoint tests).  Each test keeps the
name of the test it ports.  Behaviours not reproduced on purpose (errors of torch's
reentrant variant, warnings about ``use_reentrant``) are listed with the reason in
``docs/migration.md``; tests that need an accelerator are skipped without one.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import gc
import random
import weakref

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported lazily by the first call of a dynamo-disabled

# function, and that import keeps its caller's frame alive: with gc disabled, a leak-check
# would see the frame's locals)
import torch.utils.checkpoint as tc
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import remat_fn
from remat_fn import MutatedSavedTensorError, PolicyError, RecomputeMismatchError, RematError
from remat_fn.compat import checkpoint, checkpoint_sequential
from remat_fn.memory import LiveBytes

from ._util import assert_tree_close

ACCEL = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
needs_accelerator = pytest.mark.skipif(ACCEL is None, reason="needs an accelerator")


class OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


# =============================================================================
# test/test_utils.py :: TestCheckpoint
# =============================================================================
def _check_checkpoint_sequential(model, module_lists_to_compare, num_chunks, input, use_reentrant):
    out = model(input)
    out_not_checkpointed = out.detach().clone()
    model.zero_grad()
    out.sum().backward()
    grad_not_checkpointed = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    input_grad_not_checkpointed = input.grad.detach().clone()
    for model_to_compare in module_lists_to_compare:
        detached = input.detach().requires_grad_(True)
        out = checkpoint_sequential(model_to_compare, num_chunks, detached, use_reentrant=use_reentrant)
        out_checkpointed = out.detach().clone()
        model.zero_grad()
        out.sum().backward()
        grad_checkpointed = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        assert torch.equal(out_checkpointed, out_not_checkpointed)
        assert torch.equal(input_grad_not_checkpointed, detached.grad)
        for name in grad_checkpointed:
            assert torch.equal(grad_checkpointed[name], grad_not_checkpointed[name])


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_trigger(use_reentrant):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.counter = 0

        def forward(self, input_var):
            self.counter += 1
            return input_var * torch.tensor(2.0)

    modules = [Net() for _ in range(10)]
    input_var = torch.randn(3, 4, requires_grad=True)
    out = checkpoint_sequential(modules, 2, input_var, use_reentrant=use_reentrant)
    assert all(m.counter == 1 for m in modules)
    out.sum().backward()
    # deviation from torch (docs/migration.md): x * torch.tensor(2.0) saves the tensor
    # made inside the region, which backward rebuilds by replaying the recorded ops,
    # not by calling the modules again: every counter stays 1 (torch: 2 for the
    # checkpointed half); the gradient is plain autograd's
    assert [m.counter for m in modules] == [1] * 10
    assert torch.equal(input_var.grad, torch.full((3, 4), 2.0 ** 10))
    # the re-run path (debug=True) still calls the checkpointed half again, as torch does
    modules = [Net() for _ in range(10)]
    with remat_fn.set_debug_enabled(True):
        checkpoint_sequential(modules, 2, input_var, use_reentrant=use_reentrant).sum().backward()
    assert [m.counter for m in modules] == [2] * 5 + [1] * 5


def test_checkpoint_trigger_with_saved_activations():
    """``test_checkpoint_trigger`` where each module saves an activation (so the
    checkpointed half must run twice, as in torch)."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.counter = 0

        def forward(self, x):
            self.counter += 1
            return (x * torch.tensor(2.0)).exp()

    modules = [Net() for _ in range(10)]
    x = torch.randn(3, 4, requires_grad=True)
    out = checkpoint_sequential(modules, 2, x, use_reentrant=False)
    out.sum().backward()
    # deviation from torch (docs/migration.md): backward replays the recorded ops of the
    # checkpointed half instead of calling its modules again, so they run once
    assert [m.counter for m in modules] == [1] * 10
    x2 = x.detach().requires_grad_()
    h = x2
    for m in modules:
        h = m(h)
    h.sum().backward()
    assert torch.equal(x.grad, x2.grad)
    # with debug=True the checkpointed half does run twice, as in torch
    modules = [Net() for _ in range(10)]
    with remat_fn.set_debug_enabled(True):
        checkpoint_sequential(modules, 2, x, use_reentrant=False).sum().backward()
    assert [m.counter for m in modules] == [2] * 5 + [1] * 5


def test_checkpoint_valid():
    model = nn.Sequential(nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 20), nn.ReLU(),
                          nn.Linear(20, 5), nn.ReLU())
    input_var = torch.randn(1, 100, requires_grad=True)
    modules = list(model.children())
    out = model(input_var)
    grads_no_checkpoint = torch.autograd.grad([out], [input_var], [torch.ones(1, 5)], create_graph=True)
    # torch's reentrant variant refuses create_graph here; remat_fn has no such limit
    for use_reentrant in (True, False):
        out_checkpoint = checkpoint_sequential(modules, 2, input_var, use_reentrant=use_reentrant)
        assert torch.equal(out_checkpoint, out)
        grads_checkpoint = torch.autograd.grad([out_checkpoint], [input_var], [torch.ones(1, 5)],
                                               create_graph=True)
        assert_tree_close(grads_no_checkpoint, grads_checkpoint, exact=True)


def _mlp():
    return nn.Sequential(nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 20), nn.ReLU(),
                         nn.Linear(20, 5), nn.ReLU())


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint(use_reentrant):
    model = _mlp()
    _check_checkpoint_sequential(model, [list(model.children()), model], 2,
                                 torch.randn(1, 100, requires_grad=True), use_reentrant=use_reentrant)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_module_list(use_reentrant):
    class ModuleListNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.module_list = nn.ModuleList(list(_mlp().children()))

        def forward(self, input):
            for layer in self.module_list:
                input = layer(input)
            return input

    model = ModuleListNet()
    _check_checkpoint_sequential(model, [list(model.module_list.children()), model.module_list], 2,
                                 torch.randn(1, 100, requires_grad=True), use_reentrant=use_reentrant)


def test_checkpoint_sequential_deprecated_multiple_args():
    class Two(nn.Module):
        def forward(self, a, b):
            return a, b

    model = nn.Sequential(Two())
    a = torch.randn(1, 100, requires_grad=True)
    b = torch.randn(1, 100, requires_grad=True)
    with pytest.raises(TypeError):
        checkpoint_sequential(model, 1, a, b)


def test_checkpoint_sequential_deprecated_no_args():
    class Noop(nn.Module):
        def forward(self):
            pass

    model = nn.Sequential(Noop())
    with pytest.raises(TypeError):
        checkpoint_sequential(model, 1)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_rng_cpu(use_reentrant):
    for _ in range(5):
        inp = torch.randn(20000, device="cpu").requires_grad_()
        phase1 = torch.nn.Dropout()
        phase2 = torch.nn.Dropout()

        def run_fn(input):
            return phase2(input)

        state = torch.get_rng_state()
        out = phase1(inp)
        out = checkpoint(run_fn, out, use_reentrant=use_reentrant)
        out.sum().backward()
        grad_with_checkpointing = inp.grad
        torch.set_rng_state(state)
        inp.grad = None
        out = phase1(inp)
        out = run_fn(out)
        out.sum().backward()
        assert torch.equal(grad_with_checkpointing, inp.grad)


@needs_accelerator
def test_checkpoint_rng_gpu():  # pragma: no cover - needs an accelerator
    dev = ACCEL.type
    for _ in range(5):
        inp = torch.randn(20000, device=dev).requires_grad_()
        phase1, phase2 = torch.nn.Dropout(), torch.nn.Dropout()
        state = torch.get_device_module(dev).get_rng_state()
        out = checkpoint(phase2, phase1(inp), use_reentrant=True)
        out.sum().backward()
        g = inp.grad
        torch.get_device_module(dev).set_rng_state(state)
        inp.grad = None
        phase2(phase1(inp)).sum().backward()
        assert torch.equal(g, inp.grad)


@pytest.mark.parametrize("device", ["cpu"] + ([ACCEL.type] if ACCEL is not None else []))
def test_checkpoint_not_preserve_rng_state_and_without_reentrant(device):
    inp = torch.randn(2, device=device).requires_grad_()
    layer = torch.nn.Dropout()
    out = checkpoint(lambda x: layer(x), inp, use_reentrant=False, preserve_rng_state=False)
    out.sum().backward()
    # This should run without error; (added) the gradient is a dropout mask scaled
    # by 1 / (1 - p), drawn again in the recomputation
    assert set(inp.grad.unique().tolist()).issubset({0.0, 2.0})


def test_checkpoint_non_tensor():
    def run_fn(tensor1, tensor2):
        if tensor2 is None:
            return tensor1
        return tensor1 + tensor2

    input_var = torch.randn(1, 100, requires_grad=True)
    out = checkpoint(run_fn, input_var, None, use_reentrant=True)
    out.sum().backward()
    assert torch.equal(input_var.grad, torch.ones(1, 100))


def _foo(t1, t2, scale, t3):
    t4 = t1 + t2 * t3
    t5 = t1 * t2 + t3
    t4 *= scale
    t5 *= scale
    return scale, t4, None, True, t5, "bar", t1


def test_checkpoint_non_tensor_inputs_outputs():
    t1 = torch.rand(10, requires_grad=True)
    t2 = torch.rand(10, requires_grad=True)
    t3 = torch.rand(10)
    scale = random.randint(0, 10)
    res = checkpoint(_foo, t1, t2, scale, t3, use_reentrant=True)
    assert scale == res[0]
    assert torch.equal((t1 + t2 * t3) * scale, res[1])
    assert res[2] is None and res[3] is True and res[5] == "bar"
    assert torch.equal((t1 * t2 + t3) * scale, res[4])
    assert torch.equal(t1, res[6])
    res[1].sum().backward(retain_graph=True)
    res[4].sum().backward(retain_graph=True)
    res[6].sum().backward()
    # torch raises "Trying to backward through the graph a second time" here: its
    # checkpoint returns a new tensor for t1.  remat_fn returns t1 itself, as the
    # plain function does (docs/migration.md), so a second backward is plain autograd's
    t1_grad, t2_grad = t1.grad.clone(), t2.grad.clone()
    assert res[6] is t1
    res[6].sum().backward()
    assert torch.equal(t1.grad, t1_grad + 1)
    t1.grad = t2.grad = None
    res = _foo(t1, t2, scale, t3)
    torch.autograd.backward([res[1].sum(), res[4].sum(), res[6].sum()])
    # three backward calls vs one: accumulation order differs (torch's test compares
    # with tolerance too)
    torch.testing.assert_close(t1.grad, t1_grad)
    torch.testing.assert_close(t2.grad, t2_grad)


def test_checkpoint_no_tensors():
    t1, t2, t3 = random.random(), random.random(), random.random()
    scale = random.randint(0, 10)
    res = checkpoint(_foo, t1, t2, scale, t3, use_reentrant=True)
    assert res == _foo(t1, t2, scale, t3)


def test_checkpoint_partial_grad():
    def run_fn(tensor1, tensor2):
        return tensor1, tensor2

    input_var = torch.randn(1, 4, requires_grad=True)
    input_var2 = torch.randn(1, 4, requires_grad=False)
    out = checkpoint(run_fn, input_var, input_var2, use_reentrant=True)
    out[0].sum().backward()
    assert torch.equal(input_var.grad, torch.ones(1, 4))

    # torch's reentrant variant raises "none of output has requires_grad=True"; here
    # the output simply does not require grad, as in plain code
    out = checkpoint(lambda t1, t2: t1, torch.randn(1, 4), torch.randn(1, 4, requires_grad=True),
                     use_reentrant=True)
    assert not out.requires_grad


def test_checkpointing_without_reentrant_early_free():
    """Ported with the live-bytes meter instead of ``torch.cuda.memory_allocated``
    (on CPU): at each step of the backward the same bytes are live as in a plain
    backward, with and without ``retain_graph=True``."""

    def _do_test(fn, should_free):
        stats: list[int] = []
        meter = LiveBytes()

        def track(x, idx):
            # Track that at each step of the backward, some Tensor were
            # de-allocated (which correspond to the checkpoint storage being
            # emptied at each step)
            def hook(_unused):
                assert len(stats) == idx
                stats.append(meter.live)
                if idx > 0:
                    if should_free:
                        assert stats[idx] < stats[idx - 1]
                    else:
                        assert stats[idx] == stats[idx - 1]

            x.register_hook(hook)

        def test_fn(x):
            # The main property of this function is that it contains multiple
            # operations that save gradients in a chain.
            x = x**2
            track(x, 2)
            x = x**2
            track(x, 1)
            x = x**2
            track(x, 0)
            x = x**2
            return x.sum()

        with meter:
            fn(test_fn)

        return stats

    x = torch.zeros(10, requires_grad=True)
    x.grad = torch.zeros_like(x)

    # In a regular backward, buffers get eagerly freed
    non_retain_stats = _do_test(lambda fn: fn(x).backward(), True)

    # In a retain_grad backward, buffers get preserved
    _unused_retain_stats = _do_test(lambda fn: fn(x).backward(retain_graph=True), False)

    # In a regular backward with checkpoint, buffers get eagerly freed
    checkpoint_non_retain_stats = _do_test(
        lambda fn: checkpoint(fn, x, use_reentrant=False).backward(), True
    )

    # In a retain_grad backward with checkpoint, buffers get eagerly freed
    checkpoint_retain_stats = _do_test(
        lambda fn: checkpoint(fn, x, use_reentrant=False).backward(retain_graph=True), True
    )

    assert non_retain_stats == checkpoint_non_retain_stats
    assert non_retain_stats == checkpoint_retain_stats


def test_checkpoint_preserves_device_context():
    """Ported with the ``meta`` device (no accelerator needed): tensors created
    without an explicit device are created on the ``torch.device()`` context's
    device in the recomputation too."""
    recomputed_devices = []

    def fn_creates_tensor(x):
        recomputed_devices.append(torch.empty(4).device)
        return x.exp()  # exp saves its output: backward recomputes the region

    x = torch.randn(4, requires_grad=True)
    with torch.device("meta"):
        y = checkpoint(fn_creates_tensor, x, use_reentrant=False)
    assert recomputed_devices[-1].type == "meta"
    y.sum().backward()  # outside the context
    # deviation from torch (docs/migration.md): backward replays the recorded exp, the
    # function is not called again; the gradient is exact
    assert len(recomputed_devices) == 1
    assert torch.equal(x.grad, x.exp())
    # where the function does run again (debug=True), it runs in the forward's device context
    with torch.device("meta"):
        y = checkpoint(fn_creates_tensor, x, use_reentrant=False, debug=True)
    y.sum().backward()
    assert [d.type for d in recomputed_devices] == ["meta"] * 3


# =============================================================================
# test/test_autograd.py :: TestAutograd (checkpoint tests)
# =============================================================================
def test_checkpointing():
    num_inp = 2000
    nz_inp = 10
    nz_bottleneck = 1000

    # small proxy network for some complex reasoning we want to do per input
    module = nn.Sequential(nn.Linear(nz_inp, nz_bottleneck), nn.ReLU(), nn.Linear(nz_bottleneck, nz_inp))
    module_copy = copy.deepcopy(module)  # (added) the plain reference

    feat_combined, feat_plain = [], []
    for _ in range(num_inp):
        data_r = torch.empty(1, nz_inp)
        data_r.uniform_()
        data_r.requires_grad = True
        feat_r = checkpoint(module, data_r, use_reentrant=True)
        feat_combined.append(feat_r)
        feat_plain.append(module_copy(data_r))

    # compute mean as a proxy for some joint reasoning
    mean_combined = torch.stack(feat_combined).mean()
    mean_combined.backward()
    # (added) the gradients are plain autograd's
    torch.stack(feat_plain).mean().backward()
    for p, q in zip(module.parameters(), module_copy.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("enabled", [True, False])
def test_checkpointing_non_reentrant_autocast_cpu(enabled):
    def foo(x, y, z):
        x = torch.mm(x, y)
        y = torch.mm(x, z)
        z = torch.mm(z, z)
        assert z.dtype == (torch.bfloat16 if enabled else torch.float32)
        return z

    x, y, z = (torch.randn(3, 3, requires_grad=True) for _ in range(3))
    with torch.autocast(enabled=enabled, device_type="cpu", dtype=torch.bfloat16):
        loss = checkpoint(foo, x, y, z, use_reentrant=False).sum()
    loss.backward()  # recomputes under bfloat16 autocast


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_checkpointing_non_reentrant_autocast_gpu():  # pragma: no cover - needs CUDA
    def foo(x, y, z):
        z = torch.mm(torch.mm(x, y), z)
        assert z.dtype == torch.bfloat16
        return z

    x, y, z = (torch.randn(3, 3, device="cuda", requires_grad=True) for _ in range(3))
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        loss = checkpoint(foo, x, y, z, use_reentrant=False).sum()
    loss.backward()


def test_checkpointing_without_reentrant_memory_savings():
    """Ported with the live-bytes meter (torch measures CUDA memory over forward and
    backward; on CPU the meter's backward peak is dominated by gradient buffers, so
    the peak is read at the end of the forward, where the activations live)."""

    class MyModel(nn.Module):
        def __init__(self, n, use_checkpoint):
            super().__init__()
            self.n, self.use_checkpoint = n, use_checkpoint
            self.layers = nn.ModuleList(
                nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 256))
                for _ in range(n))

        def forward(self, x):
            for layer in self.layers:
                x = checkpoint(layer, x, use_reentrant=False) if self.use_checkpoint else layer(x)
            return x

    torch.manual_seed(0)
    x = torch.randn(100, 256, requires_grad=True)
    peaks = []
    for use in (False, True):
        model = MyModel(8, use)
        for p in model.parameters():  # as torch does: gradients allocated up front
            p.grad = torch.ones_like(p)
        with LiveBytes() as meter:
            loss = model(x.clone()).sum()
            peaks.append(meter.peak)  # the activations kept for backward
            loss.backward()
    assert peaks[1] < 0.5 * peaks[0], peaks


def test_checkpointing_without_reentrant_custom_function_works():
    class MyFunc(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y, z):
            w = x * y * z
            out = w + w
            ctx.save_for_backward(x, y, z, w, out)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            x, y, z, w, out = ctx.saved_tensors
            # torch raises "Unpack is being triggered for a tensor that was already
            # unpacked once" here; remat_fn recomputes and hands out the same values
            x2, y2, z2, w2, out2 = ctx.saved_tensors
            assert all(torch.equal(a, b) for a, b in zip((x, y, z, w, out), (x2, y2, z2, w2, out2)))
            return x, y, z

    x, y, z = (torch.tensor(v, requires_grad=True) for v in (1.0, 2.0, 3.0))

    def foo(x, y, z):
        x = x * y * z
        y = y * y * z
        z = z * z
        return MyFunc.apply(x, y, z)

    out = checkpoint(foo, x, y, z, use_reentrant=False)
    out.sum().backward()
    ref = [t.detach().clone().requires_grad_() for t in (x, y, z)]
    foo(*ref).sum().backward()
    assert_tree_close([x.grad, y.grad, z.grad], [t.grad for t in ref], exact=True)


def test_checkpointing_without_reentrant_with_context_fn():
    x = torch.tensor(1.0, requires_grad=True)
    verbose = OpNames()
    out = checkpoint(lambda x: x.exp(), x, use_reentrant=False,
                     context_fn=lambda: (verbose, contextlib.nullcontext()))
    assert verbose.ops == ["exp.default"]
    verbose.ops = []
    out = checkpoint(lambda x: x.exp(), x, use_reentrant=False,
                     context_fn=lambda: (contextlib.nullcontext(), verbose))
    out.backward()
    # torch: ["exp.default", "detach.default", "detach.default"], its own bookkeeping
    # detaches; remat_fn's recomputation runs exactly the region's op
    assert verbose.ops == ["exp.default"]
    # torch raises "only supported when use_reentrant=False" for a context_fn with
    # use_reentrant=True; remat_fn ignores use_reentrant (docs/migration.md)
    verbose.ops = []
    out = checkpoint(lambda x: x.sin(), x, use_reentrant=True,
                     context_fn=lambda: (contextlib.nullcontext(), verbose))
    out.backward()
    assert verbose.ops == []  # sin's backward needs only x: nothing recomputed


def test_checkpoint_graph_execution_group():
    counter = [0]

    def fn(x):
        counter[0] += 1
        y = x.sin().cos()
        z = y.sin().cos()
        return y, z

    x = torch.randn(3, 3, requires_grad=True)
    y, z = checkpoint(fn, x, use_reentrant=False)
    (grad_y,) = torch.autograd.grad(z, inputs=(y,), grad_outputs=(torch.ones(3, 3),))
    with OpNames() as second:
        (grad_x,) = torch.autograd.grad(y, inputs=(x,), grad_outputs=(grad_y,))
    # deviation from torch (docs/migration.md): torch runs fn 3 times (2 with a
    # GraphExecGroup); remat_fn never calls it again: the first unpack replays the
    # recorded ops every still-needed tensor of the region depends on, so the second
    # backward finds its tensors ready and replays nothing
    assert counter[0] == 1
    x2 = x.detach().clone().requires_grad_()
    y2, z2 = fn(x2)
    gy = torch.autograd.grad(z2, y2, torch.ones(3, 3))[0]
    with OpNames() as plain_second:
        want = torch.autograd.grad(y2, x2, gy)[0]
    assert_tree_close(grad_x, want, exact=True)
    drop = {"detach.default"}
    assert [o for o in second.ops if o not in drop] == [o for o in plain_second.ops if o not in drop]


def _get_non_det_fn(orig_fn, recompute_fn):
    counter = [0]

    def fn(x):
        if counter[0] == 0:
            counter[0] += 1
            return orig_fn(x)
        return recompute_fn(x)

    return fn


def test_checkpoint_detects_non_determinism():
    def save_3_tensors(x):
        return x.sin().exp().sin()

    def save_2_tensors(x):
        return x.sin().exp()

    def save_2_tensors_alt(x):
        return x.sin() * torch.tensor([1.0, 2.0])

    a = torch.randn(1, requires_grad=True)
    # deviation from torch (docs/migration.md): by default backward replays the recorded
    # forward and never calls the function again, so a non-deterministic function cannot
    # mismatch; the gradient is the one of the forward that ran
    for first, second in ((save_3_tensors, save_2_tensors), (save_2_tensors, save_3_tensors),
                          (save_2_tensors, save_2_tensors_alt)):
        (g,) = torch.autograd.grad(checkpoint(_get_non_det_fn(first, second), a, use_reentrant=False).sum(), a)
        assert torch.equal(g, torch.autograd.grad(first(a).sum(), a)[0])
    # where the function does run again (early stop off, debug) the re-run is checked
    with pytest.raises(RecomputeMismatchError, match="tensors were saved"):  # fewer
        checkpoint(_get_non_det_fn(save_3_tensors, save_2_tensors), a, use_reentrant=False,
                   early_stop=False).backward()
    with tc.set_checkpoint_early_stop(False):  # more, with early stop off
        with pytest.raises(RecomputeMismatchError, match="more tensors were saved"):
            checkpoint(_get_non_det_fn(save_2_tensors, save_3_tensors), a, use_reentrant=False).backward()
    with pytest.raises(RecomputeMismatchError, match=r"saved tensor #\d is .* but was"):  # metadata
        checkpoint(_get_non_det_fn(save_2_tensors, save_2_tensors_alt), a, use_reentrant=False,
                   early_stop=False).sum().backward()
    with pytest.raises(RecomputeMismatchError, match="forward ops:"):  # debug=True
        checkpoint(_get_non_det_fn(save_2_tensors, save_2_tensors_alt), a, use_reentrant=False,
                   debug=True).sum().backward()
    with pytest.raises(RecomputeMismatchError, match="forward ops:"):
        with tc.set_checkpoint_debug_enabled(True):
            out = checkpoint(_get_non_det_fn(save_2_tensors, save_2_tensors_alt), a,
                             use_reentrant=False, debug=False)
        out.sum().backward()
    with pytest.raises(RecomputeMismatchError, match="Pass debug=True"):
        with tc.set_checkpoint_debug_enabled(False):  # (debug off: re-run with early_stop=False)
            out = checkpoint(_get_non_det_fn(save_2_tensors, save_2_tensors_alt), a,
                             use_reentrant=False, debug=True, early_stop=False)
        out.sum().backward()


def test_access_saved_tensor_twice_without_recomputation_works():
    count = [0]

    def foo(a):
        count[0] += 1
        b = a * a
        c = a * b  # noqa: F841
        d = torch.exp(a)
        return d

    a = torch.randn(5, requires_grad=True)
    d = checkpoint(foo, a, use_reentrant=False)
    assert count[0] == 1
    # Recomputed variables only persist within a particular backward call.
    # If _saved_result is accessed outside of a backward, it will trigger
    # a recompute. And afterwards, those recomputed results are immediately
    # cleared.
    # deviation from torch (docs/migration.md): a recompute replays the recorded ops
    # (only exp: b and c are dead) instead of calling foo, so count stays 1 (torch: 2,
    # 3, 4); each access and the backward replay exp once
    with OpNames() as ops:
        saved = d.grad_fn._saved_result
    assert count[0] == 1 and ops.ops.count("exp.default") == 1 and "mul.Tensor" not in ops.ops
    assert torch.equal(saved, d)  # (added)
    # Second access will trigger another recompute
    with OpNames() as ops:
        _ = d.grad_fn._saved_result
    assert count[0] == 1 and ops.ops.count("exp.default") == 1
    # Backward clears the saved variable
    with OpNames() as ops:
        d.sum().backward()
    assert count[0] == 1 and ops.ops.count("exp.default") == 1
    assert torch.equal(a.grad, a.detach().exp())
    # Now it raises an error
    with pytest.raises(RuntimeError, match="or directly access saved tensors after they have already been freed"):
        _ = d.grad_fn._saved_result


@pytest.mark.parametrize("input_requires_grad", [True, False])
def test_checkpointing_without_reentrant(input_requires_grad):
    module = nn.Sequential(nn.Linear(10, 100), nn.ReLU(), nn.Linear(100, 10))

    class MyModule(nn.Module):
        def __init__(self, mod):
            super().__init__()
            self.module = mod

        def forward(self, data):
            return self.module(data)

    module = MyModule(module)
    module_copy = copy.deepcopy(module)
    feats, feats_plain = [], []
    for _ in range(100):
        data_r = torch.empty(1, 10).uniform_()
        data_r.requires_grad = input_requires_grad
        feats.append(checkpoint(module, data=data_r, use_reentrant=False))
        feats_plain.append(module_copy(data_r))
    torch.stack(feats).mean().backward()
    torch.stack(feats_plain).mean().backward()
    for p, q in zip(module.parameters(), module_copy.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_checkpoint_valid_reset_on_error():
    a = torch.randn(2, 2, requires_grad=True)
    # torch's reentrant variant fails with torch.autograd.grad; remat_fn does not
    b = checkpoint(torch.exp, a, use_reentrant=True).sum()
    (g,) = torch.autograd.grad(b, (a,))
    assert torch.equal(g, torch.exp(a))
    c = checkpoint(torch.exp, a, use_reentrant=True).sum()
    c.backward()


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointing_without_reentrant_detached_tensor(use_reentrant):
    class NoGradModule(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 2, bias=False)
            self.lin2 = nn.Linear(2, 2, bias=False)

        def forward(self, x):
            with torch.no_grad():
                return self.lin2(self.linear(x))

    module = NoGradModule()
    # torch's reentrant variant raises "none of output has requires_grad=True" here;
    # remat_fn reproduces no limitation of it (docs/migration.md)
    a = torch.randn(2, 2, requires_grad=True)
    for _ in range(3):
        # out does not require grad
        out = checkpoint(module, a, use_reentrant=use_reentrant)
        # (added) as in plain code
        assert not out.requires_grad
        # Make loss require grad, otherwise we would run into
        # "element 0 of tensors does not require grad and does not have a grad_fn"
        out += a
        out.sum().backward()
    # (added) only `out += a` reaches a, once per iteration
    assert torch.equal(a.grad, torch.full((2, 2), 3.0))
    assert all(p.grad is None for p in module.parameters())


def test_checkpointing_without_reentrant_saved_object_identity():
    x_backward = None

    class Test(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(y)
            return x

        @staticmethod
        def backward(ctx, x):
            nonlocal x_backward
            (x_backward,) = ctx.saved_tensors
            return x, None

    a = torch.tensor(1.0, requires_grad=True)
    b = torch.tensor(1.0, requires_grad=False)
    Test.apply(a, b).backward()
    assert b is x_backward
    x_backward = None
    checkpoint(Test.apply, a, b, use_reentrant=False).backward()
    assert b is x_backward


def test_checkpointing_without_reentrant_correct_grad():
    a = torch.randn(2, 2, requires_grad=True)
    torch.exp(a).sum().backward()
    b_grad = a.grad
    a.grad = None
    checkpoint(torch.exp, a, use_reentrant=False).sum().backward()
    c_grad = a.grad
    a.grad = None
    (d_grad,) = torch.autograd.grad(checkpoint(torch.exp, a, use_reentrant=False).sum(), (a,))
    assert torch.equal(b_grad, c_grad) and torch.equal(b_grad, d_grad)


def test_checkpointing_without_reentrant_dataparallel():
    class LinearModule(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 2, bias=False)

        def forward(self, inp):
            return self.linear(inp)

    a = torch.randn(2, 2, requires_grad=True)
    model = LinearModule()
    copy.deepcopy(model)(a).sum().backward()
    b_grad = a.grad
    a.grad = None
    module = nn.DataParallel(copy.deepcopy(model))
    checkpoint(module, a, use_reentrant=False).sum().backward()
    assert torch.equal(b_grad, a.grad)


def test_checkpointing_without_reentrant_parameter_used_in_an_out():
    w = torch.randn(10, 10, requires_grad=True)
    count = 0

    def hook(grad):
        nonlocal count
        count += 1

    w.register_hook(hook)
    x = torch.rand(10, 10, requires_grad=True)
    h = w * x
    out = checkpoint(lambda x: w * x, h, use_reentrant=False)
    out.sum().backward()
    assert count == 1


def test_checkpointing_without_reentrant_arbitrary_input_output():
    class MyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(5, 5, bias=False)

        def forward(self, dict_input):
            return {"result": self.layer(dict_input["tensor"])}

    plain = MyModel()
    ckpt = copy.deepcopy(plain)
    inp = {"tensor": torch.randn(5, 5)}
    out_plain = plain(inp)["result"].sum()
    out_ckpt = checkpoint(ckpt, inp, use_reentrant=False)["result"].sum()
    assert torch.equal(out_plain, out_ckpt)
    out_plain.backward()
    out_ckpt.backward()
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad)


# =============================================================================
# test/test_autograd.py :: TestNestedCheckpoint
# =============================================================================
def _grad(fn):
    def wrapper(x):
        with torch.enable_grad():
            out = fn(x)
            (grad_input,) = torch.autograd.grad(out, inputs=(x,), create_graph=True)
        return grad_input

    return wrapper


def _sum(fn):
    def wrapped(x):
        return fn(x).sum()

    return wrapped


def _c(fn):
    def wrapped(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    return wrapped


def _get_tests(fn):
    grad, c = _grad, _c
    return (
        # function <> tuple of function arbitrarily wrapped in checkpoint in various ways
        (fn, (c(fn), c(c(fn)))),
        (grad(fn), (grad(c(fn)), grad(c(c(fn))))),
        (
            grad(grad(fn)),
            (grad(c(grad(fn))), c(grad(grad(c(fn)))), grad(c(grad(c(fn))))),
        ),
        (
            grad(grad(grad(fn))),
            (grad(c(grad(grad(c(fn))))), grad(c(grad(c(grad(c(fn))))))),
        ),
    )


def _check_graph_dies(fn):
    def iter_graph(roots):
        if not roots:
            return
        seen = set()
        q = collections.deque()
        for node in roots:
            if node is not None:
                seen.add(node)
                q.append(node)
        while q:
            node = q.popleft()
            for fn, _idx in node.next_functions:
                if fn in seen or fn is None:
                    continue
                seen.add(fn)
                q.append(fn)
            yield node

    class Handle:
        __slot__ = ["node_name"]

        def __init__(self, node_name):
            self.node_name = node_name

    def scope():
        a = torch.randn((), requires_grad=True)
        out = fn(a)
        refs = []
        for node in iter_graph([out.grad_fn]):
            handle = Handle(node.name())
            refs.append(weakref.ref(handle))
            node.metadata["blah"] = handle
        return refs

    refs = scope()
    node_names = [ref().node_name for ref in refs if ref() is not None]
    assert len(node_names) == 0, f"Nodes still alive: {node_names}"


@pytest.mark.parametrize("early_stop", [True, False])
def test_nested_checkpoint(early_stop):
    with tc.set_checkpoint_early_stop(early_stop):
        x = torch.randn((), requires_grad=True)

        def f(x):
            out = x.sin().exp().sin()
            return out

        def g(x):
            a = x.sin().exp().sin()
            b = x.sin().exp().sin()
            (ga,) = torch.autograd.grad(a, x)
            (gb,) = torch.autograd.grad(b, x)
            return x.sin()

        for fn in (f, g):
            for expected_fn, actual_fns in _get_tests(fn):
                expected = expected_fn(x)

                for actual_fn in actual_fns:
                    actual = actual_fn(x)
                    assert torch.allclose(expected, actual)
                    _check_graph_dies(actual_fn)


@pytest.mark.parametrize("early_stop", [True, False])
def test_nested_checkpoint_two_children(early_stop):
    with tc.set_checkpoint_early_stop(early_stop):
        grad, sum, c = _grad, _sum, _c

        def f(x):
            return x.sin().exp().sin()

        def g(x):
            return x.cos().sin().exp()

        def hc(x):
            return c(g)(c(f)(x))

        def h(x):
            return g(f(x))

        a = torch.randn(3, 3, requires_grad=True)
        expected = grad(sum(grad(sum(h))))(a)
        actual = grad(sum(grad(sum(c(hc)))))(a)
        assert torch.allclose(expected, actual)

        actual = grad(sum(c(grad(sum(c(hc))))))(a)
        assert torch.allclose(expected, actual)

        _check_graph_dies(grad(c(hc)))
        _check_graph_dies(grad(sum(grad(sum(c(hc))))))
        _check_graph_dies(grad(sum(c(grad(sum(c(hc)))))))


@pytest.mark.parametrize("early_stop", [True, False])
def test_nested_checkpoint_non_tensor_inputs_and_outputs(early_stop):
    def fn(k, a, b, f):
        return f(k * a * b.exp()), 1, "abcd"

    k = 3
    a = torch.tensor(2.0, requires_grad=True)
    b = torch.tensor(3.0, requires_grad=True)

    def f(x):
        return x.sin()

    with tc.set_checkpoint_early_stop(early_stop):
        out, _unused1, _unused2 = checkpoint(fn, k, a, b, f, use_reentrant=False)
    actual_grads = torch.autograd.grad(out, (a, b))

    out, _unused1, _unused2 = fn(k, a, b, f)
    expected_grads = torch.autograd.grad(out, (a, b))
    for actual, expected in zip(actual_grads, expected_grads):
        assert torch.allclose(actual, expected)


@pytest.mark.parametrize("early_stop", [True, False])
def test_nested_checkpoint_kwargs(early_stop):
    def fn(a, blah=None):
        out = a.sin().exp()
        if blah is not None:
            out = out * blah
        return out.sin().exp()

    a = torch.tensor(2.0, requires_grad=True)
    b = torch.tensor(3.0, requires_grad=True)

    with tc.set_checkpoint_early_stop(early_stop):
        out = checkpoint(fn, a, blah=b, use_reentrant=False)
        actual_grads = torch.autograd.grad(out, (a, b))

        out = fn(a, blah=b)
        expected_grads = torch.autograd.grad(out, (a, b))
        for actual, expected in zip(actual_grads, expected_grads):
            assert torch.allclose(actual, expected)


@pytest.mark.parametrize("early_stop", [True, False])
def test_nested_checkpoint_same_graph(early_stop):
    counter = [0]

    def hook(*_unused_args):
        counter[0] += 1

    def fn(a):
        return a.sin().cos().sin()

    a = torch.tensor(1.0, requires_grad=True)

    with tc.set_checkpoint_early_stop(early_stop):
        out = checkpoint(fn, a, use_reentrant=False)
    # The hook is registered on the original graph
    out.grad_fn.next_functions[0][0].register_hook(hook)
    # And backward is performed on the original graph
    out.backward()

    assert counter[0] == 1


@pytest.mark.parametrize("early_stop", [True, False])
def test_nested_checkpoint_reentrant_backwards(early_stop):
    calls = []

    def fn(a):
        x = a.sin().cos()
        out = x.sin()
        return x, out

    def hook(*_unused_args):
        # do backward again, but skip over the part of the graph where
        # the hook was registered
        calls.append(1)
        x.backward(retain_graph=True)

    a = torch.tensor(1.0, requires_grad=True)
    with tc.set_checkpoint_early_stop(early_stop):
        x, out = checkpoint(fn, a, use_reentrant=False)
    out.grad_fn.register_hook(hook)
    out.backward(retain_graph=True)
    # (added) the reentrant backward ran, and both backwards reached a: d/da of
    # x (from the hook) plus d/da of out
    assert calls == [1]
    a2 = a.detach().requires_grad_()
    x2, out2 = fn(a2)
    (want,) = torch.autograd.grad(x2 + out2, a2)
    assert torch.allclose(a.grad, want)


def test_nested_checkpoint_set_early_stop():
    counter = [0]

    def clone(x):
        counter[0] += 1
        return x.clone()

    def fn(x):
        # Since clone does not save anything, it is not recomputed iff
        # early stop is enabled.
        return clone(x.sin().cos())

    # Test default
    # Early stopping is enabled by default
    a = torch.tensor(1.0, requires_grad=True)
    out = checkpoint(fn, a, use_reentrant=False)
    out.backward()
    assert counter[0] == 1

    # Test local setting
    counter = [0]
    a = torch.tensor(1.0, requires_grad=True)
    out = checkpoint(fn, a, use_reentrant=False, early_stop=False)
    out.backward()
    assert counter[0] == 2

    counter = [0]
    a = torch.tensor(1.0, requires_grad=True)
    out = checkpoint(fn, a, use_reentrant=False, early_stop=True)
    out.backward()
    assert counter[0] == 1

    # Test context manager
    # Expect early stopping to be disabled for all checkpoints ran under
    # the context manager, even though context manager is no longer active
    # when backward/recomputation is performed.
    counter = [0]
    a = torch.tensor(1.0, requires_grad=True)
    with tc.set_checkpoint_early_stop(False):
        out = checkpoint(fn, a, use_reentrant=False)
    out.backward()
    assert counter[0] == 2

    counter = [0]
    a = torch.tensor(1.0, requires_grad=True)
    with tc.set_checkpoint_early_stop(True):
        out = checkpoint(fn, a, use_reentrant=False)
    out.backward()
    assert counter[0] == 1

    # Test context manager nesting
    counter = [0]
    a = torch.tensor(1.0, requires_grad=True)
    with tc.set_checkpoint_early_stop(False):
        with tc.set_checkpoint_early_stop(True):
            out = checkpoint(fn, a, use_reentrant=False, early_stop=False)
    out.backward()
    assert counter[0] == 1

    # Test precedence
    counter = [0]
    a = torch.tensor(1.0, requires_grad=True)
    with tc.set_checkpoint_early_stop(False):
        out = checkpoint(fn, a, use_reentrant=False, early_stop=True)
    out.backward()
    assert counter[0] == 2

    counter = [0]
    a = torch.tensor(1.0, requires_grad=True)
    with tc.set_checkpoint_early_stop(True):
        out = checkpoint(fn, a, use_reentrant=False, early_stop=False)
    out.backward()
    assert counter[0] == 1


def test_nested_checkpoint_set_early_stop_no_recompution_needed():
    """Case 1 differs on purpose (docs/migration.md): remat_fn keeps a region's
    inputs as plain autograd does, so a backward that needs only the input
    recomputes nothing (JAX: backward recomputes only what it needs); torch
    reruns the Python function (counter 2) and, without early stop, its ops."""
    python_dispatch_counter = [0]
    counter = [0]

    class SinCounterMode(TorchDispatchMode):
        def __init__(self) -> None:
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = {} if kwargs is None else kwargs
            if func is torch.ops.aten.sin.default:
                self.count += 1
            return func(*args, **kwargs)

    def fn(x):
        counter[0] += 1
        return x.sin()

    # With early stopping (enabled by default)
    a = torch.tensor(1.0, requires_grad=True)
    with SinCounterMode() as python_dispatch_counter:  # noqa: F811
        out = checkpoint(fn, a, use_reentrant=False)
        out.backward()
    assert counter[0] == 1  # torch: 2
    assert python_dispatch_counter.count == 1

    # Without early stopping
    counter = [0]
    a = torch.tensor(1.0, requires_grad=True)
    with SinCounterMode() as python_dispatch_counter:
        with tc.set_checkpoint_early_stop(False):
            out = checkpoint(fn, a, use_reentrant=False)
        out.backward()
    assert counter[0] == 1  # torch: 2
    assert python_dispatch_counter.count == 1  # torch: 2

    # Case 2: Forward saves no tensors

    # Since unpack isn't even called, counter is 1 whether or not early stop
    # is enabled!
    counter = [0]

    def fn2(x):
        counter[0] += 1
        return x.clone()

    # With early stopping (enabled by default)
    a = torch.tensor(1.0, requires_grad=True)
    out = checkpoint(fn2, a, use_reentrant=False)
    out.backward()
    assert counter[0] == 1

    # Without early stopping
    counter = [0]
    a = torch.tensor(1.0, requires_grad=True)
    with tc.set_checkpoint_early_stop(False):
        out = checkpoint(fn2, a, use_reentrant=False)
    out.backward()
    assert counter[0] == 1


# =============================================================================
# Selective activation checkpointing (create_selective_checkpoint_contexts)
# =============================================================================
def _sac(policy_or_ops):
    return functools.partial(tc.create_selective_checkpoint_contexts, policy_or_ops)


def test_flops_and_mem():
    """torch's test with its own function and numbers, on CPU: activation memory
    from the live-bytes meter (torch reads CUDA allocator statistics), backward
    FLOPs from FlopCounterMode, normalised so that a 512 square matmul is 1."""
    from torch.utils.flop_counter import FlopCounterMode

    def get_act_mem(f):
        out = f()
        out.backward()
        # Why do one forward and backward?
        with LiveBytes() as meter:
            out = f()
            act_mem = (meter.live - out.nbytes) / (1024 * 1024)
        out.backward()
        return act_mem

    def get_bw_flops(f):
        # Normalized so that a 512 square matmul returns 1
        f().backward()
        out = f()
        with FlopCounterMode(display=False) as mode:
            out.backward()
        return mode.get_total_flops() / (512**3 * 2)

    x = torch.randn(512, 512, requires_grad=True)
    y = torch.randn(512, 512, requires_grad=True)

    def fn(x, y):
        return torch.mm(x.cos(), y).sin().sum()

    def fn_ac(x, y):
        return checkpoint(fn, x, y, use_reentrant=False)

    def fn_sac(x, y):
        context_fn = functools.partial(tc.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
        return checkpoint(fn, x, y, use_reentrant=False, context_fn=context_fn)

    def policy_fn(ctx, op, *args, **kwargs):
        if op == torch.ops.aten.mm.default:
            return tc.CheckpointPolicy.MUST_SAVE
        return tc.CheckpointPolicy.PREFER_RECOMPUTE

    def fn_sac2(x, y):
        context_fn = functools.partial(tc.create_selective_checkpoint_contexts, policy_fn)
        return checkpoint(fn, x, y, use_reentrant=False, context_fn=context_fn)

    def policy_fn_bool(ctx, op, *args, **kwargs):
        return op == torch.ops.aten.mm.default

    def fn_sac3(x, y):
        context_fn = functools.partial(tc.create_selective_checkpoint_contexts, policy_fn_bool)
        return checkpoint(fn, x, y, use_reentrant=False, context_fn=context_fn)

    assert get_act_mem(lambda: fn(x, y)) == 2.0
    assert get_bw_flops(lambda: fn(x, y)) == 2.0

    assert get_act_mem(lambda: fn_ac(x, y)) == 0.0
    assert get_bw_flops(lambda: fn_ac(x, y)) == 3.0

    for sac in (fn_sac, fn_sac2, fn_sac3):
        assert get_act_mem(lambda: sac(x, y)) == 1.0
        assert get_bw_flops(lambda: sac(x, y)) == 2.0


def test_output_already_has_autograd_meta():
    # View of tensor of non-differentiable dtype still has AutogradMeta
    def fn(x, y):
        return x.view(-1), y.sin().cos()

    x = torch.tensor([1, 2, 3], dtype=torch.int64)
    y = torch.randn(3, requires_grad=True)

    context_fn = functools.partial(tc.create_selective_checkpoint_contexts, [torch.ops.aten.view.default])
    out = checkpoint(fn, x, y, use_reentrant=False, context_fn=context_fn)
    out[1].sum().backward()
    # (added) the output view and the gradient are plain autograd's
    assert torch.equal(out[0], x) and out[0]._base is x
    (want,) = torch.autograd.grad(fn(x, y)[1].sum(), y)
    assert torch.equal(y.grad, want)


def test_subclass_dispatching_sizes():
    # Test that we ignore ops that grab metadata like torch.ops.aten.sym_size.default
    # Caching such metadata ops can be problematic when the following are satisfied:
    #
    # 1. size/strides are dispatched upon
    # 2. our policy saves sizes
    class CustomSizeDynamicShapesTensor(torch.Tensor):
        @staticmethod
        def __new__(cls, inner):
            return torch.Tensor._make_wrapper_subclass(
                cls, inner.size(), inner.stride(), None, None, inner.dtype, inner.layout,
                inner.device, False, inner.requires_grad, "sizes",
            )

        def __init__(self, inner):
            self.inner = inner

        @classmethod
        def __torch_dispatch__(cls, func, types, args, kwargs):
            if kwargs is None:
                kwargs = {}
            args_inner = torch.utils._pytree.tree_map_only(cls, lambda x: x.inner, args)
            out_inner = func(*args_inner, **kwargs)
            return torch.utils._pytree.tree_map_only(torch.Tensor, lambda x: cls(x), out_inner)

    def policy_fn(ctx, op, *args, **kwargs):
        if op is torch.ops.aten.sym_size.default:
            # Silently ignored!
            return tc.CheckpointPolicy.MUST_SAVE
        return tc.CheckpointPolicy.PREFER_RECOMPUTE

    def fn(x):
        # Views save the shape of their input, so we expect the second
        # view to save 12
        view_out = (x * x.sum()).view(-1).view(4, 3)
        assert list(view_out.grad_fn._saved_self_sym_sizes) == [12]
        return view_out.exp()

    x = torch.randn(4, 3, requires_grad=True)
    x_wrapper = CustomSizeDynamicShapesTensor(x)
    context_fn = functools.partial(tc.create_selective_checkpoint_contexts, policy_fn)
    out = checkpoint(fn, x_wrapper, use_reentrant=False, context_fn=context_fn)
    out.sum().backward()


def test_bad_inputs():
    # torch's own checks of create_selective_checkpoint_contexts, which remat_fn.compat
    # takes unchanged
    bad_op_list1 = [2]
    with pytest.raises(ValueError, match="Expected op in `op_list` to be an OpOverload"):
        tc.create_selective_checkpoint_contexts(bad_op_list1)

    bad_op_list2 = [torch.ops.aten.sin]
    with pytest.raises(ValueError, match="update the OpOverloadPacket to a specific OpOverload"):
        tc.create_selective_checkpoint_contexts(bad_op_list2)

    with pytest.raises(TypeError, match="either a function or a list of ops."):
        tc.create_selective_checkpoint_contexts(2)

    # (added) remat_fn's own: an invalid policy decision, a context_fn that is no pair
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(PolicyError, match="return value"):
        checkpoint(lambda x: x.sin(), x, use_reentrant=False,
                   context_fn=_sac(lambda ctx, op, *a, **k: "not a decision")).sum().backward()
    with pytest.raises(TypeError, match="two context managers"):
        checkpoint(lambda x: x.sin(), x, use_reentrant=False, context_fn=lambda: None)


def test_policy_with_state():
    """torch's test; remat_fn asks the policy during the forward only (its decisions
    are recorded and replayed, so ``ctx.is_recompute`` is always False): torch's
    counters are [1, 2, 3, 1, 2], remat_fn's [1, 2, 3] (docs/migration.md)."""
    # If I have a stateful callable, state is shared between the original
    # forward and the recompute.
    counters = []

    class Policy:
        def __init__(self) -> None:
            self.counter = [0]
            self.recompute_counter = [0]

        def __call__(self, ctx, func, *args, **kwargs):
            counter = self.recompute_counter if ctx.is_recompute else self.counter
            counter[0] += 1
            counters.append(counter[0])
            if counter == 1 and func is torch.ops.aten.mm.default:
                return tc.CheckpointPolicy.MUST_SAVE
            return tc.CheckpointPolicy.PREFER_RECOMPUTE

    def fn(x):
        return x.sin().sin().sin()

    x = torch.randn(3, requires_grad=True)
    context_fn = functools.partial(tc.create_selective_checkpoint_contexts, Policy(),
                                   allow_cache_entry_mutation=True)
    out = checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)
    out.sum().backward()
    # torch: 1. counter properly reset to 0 for the recompute
    #        2. due to early-stop we do not recompute the final op
    assert counters == [1, 2, 3]
    (ref,) = torch.autograd.grad(fn(x).sum(), x)
    assert torch.equal(x.grad, ref)


@contextlib.contextmanager
def _disable_gc():
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def test_storage_lifetime():
    """torch's test, with gc disabled: the storage the policy keeps dies with the graph.

    torch holds a weakref to the raw value in its caching mode; remat_fn keeps
    the op's output itself (autograd holds it as it would without remat), so the
    weak reference is to that output's storage, and a meter checks that no byte
    made in the region outlives the graph.  Case 2 differs on purpose
    (docs/migration.md): a graph kept by ``retain_graph=True`` can be
    backpropagated again (torch's SAC raises instead), so what it saves lives
    until the graph is dropped, as in plain autograd."""

    def policy_fn(ctx, op, *args, **kwargs):
        return tc.CheckpointPolicy.MUST_SAVE

    ref = None

    def fn(x):
        nonlocal ref
        out = x.cos().exp()
        ref = StorageWeakRef(out.untyped_storage())
        # Careful for early-stop
        return out.sin()

    with _disable_gc():
        # Case 1: If graph goes away without backward, make sure there's no reference cycle
        #         keeping storage alive.
        x = torch.randn(3, requires_grad=True)
        context_fn = functools.partial(tc.create_selective_checkpoint_contexts, policy_fn)
        with LiveBytes() as meter:
            out = checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)
            assert not ref.expired()
            del out
            assert ref.expired()
            assert meter.live == 0

        # Case 2: after backward with retain_graph=True the graph can run again: the
        #         storage lives exactly as long as the graph
        x = torch.randn(3, requires_grad=True)
        with LiveBytes() as meter:
            out = checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)
            assert not ref.expired()
            out.sum().backward(retain_graph=True)
            assert not ref.expired()
            g1, x.grad = x.grad, None
            out.sum().backward(retain_graph=True)
            assert torch.equal(x.grad, g1)
            del out
            assert ref.expired()
            x.grad = g1 = None
            assert meter.live == 0


def test_version_counter():
    """torch's test.  Case 1 differs on purpose (docs/migration.md): where torch
    raises "has been mutated" (unless ``allow_cache_entry_mutation=True``),
    remat_fn keeps the saved value as the op made it (before the region's
    in-place update) and the replay reruns the in-place update, so the gradient
    is plain autograd's, with or without the flag."""

    def policy_fn(ctx, op, *args, **kwargs):
        if op == torch.ops.aten.sin.default:
            return tc.CheckpointPolicy.MUST_SAVE
        return tc.CheckpointPolicy.PREFER_RECOMPUTE

    def fn(x):
        return x.sin().mul_(2).cos().exp()

    x = torch.randn(3, requires_grad=True)
    context_fn = functools.partial(tc.create_selective_checkpoint_contexts, policy_fn)
    out = checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)

    # 1) torch: error because the output of sin is saved and mutated by mul_
    with OpNames() as ops:
        out.sum().backward()
    plain = fn(x)
    with OpNames() as plain_ops:
        (want,) = torch.autograd.grad(plain.sum(), x)
    # JAX's rule: rebuilding cos's input and exp's output reads sin's output as sin
    # made it, which the policy saves: that value (before mul_) is kept, and backward
    # replays only mul_, cos and exp: no sin beyond the one of cos's backward (before
    # the redesign: sin ran again too)
    assert ops.ops.count("sin.default") == plain_ops.ops.count("sin.default")
    assert ops.ops.count("mul_.Tensor") == 1 and ops.ops.count("exp.default") == 1
    assert torch.equal(x.grad, want)

    x = torch.randn(3, requires_grad=True)
    context_fn = functools.partial(tc.create_selective_checkpoint_contexts, policy_fn,
                                   allow_cache_entry_mutation=True)
    out = checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)

    # 2) No longer should be an error because of allow_cache_entry_mutation
    out.sum().backward()
    (want,) = torch.autograd.grad(fn(x).sum(), x)
    assert torch.equal(x.grad, want)


def test_version_counter_output_modified_after_the_forward():
    """(remat_fn) A kept value modified in place *outside* the region, after the
    forward, would make backward use the modified value: that raises, as torch's
    version counter does, when backward or the replay needs it; when nothing
    reads it (add's backward needs no value), it is not kept and the gradient is
    plain."""
    ctx_fn = _sac(lambda ctx, op, *a, **k: tc.CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.sin.default
                  else tc.CheckpointPolicy.PREFER_RECOMPUTE)
    x = torch.randn(3, requires_grad=True)
    out, c = checkpoint(lambda x: (lambda s: (s, s.cos()))(x.sin()), x, use_reentrant=False,
                        context_fn=ctx_fn)
    out.mul_(2)
    with pytest.raises(MutatedSavedTensorError, match="modified in place"):
        c.sum().backward()
    # JAX's rule (changed with the recorded-forward redesign): exp saves its output,
    # whose replay reads sin's output, which the policy saves, so it is kept and its
    # modification raises, as torch's SAC raises "has been mutated" here
    out, e = checkpoint(lambda x: (lambda s: (s, s.exp()))(x.sin()), x, use_reentrant=False,
                        context_fn=ctx_fn)
    out.mul_(2)
    with pytest.raises(MutatedSavedTensorError, match="modified in place"):
        torch.autograd.grad(e.sum(), x)
    # nothing reads sin's output in backward (add saves nothing): not kept, no error
    out, e = checkpoint(lambda x: (lambda s: (s, s + 1.0))(x.sin()), x, use_reentrant=False,
                        context_fn=ctx_fn)
    out.mul_(2)
    (g,) = torch.autograd.grad(e.sum(), x)
    assert torch.equal(g, torch.autograd.grad((x.sin() + 1.0).sum(), x)[0])


def test_function_with_more_than_one_output():
    """torch's test; torch asks the policy again in the recomputation (counter 2),
    remat_fn only in the forward (counter 1, docs/migration.md)."""
    # maybe there is a more systematic way:
    counter = [0]

    def policy_fn(ctx, op, *args, **kwargs):
        if op == torch.ops.aten.var_mean.correction:
            counter[0] += 1
            return tc.CheckpointPolicy.MUST_SAVE
        return tc.CheckpointPolicy.PREFER_RECOMPUTE

    # var_mean has two outputs
    def fn(x):
        a, b = torch.var_mean(x)
        return a * b

    x = torch.randn(3, requires_grad=True)
    context_fn = functools.partial(tc.create_selective_checkpoint_contexts, policy_fn)
    out = checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)
    with OpNames() as ops:
        x_grad = torch.autograd.grad(out.sum(), (x,))
    x_grad_ref = torch.autograd.grad(fn(x).sum(), (x,))
    assert_tree_close(x_grad, x_grad_ref, exact=True)
    assert counter[0] == 1
    assert ops.ops.count("var_mean.correction") == 0  # both outputs replayed


def test_function_with_non_tensor_output():
    # When SAC is enabled, the op is not computed a second time
    with torch.library._scoped_library("mylib", "FRAGMENT"):
        counter = [0]

        @torch.library.custom_op("mylib::sin_with_extra", mutates_args=())
        def sin_with_extra(x: torch.Tensor) -> tuple[torch.Tensor, int]:
            counter[0] += 1
            return x.sin(), 2

        def setup_context(ctx, inputs, output) -> torch.Tensor:
            (x,) = inputs
            ctx.save_for_backward(x)

        def backward(ctx, grad, _unused):
            (x,) = ctx.saved_tensors
            return grad * x.cos()

        torch.library.register_autograd("mylib::sin_with_extra", backward, setup_context=setup_context)

        x = torch.randn(3, requires_grad=True)

        def fn(x):
            return (torch.ops.mylib.sin_with_extra(x)[0] * x.sin().exp()).sin()

        ops_list = [torch.ops.mylib.sin_with_extra.default]

        x = torch.randn(3, requires_grad=True)
        context_fn = functools.partial(tc.create_selective_checkpoint_contexts, ops_list)
        out = checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)
        x_grad = torch.autograd.grad(out.sum(), (x,))
        assert counter[0] == 1
        x_grad_ref = torch.autograd.grad(fn(x).sum(), (x,))
        assert_tree_close(x_grad, x_grad_ref, exact=True)


def test_can_only_trigger_recompute_once():
    """torch's test.  torch's SAC raises "Trying to backward an extra time" on a
    second backward through a retained graph; remat_fn supports it (SPEC: backward
    may run more than once; docs/migration.md) and recomputes again."""

    def policy_fn(ctx, op, *args, **kwargs):
        if op == torch.ops.aten.sin.default:
            return tc.CheckpointPolicy.MUST_SAVE
        return tc.CheckpointPolicy.PREFER_RECOMPUTE

    def fn(x):
        return x.sin().cos().exp()

    x = torch.randn(3, requires_grad=True)
    context_fn = functools.partial(tc.create_selective_checkpoint_contexts, policy_fn)
    out = checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)
    out.sum().backward(retain_graph=True)
    g1, x.grad = x.grad, None

    with OpNames() as ops:
        out.sum().backward(retain_graph=True)
    assert torch.equal(x.grad, g1)
    plain = fn(x)
    with OpNames() as plain_ops:
        plain.sum().backward()
    # recomputed again: cos once more than the plain backward, sin (saved) not
    assert ops.ops.count("cos.default") == plain_ops.ops.count("cos.default") + 1
    assert ops.ops.count("sin.default") == plain_ops.ops.count("sin.default")
    x.grad = None
    # without retain_graph, a third backward is plain autograd's error
    out.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.sum().backward()


def test_remat_error_is_a_runtime_error():
    # every remat_fn error derives from RuntimeError, like torch's CheckpointError
    assert issubclass(RematError, RuntimeError)
