"""remat_fn.nn: remat_module / apply_remat keep names, forward attributes, and give exact grads."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.func import functional_call, grad, vjp, vmap

from remat_fn.memory import LiveBytes
from remat_fn.nn import apply_remat, is_remat_module, remat_module, unremat_module

from ._util import assert_tree_close


class Block(torch.nn.Module):
    def __init__(self, d=8, p=0.0):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, 2 * d)
        self.fc2 = torch.nn.Linear(2 * d, d)
        self.drop = torch.nn.Dropout(p)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x, *, residual=True):
        h = self.fc2(self.drop(torch.tanh(self.fc1(x)))) * self.scale
        return x + h if residual else h


def make(n=3, p=0.0, d=8):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block(d, p) for _ in range(n)])


def test_remat_module_keeps_names_attributes_and_type():
    ref = make()
    net = copy.deepcopy(ref)
    blk = net[0]
    assert remat_module(blk) is blk
    assert is_remat_module(blk) and isinstance(blk, Block)
    assert list(net.state_dict()) == list(ref.state_dict())
    assert [k for k, _ in net.named_parameters()] == [k for k, _ in ref.named_parameters()]
    assert blk.fc1.in_features == 8 and blk.scale.item() == 0.5
    net.load_state_dict(ref.state_dict())
    remat_module(blk)  # idempotent
    assert type(blk).__mro__[1] is Block
    assert unremat_module(blk) is blk and type(blk) is Block


def test_apply_remat_eager_grads_equal_and_deepcopy():
    ref = make()
    net = apply_remat(copy.deepcopy(ref), lambda m: isinstance(m, Block))
    assert [is_remat_module(m) for m in net] == [True] * 3
    assert not is_remat_module(net) and not is_remat_module(net[0].fc1)
    x = torch.randn(4, 8, requires_grad=True)
    out, out_ref = net(x), ref(x)
    torch.testing.assert_close(out, out_ref)
    g = torch.autograd.grad(out.pow(2).sum(), (x, *net.parameters()))
    g_ref = torch.autograd.grad(out_ref.pow(2).sum(), (x, *ref.parameters()))
    assert_tree_close(g, g_ref)
    twin = copy.deepcopy(net)  # an independent remat module
    assert is_remat_module(twin[0])
    with torch.no_grad():
        twin[0].fc1.weight.zero_()
    assert not torch.equal(net(x), twin(x))


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_train_mode_dropout_same_seed(p):
    ref = make(p=p).train()
    net = apply_remat(copy.deepcopy(ref), lambda m: isinstance(m, Block))
    x = torch.randn(4, 8)
    torch.manual_seed(11)
    g_ref = torch.autograd.grad(ref(x).sum(), list(ref.parameters()))
    torch.manual_seed(11)
    g = torch.autograd.grad(net(x).sum(), list(net.parameters()))
    assert_tree_close(g, g_ref, exact=True)


def test_functional_call_grad_and_vmap_grad():
    ref = make()
    net = apply_remat(copy.deepcopy(ref), lambda m: isinstance(m, (Block, torch.nn.Linear)))
    params = {k: v.detach() for k, v in ref.named_parameters()}
    x = torch.randn(5, 8)

    def loss(p, x, model):
        return functional_call(model, p, (x,), {}).pow(2).sum()

    assert_tree_close(grad(loss)(params, x, net), grad(loss)(params, x, ref))
    pv = vmap(grad(loss), in_dims=(None, 0, None))
    assert_tree_close(pv(params, x, net), pv(params, x, ref), rtol=1e-5, atol=1e-6)
    # kwargs of forward pass through
    out = functional_call(net[0], {k[2:]: v for k, v in params.items() if k.startswith("0.")}, (x,),
                          {"residual": False})
    torch.testing.assert_close(out, ref[0](x, residual=False))


def test_remat_module_memory_under_vjp():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[Block(64) for _ in range(6)])
    net = apply_remat(copy.deepcopy(ref), lambda m: isinstance(m, Block))
    params = {k: v.detach() for k, v in ref.named_parameters()}
    x = torch.randn(256, 64)
    kept = {}
    for name, model in [("plain", ref), ("remat", net)]:
        with LiveBytes() as m:
            out, fn = vjp(lambda p: functional_call(model, p, (x,)), params)
            kept[name] = m.live
        g = fn(torch.ones_like(out))[0]
        kept[name + "_g"] = g
        del out, fn
    assert_tree_close(kept["remat_g"], kept["plain_g"])
    assert kept["remat"] < 0.5 * kept["plain"], kept


def test_errors():
    with pytest.raises(TypeError):
        remat_module(lambda x: x)
