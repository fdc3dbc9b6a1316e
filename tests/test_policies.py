"""Policies: gradients, recompute counts, names, offload, errors."""

from __future__ import annotations

import pytest
import torch
from torch.func import grad, vmap
from torch.utils.checkpoint import CheckpointPolicy

import remat_fn
from remat_fn import PolicyError, checkpoint_name, remat
from remat_fn import policies as P

from ._util import OpCount, assert_tree_close, grads_of


def block(x, w1, w2):
    h = torch.tanh(x @ w1)
    h = checkpoint_name(h, "h")
    u = checkpoint_name(h @ w2, "u")
    return torch.sin(u) * x


def loss(blk):
    return lambda x, w1, w2: blk(blk(x, w1, w2), w1, w2).sum()


G = torch.Generator().manual_seed(0)
X = torch.randn(6, 5, generator=G, dtype=torch.float64)
W1 = torch.randn(5, 5, generator=G, dtype=torch.float64)
W2 = torch.randn(5, 5, generator=G, dtype=torch.float64)

ALL_POLICIES = {
    "nothing": P.nothing_saveable,
    "everything": P.everything_saveable,
    "dots": P.dots_saveable,
    "dots_no_batch": P.dots_with_no_batch_dims_saveable,
    "only_h": P.save_only_these_names("h"),
    "names_but_h": P.save_any_names_but_these("h"),
    "except_h": P.save_anything_except_these_names("h"),
    "both": P.save_from_both_policies(P.dots_saveable, P.save_only_these_names("h")),
    "save_offload": P.save_and_offload_only_these_names(
        names_which_can_be_saved=["u"], names_which_can_be_offloaded=["h"], offload_src="cpu", offload_dst="cpu"),
    "offload_dots": P.offload_dot_with_no_batch_dims("cpu", "cpu"),
    "budget_0.3": P.memory_budget(0.3),
    "op_list": [torch.ops.aten.mm.default],
    "sac_callable": lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.tanh.default
    else CheckpointPolicy.PREFER_RECOMPUTE,
}


@pytest.mark.parametrize("name", list(ALL_POLICIES))
def test_policy_gradients_equal_plain(name):
    pol = ALL_POLICIES[name]
    rblk = remat(block, policy=pol)
    ref = grad(loss(block), argnums=(0, 1, 2))(X, W1, W2)
    assert_tree_close(grad(loss(rblk), argnums=(0, 1, 2))(X, W1, W2), ref, exact=True)
    # eager, with retain_graph twice
    xs, a, b = (t.clone().requires_grad_() for t in (X, W1, W2))
    y = loss(rblk)(xs, a, b)
    g1 = torch.autograd.grad(y, (xs, a, b), retain_graph=True)
    g2 = torch.autograd.grad(y, (xs, a, b))
    assert_tree_close(g1, ref, exact=True)
    assert_tree_close(g2, ref, exact=True)
    # per-sample gradients
    xs3 = X.reshape(3, 2, 5)
    ref_ps = vmap(grad(loss(block), argnums=1), in_dims=(0, None, None))(xs3, W1, W2)
    got_ps = vmap(grad(loss(rblk), argnums=1), in_dims=(0, None, None))(xs3, W1, W2)
    assert_tree_close(got_ps, ref_ps, rtol=1e-12, atol=1e-12)


def _mm_count(fn, eager: bool):
    with OpCount() as c:
        if eager:
            xs, a, b = (t.clone().requires_grad_() for t in (X, W1, W2))
            loss(fn)(xs, a, b).backward()
        else:
            grad(loss(fn), argnums=(0, 1, 2))(X, W1, W2)
    return c.n.get("mm", 0)


