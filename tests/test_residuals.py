"""saved_residuals / print_saved_residuals."""

from __future__ import annotations

import pytest
import torch

import remat_fn
from remat_fn import checkpoint_name, remat, saved_residuals
from remat_fn import policies as P
from remat_fn.memory import LiveBytes

W1 = torch.randn(32, 32)
W2 = torch.randn(32, 32)


def block(x):
    h = checkpoint_name(torch.tanh(x @ W1), "hidden")
    return torch.sin(h @ W2)


def model(blk):
    return lambda inp: blk(blk(inp["x"])).sum()


POLS = {"plain": None, "remat": P.nothing_saveable, "dots": P.dots_saveable,
        "names": P.save_only_these_names("hidden"),
        "offload": P.save_and_offload_only_these_names(names_which_can_be_offloaded=["hidden"], offload_src="cpu")}


@pytest.mark.parametrize("which", list(POLS))
def test_byte_totals_match_meter(which):
    blk = block if which == "plain" else remat(block, policy=POLS[which])
    x = torch.randn(16, 32)
    res = saved_residuals(model(blk), {"x": x})
    inter = sum(r.nbytes for r in res if r.kind in ("saved", "offloaded"))
    xr = x.clone().requires_grad_()
    with LiveBytes() as m:
        y = model(blk)({"x": xr})
        live = m.live - y.untyped_storage().nbytes()
    assert abs(inter - live) <= 0.01 * max(live, 1), (inter, live)


def test_kinds_names_ops_and_sources():
    x = torch.randn(16, 32)
    res = saved_residuals(model(remat(block, policy=P.save_only_these_names("hidden"))), {"x": x})
    args = [r for r in res if r.kind == "argument"]
    assert [r.source for r in args] == ["args[0]['x']"]
    named = [r for r in res if r.name == "hidden"]
    assert named and all(r.op == "aten.tanh" and "test_residuals.py" in r.source for r in named)
    closures = {r.source for r in res if r.kind == "closure"}
    assert closures == {"W1", "W2"}


def test_plain_remat_keeps_only_argument():
    f = remat(lambda x: torch.sin(torch.sin(x @ W1)))
    res = saved_residuals(f, torch.randn(4, 32))
    assert {r.kind for r in res} == {"argument", "closure"}


def test_print_format(capsys):
    remat_fn.print_saved_residuals(model(remat(block, policy=P.dots_saveable)), {"x": torch.randn(16, 32)})
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("f32[16,32] output of aten.mm from test_residuals.py:") for line in out)
    assert out[-1].startswith("total: ")


def test_refused_inside_transform():
    with pytest.raises(remat_fn.RematError, match="outside"):
        torch.func.grad(lambda x: (saved_residuals(torch.sin, x), x.sum())[1])(torch.randn(2))