@pytest.mark.parametrize("eager", [True, False])
def test_recompute_counts(eager):
    plain = _mm_count(block, eager)
    n_mm_forward = 4  # 2 blocks x 2 matmuls
    # JAX's rule (changed with the recorded-forward redesign, docs/policies.md): x @ w1
    # feeds tanh, whose saved output is recomputed from it, so it is kept; no forward
    # matmul runs again, on both paths (as JAX and torch's SAC; before: plain + 2)
    assert _mm_count(remat(block, policy=P.dots_saveable), eager) == plain
    assert _mm_count(remat(block), eager) == plain + n_mm_forward
    assert _mm_count(remat(block, policy=P.everything_saveable), eager) == plain
    # names: u is h @ w2's output, so saving it skips that matmul
    assert _mm_count(remat(block, policy=P.save_only_these_names("u")), eager) == plain + 2
    # excluding u from "everything": recomputing u needs h @ w2, which reads h (tanh's
    # output, saveable: kept), so x @ w1 is not rerun (JAX's rule; before: plain + 4)
    assert _mm_count(remat(block, policy=P.save_anything_except_these_names("u")), eager) == plain + 2


def test_offload_moves_and_restores_with_counted_transfers(offloaders):
    made = offloaders
    pol = P.save_and_offload_only_these_names(names_which_can_be_offloaded=["h"], offload_src="cpu",
                                              offload_dst="cpu")
    rblk = remat(block, policy=pol)
    xs, a, b = (t.clone().requires_grad_() for t in (X, W1, W2))
    with OpCount() as c:
        y = loss(rblk)(xs, a, b)
    tanh_fwd = c.n["tanh"]
    y.backward()
    assert [o.to_dst for o in made] == [1, 1] and [o.to_src for o in made] == [1, 1]
    # tanh is not recomputed: its output comes back from the offload destination
    with OpCount() as c2:
        y = loss(rblk)(xs, a, b)
        y.backward()
    assert c2.n["tanh"] == tanh_fwd
    ref = torch.autograd.grad(loss(block)(xs, a, b), (xs, a, b))
    assert_tree_close((xs.grad, a.grad, b.grad), tuple(2 * r for r in ref), rtol=1e-12, atol=1e-12)


def test_saved_values_are_kept_offloaded_ones_are_moved():
    pol = P.save_and_offload_only_these_names(names_which_can_be_saved=["u"], names_which_can_be_offloaded=["h"],
                                              offload_src="cpu", offload_dst="cpu")
    res = remat_fn.saved_residuals(loss(remat(block, policy=pol)), X, W1, W2)
    kinds = {(r.kind, r.name) for r in res if r.kind in ("saved", "offloaded")}
    assert ("offloaded", "h") in kinds and ("saved", "u") in kinds


def test_policy_errors_name_the_fix():
    with pytest.raises(PolicyError, match="both"):
        P.save_and_offload_only_these_names(names_which_can_be_saved=["a"], names_which_can_be_offloaded=["a"])
    with pytest.raises(PolicyError, match="device"):
        P.offload_dot_with_no_batch_dims(offload_dst="nowhere")
    with pytest.raises(PolicyError, match="fraction"):
        P.memory_budget(1.5)
    with pytest.raises(PolicyError, match="aten ops"):
        remat(block, policy=["mm"])
    with pytest.raises(PolicyError, match="policy must be"):
        remat(block, policy=3)
    bad = remat(block, policy=lambda ctx, op, *a, **k: "yes")
    with pytest.raises(PolicyError, match="return value"):
        grad(loss(bad))(X, W1, W2)
    with pytest.raises(PolicyError, match="return value"):
        loss(bad)(X.clone().requires_grad_(), W1, W2)


def test_policies_are_hashable_frozen_dataclasses():
    a, b = P.save_only_these_names("x", "y"), P.save_only_these_names("y", "x")
    assert a == b and hash(a) == hash(b)
    assert P.memory_budget(0.5) == P.memory_budget(0.5)
    assert {P.offload_dot_with_no_batch_dims(), P.offload_dot_with_no_batch_dims()} == {P.offload_dot_with_no_batch_dims()}
    assert remat_fn.checkpoint_policies is P


def test_checkpoint_name_is_identity_on_pytrees():
    tree = {"a": torch.ones(2), "b": [torch.zeros(1), 3]}
    assert checkpoint_name(tree, "t") is tree
    with pytest.raises(TypeError):
        checkpoint_name(torch.ones(1), 3)


def test_sac_policy_function_unchanged_from_torch():
    """A torch SAC policy written for torch.utils.checkpoint works as is."""
    ops_to_save = [torch.ops.aten.mm.default]

    def policy_fn(ctx, op, *args, **kwargs):
        if op in ops_to_save:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    # every mm output is kept, as torch's SAC keeps it: x @ w1's output too, since
    # tanh's saved output is recomputed from it (JAX's rule since the recorded-forward
    # redesign; before: one mm per block ran again); no forward mm runs again
    assert _mm_count(remat(block, policy=policy_fn), eager=False) == _mm_count(block, eager=False)
    assert _mm_count(remat(block, policy=policy_fn), eager=True) == _mm_count(block, eager=True)


def test_in_place_update_of_a_saved_output_replays_the_forward_value():
    def f(x, w):
        h = x @ w  # saved by dots_saveable
        h.mul_(2.0)  # then modified in place inside the region
        return torch.tanh(h).sum()

    x, w = X.clone(), W1.clone().requires_grad_()
    ref = torch.autograd.grad(f(x, w), w)
    got = torch.autograd.grad(remat(f, policy=P.dots_saveable)(x, w), w)
    assert_tree_close(got, ref, exact=True)
    assert_tree_close(grad(remat(f, policy=P.dots_saveable), argnums=1)(X, W1), grad(f, argnums=1)(X, W1), exact=True)


@pytest.mark.parametrize("name", ["dots", "only_h", "offload_dots", "budget_0.3"])
def test_policy_higher_order(name):
    rblk = remat(block, policy=ALL_POLICIES[name])
    # eager double backward
    xs, a, b = (t.clone().requires_grad_() for t in (X, W1, W2))
    (ga,) = torch.autograd.grad(loss(rblk)(xs, a, b), a, create_graph=True)
    gg = torch.autograd.grad(ga.pow(2).sum(), (xs, a, b))
    xs2, a2, b2 = (t.clone().requires_grad_() for t in (X, W1, W2))
    (ga2,) = torch.autograd.grad(loss(block)(xs2, a2, b2), a2, create_graph=True)
    gg2 = torch.autograd.grad(ga2.pow(2).sum(), (xs2, a2, b2))
    assert_tree_close(gg, gg2, rtol=1e-10, atol=1e-12)
    # torch.func hessian w.r.t. the weight
    h1 = torch.func.hessian(loss(rblk), argnums=1)(X, W1, W2)
    h2 = torch.func.hessian(loss(block), argnums=1)(X, W1, W2)
    assert_tree_close(h1, h2, rtol=1e-10, atol=1e-12)


def test_dots_saveable_replays_linear_on_3d_inputs_under_grad():
    """Decompositions that depend on requires_grad must not break the replay."""
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
    x = torch.randn(2, 5, 8)
    params = {"w1": lin1.weight.detach(), "w2": lin2.weight.detach()}

    def blk(x, p):
        return torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(x, p["w1"])), p["w2"])

    def count(fn):
        with OpCount() as c:
            g = grad(lambda p: fn(x, p).pow(2).sum())(params)
        return sum(c.n.get(k, 0) for k in ("mm", "addmm", "bmm")), g

    n_plain, g_plain = count(blk)
    n_dots, g_dots = count(remat(blk, policy=P.dots_saveable))
    n_none, _ = count(remat(blk))
    # both linears' outputs are kept (the first feeds tanh, whose saved output is
    # recomputed from it: JAX's rule since the recorded-forward redesign; before: the
    # first linear ran again), so no linear is rerun; without a policy only the first
    # is: backward needs tanh's output, not the second linear's, whose op the re-run
    # skips (before the redesign: both ran again)
    assert n_dots == n_plain and n_none == n_plain + 1
    assert_tree_close(g_dots, g_plain, exact=True)


def test_grad_peak_with_name_policy_adds_only_the_saved_values():
    """Under torch.func.grad a policy keeps its saved values and nothing more."""
    from remat_fn.memory import LiveBytes

    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 64, generator=g)
    w1, w2 = torch.randn(64, 64, generator=g) / 8, torch.randn(64, 64, generator=g) / 8

    def peak(pol, use=True):
        rb = remat(block, policy=pol) if use else block
        box = {}

        def loss(w1, w2):
            h = x
            for _ in range(6):
                h = rb(h, w1, w2)
            box["kept"] = m.live  # at the end of the forward, inside grad
            return h.sum()

        with LiveBytes() as m:
            grad(loss)(w1, w2)
        with LiveBytes() as m:
            grad(loss)(w1, w2)
        return box["kept"], m.peak

    base_kept, base = peak(None)
    h_bytes = x.numel() * 4
    kept, pk = peak(P.save_only_these_names("h"))
    # after the forward: exactly the six named h (one per block) more than no policy
    assert kept == base_kept + 6 * h_bytes
    # the peak: above recompute-everything, and by no more than the kept values
    assert base < pk <= base + 6 * h_bytes
    _, plain = peak(None, use=False)
    assert pk < plain


# -- never keep more than plain autograd, never recompute for nothing ---------------
def _residual_bytes(fn, *args):
    return sum(r.nbytes for r in remat_fn.saved_residuals(fn, *args) if r.kind in ("saved", "offloaded"))


def test_save_everything_callable_keeps_no_more_than_autograd():
    ones = torch.ones(64)
    f = lambda x: (x * ones) * ones  # noqa: E731
    x = torch.randn(64)
    save_all = lambda ctx, op, *a, **k: True  # noqa: E731
    assert _residual_bytes(remat(f, policy=save_all), x) == _residual_bytes(f, x) == 0
    r = remat_fn.saved_residuals(remat(f, policy=save_all), x)
    # each mul's backward needs only `ones` (closed over, alive anyway): although the
    # policy allows every value, none is kept, and nothing is recomputed, so not even
    # the argument is held (the region no longer keeps its inputs for a re-run)
    assert [t.kind for t in r] == ["closure"], r


def _mlp_block(x, w1, w2):
    h = checkpoint_name(torch.tanh(x @ w1), "mlp_hidden")
    return x + torch.relu(h @ w2)


# what each policy keeps after the forward of 4 blocks, in units of one hidden
# activation (512x64 f32); "inputs" are the 4 block inputs (one unit together).
# "dots": JAX's rule keeps both matmul outputs of each block (x @ w1, 1 unit, which
# tanh's recomputed output reads; h @ w2, 1/4 unit, which relu's reads) and the
# inputs: as much as plain autograd here. Excluding mlp_hidden from "anything" keeps
# x @ w1's output (mlp_hidden is recomputed from it) and relu's: also plain's 6 units.
_KEPT = {"inputs": 1, "plain": 6, "dots": 1 + 4 * (1 + 0.25)}


@pytest.mark.parametrize("policy,kept_units", [
    (P.dots_saveable, "dots"), (P.save_anything_except_these_names("mlp_hidden"), "plain"),
    (P.save_only_these_names("mlp_hidden"), 1 + 4), (P.save_any_names_but_these("mlp_hidden"), "inputs"),
    (P.dots_with_no_batch_dims_saveable, "dots"), (lambda ctx, op, *a, **k: True, "plain"),
])
def test_no_policy_keeps_more_than_no_remat(policy, kept_units):
    from remat_fn.memory import LiveBytes

    torch.manual_seed(0)
    ws = [(torch.randn(16, 64, requires_grad=True), torch.randn(64, 16, requires_grad=True))
          for _ in range(4)]
    x0 = torch.randn(512, 16, requires_grad=True)  # activations dominate, as in training

    def run(blk):
        with LiveBytes() as m:
            x = x0
            for w1, w2 in ws:
                x = blk(x, w1, w2)
            kept = m.live
            x.sum().backward()
        return kept, m.peak

    plain_kept, plain_peak = run(_mlp_block)
    kept, peak = run(remat(_mlp_block, policy=policy))
    # what backward holds does not exceed plain autograd's here (JAX's rule may keep
    # more in other models: a kept value is the one the replay reads); the peak may
    # exceed plain autograd's by at most the values one region's replay rebuilds (tanh's
    # and relu's outputs, 1 + 1/4 unit; before the recorded-forward redesign the bound
    # was x @ w1's output, which dots policies now keep instead)
    assert kept <= plain_kept, (kept, plain_kept)
    assert peak <= plain_peak + (512 * 64 + 512 * 16) * 4, (peak, plain_peak)
    assert kept == _KEPT.get(kept_units, kept_units) * 512 * 64 * 4


def test_backward_needing_only_inputs_recomputes_nothing():
    calls = [0]

    def f(x):
        calls[0] += 1
        return torch.sin(x) * 2 + torch.sin(x)  # sin's backward needs only x

    x = torch.randn(5, requires_grad=True)
    remat(f)(x).sum().backward()
    assert calls[0] == 1  # JAX runs sin 0 times in backward; so does remat_fn
    assert torch.allclose(x.grad, 3 * torch.cos(x))


@pytest.mark.parametrize("how", ["eager", "vjp"])
def test_policy_saved_value_modified_in_place_raises(how):
    from torch.func import vjp

    from remat_fn import MutatedSavedTensorError

    x, w = torch.randn(3, 3), torch.randn(3, 3)
    h = remat(lambda x, w: (lambda m: (m, m.sin()))(torch.mm(x, w)), policy=P.dots_saveable)
    with pytest.raises(MutatedSavedTensorError, match="modified in place"):
        if how == "eager":
            a, b = h(x, w.clone().requires_grad_())
            a.add_(1)  # the kept matmul output, needed by sin's backward
            b.sum().backward()
        else:
            (a, b), fn = vjp(lambda w: h(x, w), w)
            a.add_(1)
            fn((torch.zeros_like(a), torch.ones_like(b)))


@pytest.mark.parametrize("policy,kept_units", [
    (None, "inputs"), (P.dots_saveable, None), (P.save_anything_except_these_names("mlp_hidden"), None),
    (lambda ctx, op, *a, **k: True, "plain"),
])
def test_no_policy_keeps_more_than_no_remat_under_grad(policy, kept_units):
    from remat_fn.memory import LiveBytes

    torch.manual_seed(0)
    ws = [(torch.randn(16, 64), torch.randn(64, 16)) for _ in range(4)]
    x0 = torch.randn(512, 16)

    def run(blk):
        box = {}

        def loss(ws, x):
            for w1, w2 in ws:
                x = blk(x, w1, w2)
            box["kept"] = meter.live  # at the end of the forward, inside grad
            return x.sum()

        with LiveBytes() as meter:
            grad(loss)(ws, x0)
        return box["kept"]

    kept, plain = run(remat(_mlp_block, policy=policy)), run(_mlp_block)
    assert kept <= plain
    assert plain == _KEPT["plain"] * 512 * 64 * 4
    if kept_units is not None:
        assert kept == _KEPT[kept_units] * 512 * 64 * 4


# -- issue 21: "Two names saved, one still recomputed" ------------------------------
def _two_names(x, w0, w1, w2):
    h = checkpoint_name(torch.tanh(x @ w0), "h")
    u = checkpoint_name(torch.tanh(h @ w1), "u")
    return (u @ w2).sin().sum()


def _backward_ops(fn, how):
    """Ops that run in backward only (the forward runs outside the counter)."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    ws = [torch.randn(8, 8, requires_grad=True) for _ in range(3)]
    if how == "eager":
        out = fn(x, *ws)
        with OpCount() as c:
            out.backward()
        grads = [w.grad for w in ws]
    else:
        out, vjp_fn = torch.func.vjp(lambda *ws: fn(x, *ws), *ws)
        with OpCount() as c:
            grads = vjp_fn(torch.ones_like(out))
    return c.n, grads


@pytest.mark.parametrize("how", ["eager", "torch.func"])
@pytest.mark.parametrize("names,tanh", [(("h", "u"), 0), (("h",), 1), (("u",), 1), ((), 2)])
def test_two_names_saved_one_still_recomputed(how, names, tanh):
    """Both named values kept: backward runs tanh 0 times (one name: 1, none: 2).

    The detach that keeps a named value was recorded in the forward's op
    sequence (and autograd under a functorch level inserts detaches the forward
    did not run), so the replay diverged after the first name."""
    pol = P.save_only_these_names(*names) if names else None
    n, grads = _backward_ops(remat(_two_names, policy=pol), how)
    assert n.get("tanh", 0) == tanh, n
    _, ref = _backward_ops(_two_names, how)
    assert_tree_close(grads, ref, exact=True)
    res = remat_fn.saved_residuals(remat(_two_names, policy=pol), torch.randn(4, 8),
                                   *[torch.randn(8, 8) for _ in range(3)])
    assert sorted(r.name for r in res if r.kind == "saved") == sorted(names)


def test_save_from_both_policies_takes_a_list_of_ops_or_one_op():
    """Inside save_from_both_policies a list of ops, or one op, means what it means as
    ``policy=`` (it was called as a policy and failed)."""
    w = torch.randn(8, 8, dtype=torch.float64)
    f = lambda x: checkpoint_name(torch.tanh(x @ w), "h").sin().sum()
    x = torch.randn(4, 8, dtype=torch.float64)
    mm = torch.ops.aten.mm.default
    for sub in ([mm], mm):
        pol = P.save_from_both_policies(sub, P.save_only_these_names("zz"))
        alone = remat_fn.saved_residuals(remat(f, policy=[mm]), x)
        both = remat_fn.saved_residuals(remat(f, policy=pol), x)
        assert [(r.kind, r.name) for r in both] == [(r.kind, r.name) for r in alone]
        assert_tree_close(torch.func.grad(remat(f, policy=pol))(x), torch.func.grad(f)(x))


# -- a name given to the result of an in-place op --------------------------------------------
# A 1-D matmul (and F.linear of a vector) ends in aten's squeeze_, so checkpoint_name keeps the
# result of that in-place op; the torch.func re-run (vmap(grad), an offloading name policy)
# returned the kept value as the op's result, which the layers above drop (an in-place op's
# result is its argument): the argument stayed the placeholder of the skipped matmul.
NAMES = {
    "save": P.save_only_these_names("h1"),
    "offload": P.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["h1"], offload_src="cpu", offload_dst="cpu"),
    "both": P.save_from_both_policies(P.nothing_saveable, P.save_only_these_names("h1")),
}
WV = W1[:4, :4] / 2


def _transforms(x):
    """Each transform of ``f(x, W)`` (x a vector or a matrix; vmap maps over rows of a matrix)."""
    xs = x if x.dim() == 2 else x.expand(2, -1)
    return {
        "grad": lambda f: grad(lambda a, b: f(a, b).sum(), argnums=(0, 1))(x, WV),
        "vjp": lambda f: torch.func.vjp(f, x, WV)[1](torch.ones_like(f(x, WV))),
        "jacrev": lambda f: torch.func.jacrev(f, argnums=(0, 1))(x, WV),
        "vmap(grad)": lambda f: vmap(grad(lambda a, b: f(a, b).sum(), argnums=(0, 1)), in_dims=(0, None))(xs, WV),
        "vmap(vjp)": lambda f: vmap(lambda a: torch.func.vjp(f, a, WV)[1](torch.ones(4, dtype=a.dtype)))(xs),
        "jvp": lambda f: torch.func.jvp(f, (x, WV), (torch.ones_like(x), torch.ones_like(WV))),
        "hessian": lambda f: torch.func.hessian(lambda a: f(a, WV).sum())(x),
        "eager": lambda f: grads_of(lambda a, b: f(a, b).sum(), (x, WV)),
    }


def _check_named(fn, policy, shape, nested):
    x = X[:3, :4] / 2 if shape == "matrix" else X[0, :4] / 2
    if nested:
        inner = remat(fn, policy=NAMES[policy])
        region = remat(lambda a, b: inner(a, b).exp(), policy=NAMES[policy])
        plain = lambda a, b: fn(a, b).exp()  # noqa: E731
    else:
        region, plain = remat(fn, policy=NAMES[policy]), fn
    for name, tr in _transforms(x).items():
        if name == "vmap(vjp)" and shape == "matrix":
            continue
        try:
            assert_tree_close(tr(region), tr(plain), rtol=1e-10, atol=1e-12)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.parametrize("nested", [False, True], ids=["one", "nested"])
@pytest.mark.parametrize("shape", ["vector", "matrix"])
@pytest.mark.parametrize("policy", list(NAMES))
def test_named_matmul_of_a_vector_equals_plain(policy, shape, nested):
    _check_named(lambda h, w: torch.tanh(checkpoint_name(h @ w, "h1")), policy, shape, nested)


@pytest.mark.parametrize("shape", ["vector", "matrix"])
@pytest.mark.parametrize("policy", ["save", "offload"])
def test_named_linear_of_a_vector_equals_plain(policy, shape):
    _check_named(lambda h, w: torch.tanh(checkpoint_name(torch.nn.functional.linear(h, w), "h1")), policy, shape, False)


IN_PLACE = {
    "mul_": lambda h, w: torch.tanh(checkpoint_name((h @ w).mul_(2), "h1")),
    "add_": lambda h, w: torch.sin(checkpoint_name(torch.sin(h @ w).add_(1), "h1")),
    "unsqueeze_": lambda h, w: torch.tanh(checkpoint_name(torch.sin(h @ w).unsqueeze_(0), "h1")).sum(0),
}


@pytest.mark.parametrize("nested", [False, True], ids=["one", "nested"])
@pytest.mark.parametrize("policy", ["save", "offload"])
@pytest.mark.parametrize("op", list(IN_PLACE))
def test_named_result_of_an_in_place_op_equals_plain(op, policy, nested):
    _check_named(IN_PLACE[op], policy, "matrix", nested)


def _written_through_a_view(h, w):
    y = torch.sin(h @ w)
    y[..., 0].mul_(2)  # the value named below is no op's output
    return torch.tanh(checkpoint_name(y, "h1"))


@pytest.mark.parametrize("policy", ["save", "offload"])
def test_named_value_written_through_a_view_is_recomputed_with_a_warning(policy):
    with pytest.warns(UserWarning, match="written in place through another view"):
        _check_named(_written_through_a_view, policy, "matrix", True)


@pytest.mark.parametrize("transform", ["hessian", "eager_gradient_penalty"])
def test_kept_matmul_written_through_unsafe_split_pieces_second_order(transform):
    """CPU ``gru_cell`` splits its ``addmm`` output with ``unsafe_split`` (no alias in its schema)
    and writes the pieces in place (``add_``, ``sigmoid_``): under ``dots_saveable`` the kept
    ``addmm`` output was handed to the replay as it is, which wrote into it, so a second replay
    (second order) read the first one's writes (Hessian 1.57 off, a gradient penalty's
    ``weight_ih.grad`` 8.11 off; found by a hostile pass).  The split's pieces are its aliases now."""
    torch.manual_seed(0)
    cell = torch.nn.GRUCell(3, 3).double()
    x0 = torch.randn(2, 3, dtype=torch.float64)
    w0 = torch.randn(3, 3, dtype=torch.float64) * 0.3
    f = lambda x: cell(x, 2 * x)  # noqa: E731

    def run(fn):
        if transform == "hessian":
            return torch.func.hessian(lambda w: fn(x0 @ w).pow(2).sum())(w0)
        cell.zero_grad()
        x = x0.clone().requires_grad_()
        (gx,) = torch.autograd.grad(fn(x).pow(2).sum(), x, create_graph=True)
        gx.pow(2).sum().backward()
        return [p.grad.clone() for p in cell.parameters()]

    assert_tree_close(run(remat(f, policy=P.dots_saveable)), run(f), rtol=1e-10, atol=1e-10)
