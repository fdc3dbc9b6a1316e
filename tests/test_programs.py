"""Hypothesis: random programs over a wide op set, through every transform with every
built-in policy, against the plain function.

Programs work on ``(4, 6)`` float64 values: views, ``cat``/``split``, ``where``,
``cumsum``, ``sort``/``topk``, ``einsum``, gather/scatter, ``layer_norm``,
``softmax``, ``conv1d``, matmuls with closed-over weights (some constant, some
differentiated), named values.  Outputs are pytrees that include an
unregistered dataclass, an integer and a boolean tensor.

Programs with one extra feature each (a ``@given`` test per feature, so a failure
names the feature), compared with the plain function in eager autograd and under
``torch.func`` (value, gradients w.r.t. the inputs and the closed-over tensors, the
final contents of every outside tensor, the global RNG state after the call):

* ``custom_random``: random aten ops (dropout, ``rand_like``, ``bernoulli``) and a
  ``torch.library.custom_op`` that draws with ``torch.rand`` inside its kernel (as
  fused dropout kernels do), the global RNG seeded alike for both runs;
* ``subclass``: ``nn.Parameter`` subclasses, ``as_subclass`` tensors and a
  ``__torch_dispatch__`` wrapper, as inputs and closed over, written in place
  through views and ``.data`` inside the region;
* ``alias``: closed-over views of a closed-over base, read and written both ways
  inside the region; the same tensor passed as two arguments;
* ``write_after_save``: in-place writes on intermediates, also on values autograd
  saved (eager under ``allow_mutation_on_saved_tensors``).

A program plain torch rejects is skipped; a write into an input may be refused
with ``RematError`` (documented), provided nothing was written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import optree
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import grad, jacrev, jvp, vjp, vmap
from torch.utils._pytree import tree_map

from remat_fn import RematError, checkpoint_name, policies, remat

from ._util import assert_tree_close, draw_steps

SHAPE = (4, 6)
_g = torch.Generator().manual_seed(1234)
W = torch.randn(6, 6, generator=_g, dtype=torch.float64) / 3
# the weights the programs close over, differentiated by every transform: ``run``
# swaps a differentiated tensor in, as torch.func.functional_call does
PARAMS = {"W": W}
K = torch.randn(1, 1, 3, generator=_g, dtype=torch.float64)  # constant closure
IDX = torch.stack([torch.randperm(6, generator=_g) for _ in range(4)])  # constant index

UNARY = {
    "sin": torch.sin,
    "tanh": torch.tanh,
    "softmax": lambda t: torch.softmax(t, dim=-1),
    "layer_norm": lambda t: F.layer_norm(t, (6,)),
    "cumsum": lambda t: torch.cumsum(t, dim=-1),
    "views": lambda t: t.reshape(24).view(6, 4).t().unsqueeze(0).squeeze(0).t().reshape(4, 6),
    "cat_split": lambda t: torch.cat(t.split([2, 4], dim=1)[::-1], dim=1),
    "sort": lambda t: torch.sort(t, dim=-1).values,
    "topk": lambda t: torch.cat([torch.topk(t, 3).values, -torch.topk(-t, 3).values], dim=-1),
    "gather": lambda t: t.gather(1, IDX),
    "scatter": lambda t: torch.zeros_like(t).scatter(1, IDX, t),
    "conv1d": lambda t: F.conv1d(t.unsqueeze(1), K, padding=1).squeeze(1),
    "einsum_w": lambda t: torch.einsum("ij,jk->ik", t, PARAMS["W"]),
    "matmul_w": lambda t: t @ PARAMS["W"],
    "named": lambda t: checkpoint_name(torch.sin(t) * 2, "h"),
}
BINARY = {
    "add": torch.add,
    "mul": torch.mul,
    "where": lambda a, b: torch.where(a > 0, a, b),
    "bmm": lambda a, b: torch.bmm(a.unsqueeze(0), b.t().unsqueeze(0)).squeeze(0) @ PARAMS["W"][:4, :],
}

POLICIES = {
    "none": None,
    "everything": policies.everything_saveable,
    "dots": policies.dots_saveable,
    "dots_no_batch": policies.dots_with_no_batch_dims_saveable,
    "only_h": policies.save_only_these_names("h"),
    "except_h": policies.save_anything_except_these_names("h"),
    "offload_h": policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=("h",),
        offload_src="cpu", offload_dst="cpu"),
    "budget": policies.memory_budget(0.5),
}
TRANSFORMS = ["eager", "grad", "vjp", "vmap_grad", "jacrev", "jvp", "grad_grad", "vmap_jvp_grad", "grad_vmap_grad"]


@dataclasses.dataclass
class Extra:  # deliberately not registered with optree
    h: torch.Tensor


@st.composite
def programs(draw):
    n_in = draw(st.integers(1, 3))
    steps, n_vals = draw_steps(draw, st, n_in, 5, UNARY, BINARY)
    outs = draw(st.lists(st.integers(0, n_vals - 1), min_size=1, max_size=3))
    extra = draw(st.integers(0, n_vals - 1))
    return n_in, steps, outs, extra


def build(program):
    n_in, steps, outs, extra = program

    def fn(xs):
        vals = list(xs)
        for s in steps:
            if s[0] == "u":
                vals.append(UNARY[s[1]](vals[s[2]]))
            else:
                vals.append(BINARY[s[1]](vals[s[2]], vals[s[3]]))
        last = vals[-1]
        return {"outs": [vals[i] for i in outs], "extra": Extra(vals[extra]),
                "argmax": last.argmax(dim=-1), "pos": last > 0, "n": len(steps)}

    return fn


def scalar(fn, n_in, wrt):
    """A scalar loss of the differentiated inputs ``wrt``; the others are constants."""

    def loss(*diff, consts):
        xs = list(consts)
        for i, d in zip(wrt, diff):
            xs[i] = d
        out = fn(xs[:n_in])
        total = sum((o * o).sum() for o in out["outs"]) + out["extra"].h.sin().sum()
        total = total + sum((x * x).sum() for x in diff) * 0.01  # every input is used
        return total + (out["pos"] * out["outs"][0]).sum() * 0.5

    return loss


def run(transform, fn, xs, wrt):
    """``transform`` of the loss of ``fn`` w.r.t. the inputs ``wrt`` and the closed-over
    weights ``PARAMS["W"]`` (swapped in for the call, as functional_call does)."""
    loss = scalar(fn, len(xs), wrt)
    diff = [xs[i] for i in wrt] + [W]

    def f(*d):
        *d, w = d
        PARAMS["W"] = w
        try:
            return loss(*d, consts=xs)
        finally:
            PARAMS["W"] = W

    n = len(diff)
    if transform == "eager":
        ds = [d.clone().requires_grad_(True) for d in diff]
        return torch.autograd.grad(f(*ds), ds, allow_unused=True, materialize_grads=True)
    if transform == "grad":
        return grad(f, argnums=tuple(range(n)))(*diff)
    if transform == "vjp":
        out, fn_ = vjp(f, *diff)
        return fn_(torch.ones_like(out))
    if transform == "vmap_grad":
        batched = [torch.stack([d, d * 0.5 + 0.1]) for d in diff[:-1]]
        return vmap(grad(f, argnums=tuple(range(n))), in_dims=(*([0] * (n - 1)), None))(*batched, W)
    if transform == "jacrev":
        return jacrev(lambda d0, w: f(d0, *diff[1:-1], w), argnums=(0, 1))(diff[0], W)
    if transform == "jvp":
        return jvp(f, tuple(diff), tuple(torch.ones_like(d) for d in diff))
    if transform == "grad_grad":  # a Hessian-vector product, w.r.t. the input and W
        g = lambda d0, w: grad(lambda y, v: f(y, *diff[1:-1], v), argnums=(0, 1))(d0, w)  # noqa: E731
        return jvp(g, (diff[0], W), (torch.ones_like(diff[0]), torch.ones_like(W)))[1]
    batched = [torch.stack([d, d * 0.5 + 0.1]) for d in diff[:-1]]
    if transform == "vmap_jvp_grad":  # per-example Hessian-vector products w.r.t. W (see remat_fn._logical)
        hvp = lambda *d: jvp(lambda w: grad(lambda v: f(*d, v))(w), (W,), (torch.ones_like(W),))[1]  # noqa: E731
        return vmap(hvp)(*batched)
    if transform == "grad_vmap_grad":  # MAML: an inner step on W per example, the meta-gradient
        def task(w, *d):
            return f(*d, w - 0.1 * grad(lambda v: f(*d, v))(w))
        return grad(lambda w: vmap(task, in_dims=(None, *([0] * (n - 1))))(w, *batched).sum())(W)
    raise AssertionError(transform)


@settings(max_examples=120, deadline=None)
@given(program=programs(), policy=st.sampled_from(sorted(POLICIES)),
       transform=st.sampled_from(TRANSFORMS), seed=st.integers(0, 2**16), data=st.data())
def test_random_programs_every_transform_every_policy(program, policy, transform, seed, data):
    n_in = program[0]
    wrt = data.draw(st.lists(st.integers(0, n_in - 1), min_size=1, max_size=n_in, unique=True))
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(SHAPE, generator=g, dtype=torch.float64) for _ in range(n_in)]
    fn = build(program)
    rfn = remat(fn, policy=POLICIES[policy])
    # the forward: same values, the same pytree (non-tensor leaves, int/bool outputs)
    out_r, out_p = rfn(xs), fn(xs)
    assert_tree_close(optree.tree_map(lambda e: e.h if isinstance(e, Extra) else e, out_r,
                                      is_leaf=lambda e: isinstance(e, Extra)),
                      optree.tree_map(lambda e: e.h if isinstance(e, Extra) else e, out_p,
                                      is_leaf=lambda e: isinstance(e, Extra)), exact=True)
    got = run(transform, rfn, xs, sorted(wrt))
    want = run(transform, fn, xs, sorted(wrt))
    assert_tree_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_unary_op_under_grad_with_each_policy(policy):
    """Each op of the set on its own: a deterministic floor under the random search."""
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for name, op in UNARY.items():
        fn = lambda xs, op=op: {"outs": [op(xs[0])], "extra": Extra(xs[0]),  # noqa: E731
                                "argmax": xs[0].argmax(-1), "pos": xs[0] > 0, "n": 1}
        got = run("grad", remat(fn, policy=POLICIES[policy]), [x], [0])
        want = run("grad", fn, [x], [0])
        assert_tree_close(got, want, rtol=1e-10, atol=1e-12), name


# --- programs with one extra feature each -----------------------------------------
# examples per feature test; REMAT_TEST_PROGRAM_EXAMPLES=500 for a longer search
N_FEATURE = int(os.environ.get("REMAT_TEST_PROGRAM_EXAMPLES", "25"))


@torch.library.custom_op("remat_test::rand_mask", mutates_args=())
def rand_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """A fused-dropout-like kernel: draws from the global generator inside the op."""
    return (torch.rand(x.shape, dtype=x.dtype, device=x.device) >= p).to(x.dtype) / (1 - p)


@rand_mask.register_fake
def _(x, p):
    return torch.empty_like(x)


class MyParam(nn.Parameter):
    pass


class Tagged(torch.Tensor):  # keeps its type through every op (``__torch_function__``)
    pass


class Wrap(torch.Tensor):
    """A ``__torch_dispatch__`` wrapper: runs every op on the tensor it holds."""

    @staticmethod
    def __new__(cls, elem, requires_grad=False):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(), storage_offset=elem.storage_offset(),
                                                   dtype=elem.dtype, device=elem.device, requires_grad=requires_grad)

    def __init__(self, elem, requires_grad=False):
        self.elem = elem

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.elem if isinstance(t, Wrap) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda t: Wrap(t) if type(t) is torch.Tensor else t, out)


def _no_grad(write):
    with torch.no_grad():
        write()


def _then(t, write):
    write()
    return t


def _save_then_mul(t):
    y = t.sin()
    t.mul_(2)
    return y + t


def _fresh_save_then_mul(t):
    h = t * 3
    y = h.sin()
    h.mul_(2)
    return y * h


def _read_write_read(t, env):
    a = t * env["va"]
    _no_grad(lambda: env["base"][0].copy_(t[1] * 0.5))
    return a + t * env["va"]


# each op takes a value and the closed-over tensors ``env`` (fresh for every run)
FEATURE_OPS = {
    "custom_random": {
        "rand_mask": lambda t, env: t * rand_mask(t.detach(), 0.3),
        "dropout": lambda t, env: F.dropout(t, 0.3, training=True),
        "rand_like": lambda t, env: t + torch.rand_like(t),
        "randn_like": lambda t, env: t * (1 + 0.1 * torch.randn_like(t)),
        "bernoulli": lambda t, env: t * torch.bernoulli(torch.sigmoid(t)),
        "bernoulli_": lambda t, env: t * torch.empty_like(t).bernoulli_(0.7),
    },
    "subclass": {
        "matmul_P": lambda t, env: t @ env["P"],
        "matmul_T": lambda t, env: t @ env["T"],
        "matmul_Wr": lambda t, env: t @ env["Wr"],
        "P_data_mul": lambda t, env: _then(t, lambda: env["P"].data.mul_(0.5)),
        "P_view_write": lambda t, env: _then(t, lambda: _no_grad(lambda: env["P"][0:2].mul_(2))),
        "T_view_write": lambda t, env: _then(t, lambda: _no_grad(lambda: env["T"][:, 1].copy_(t[0] * 0.1))),
        "Wr_data_mul": lambda t, env: _then(t, lambda: env["Wr"].data.mul_(0.5)),
        "Wr_view_write": lambda t, env: _then(t, lambda: _no_grad(lambda: env["Wr"][2:4].mul_(0.5))),
        "value_view_write": lambda t, env: _then(t, lambda: _no_grad(lambda: t[0:2].mul_(2))),
    },
    "alias": {
        "read_va": lambda t, env: t * env["va"],
        "read_vb": lambda t, env: t + env["vb"],
        "read_base": lambda t, env: t * env["base"],
        "write_base_row": lambda t, env: _then(t, lambda: _no_grad(lambda: env["base"][0].copy_(t[1] * 0.5))),
        "write_base": lambda t, env: _then(t, lambda: _no_grad(lambda: env["base"].mul_(0.75))),
        "write_va": lambda t, env: _then(t, lambda: _no_grad(lambda: env["va"].mul_(-1.5))),
        "write_vb": lambda t, env: _then(t, lambda: _no_grad(lambda: env["vb"].copy_(t[:, 2:3]))),
        "read_write_read": _read_write_read,
        # (writes of region values into a captured tensor are errors under torch.func)
        "write_base_row_from_base": lambda t, env: _then(t, lambda: _no_grad(lambda: env["base"][0].copy_(env["base"][1] * 0.5))),
        "write_vb_from_va": lambda t, env: _then(t, lambda: _no_grad(lambda: env["vb"].copy_(env["va"][2:6, None]))),
    },
    "write_after_save": {
        "mul_": lambda t, env: t.mul_(2),
        "sin_": lambda t, env: t.sin_(),
        "view_add_": lambda t, env: _then(t, lambda: t[0:2].add_(1)),
        "no_grad_mul_": lambda t, env: _then(t, lambda: _no_grad(lambda: t.mul_(0.5))),
        "save_then_mul": lambda t, env: _save_then_mul(t),
        "fresh_save_then_mul": lambda t, env: _fresh_save_then_mul(t),
    },
}
# the transforms plain torch runs each feature under (jacrev and vmap refuse the
# global RNG; vmap/jacrev of in-place writes into captured tensors are errors too)
FEATURE_TRANSFORMS = {
    "custom_random": ["eager", "grad", "vjp", "jvp", "grad_grad"],
    "subclass": ["eager", "grad", "vjp", "jvp"],
    "alias": ["eager", "grad", "vjp", "jvp"],
    "write_after_save": ["eager", "eager_allow_mutation", "grad", "vjp", "jvp", "grad_grad"],
}
INPUT_KINDS = ["plain", "myparam", "tagged", "wrap"]


def make_env(feature, seed, eager):
    """The closed-over tensors, fresh for each run; ``diff``: those differentiated (in
    eager they are the leaves themselves; torch.func transforms swap them in)."""
    g = torch.Generator().manual_seed(seed + 1)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    env, diff = {}, []
    if feature == "subclass":
        env["P"] = MyParam(r(6, 6) / 3)
        env["T"] = (r(6, 6) / 3).as_subclass(Tagged).requires_grad_(True)
        env["Wr"] = Wrap(r(6, 6) / 3, requires_grad=True)
        diff = ["P", "T", "Wr"]
    elif feature == "alias":
        env["base"] = r(4, 6).requires_grad_(eager)  # differentiated through its views in eager
        env["va"], env["vb"] = env["base"][0], env["base"][:, 0:1]
        diff = ["base"] if eager else []
    return env, diff


def make_input(kind, x):
    if kind == "myparam":
        return MyParam(x)
    if kind == "tagged":
        return x.as_subclass(Tagged)
    if kind == "wrap":
        return Wrap(x)
    return x


def _plain_tensor(t):
    if isinstance(t, Wrap):
        t = t.elem
    return t.detach().as_subclass(torch.Tensor).clone() if isinstance(t, torch.Tensor) else t


@st.composite
def feature_programs(draw, feature):
    """Like ``programs``, with about one step in three an op of ``feature``."""
    n_in = n_vals = draw(st.integers(1, 3))
    ops = sorted(FEATURE_OPS[feature])
    steps = []
    for _ in range(draw(st.integers(2, 7))):
        kind = draw(st.sampled_from("ffubb" if steps else "f"))  # begins with one
        if kind == "f":
            steps.append(("u", f"{feature}:{draw(st.sampled_from(ops))}", draw(st.integers(0, n_vals - 1))))
        elif kind == "u":
            steps.append(("u", draw(st.sampled_from(sorted(UNARY))), draw(st.integers(0, n_vals - 1))))
        else:
            steps.append(("b", draw(st.sampled_from(sorted(BINARY))),
                          draw(st.integers(0, n_vals - 1)), draw(st.integers(0, n_vals - 1))))
        n_vals += 1
    outs = draw(st.lists(st.integers(0, n_vals - 1), min_size=1, max_size=3))
    extra = draw(st.integers(0, n_vals - 1))
    kinds = [draw(st.sampled_from(INPUT_KINDS)) if feature == "subclass" else "plain" for _ in range(n_in)]
    # the same tensor passed as two arguments: input i is input same[i]
    same = [draw(st.integers(0, i)) if feature == "alias" else i for i in range(n_in)]
    return feature, n_in, steps, outs, extra, kinds, same


def build_feature(program, env, types):
    feature, n_in, steps, outs, extra, _, _ = program

    def fn(xs):
        vals = list(xs)
        for s in steps:
            if s[0] == "u" and ":" in s[1]:
                vals.append(FEATURE_OPS[feature][s[1].split(":")[1]](vals[s[2]], env))
            elif s[0] == "u":
                vals.append(UNARY[s[1]](vals[s[2]]))
            else:
                vals.append(BINARY[s[1]](vals[s[2]], vals[s[3]]))
        last = vals[-1]
        types.append([type(vals[i]).__name__ for i in outs])
        return {"outs": [vals[i] for i in outs], "extra": Extra(vals[extra]),
                "argmax": last.argmax(dim=-1), "pos": last > 0, "n": len(steps)}

    return fn


def run_feature(transform, program, wrap_fn, policy, seed, wrt):
    """Run ``transform`` of the loss of ``program`` (``wrap_fn`` of it: itself or a
    remat) on fresh inputs and closed-over tensors, the global RNG seeded with
    ``seed``; returns everything the caller sees afterwards."""
    feature, n_in, _, _, _, kinds, same = program
    eager = transform.startswith("eager")
    env, env_diff = make_env(feature, seed, eager)
    g = torch.Generator().manual_seed(seed)
    uniq = {i: make_input(kinds[i], torch.randn(SHAPE, generator=g, dtype=torch.float64)) for i in sorted(set(same))}
    types = []
    fn = wrap_fn(build_feature(program, env, types), policy)
    wrt = sorted({same[i] for i in wrt})
    versions = {i: uniq[i]._version for i in uniq}

    def loss(*d):
        d_in, d_env = d[:len(wrt)], d[len(wrt):]
        xs = dict(uniq)
        xs.update(zip(wrt, d_in))
        saved = {k: env[k] for k in env_diff}
        if not eager:
            env.update(zip(env_diff, d_env))  # as torch.func.functional_call does
        try:
            out = fn([xs[same[i]] for i in range(n_in)])
        finally:
            env.update(saved)
        total = sum((o * o).sum() for o in out["outs"]) + out["extra"].h.sin().sum()
        total = total + sum((x * x).sum() for x in d_in) * 0.01
        return total + (out["pos"] * out["outs"][0]).sum() * 0.5

    if eager:
        for i in wrt:
            uniq[i].requires_grad_(True)
    diff = [uniq[i] for i in wrt] + [env[k] for k in env_diff]
    n = len(diff)
    before = ([_plain_tensor(uniq[i]) for i in sorted(uniq)], {k: _plain_tensor(v) for k, v in env.items()})
    torch.manual_seed(seed)
    try:
        res = _transformed(transform, loss, diff, n)
    except RematError as e:  # what the caller is left with after a refusal
        return {"refused": e, "before": before, "inputs": [_plain_tensor(uniq[i]) for i in sorted(uniq)],
                "env": {k: _plain_tensor(v) for k, v in env.items()}}
    return {"res": optree.tree_map(_plain_tensor, res), "types": types,
            "inputs": [_plain_tensor(uniq[i]) for i in sorted(uniq)],
            "inputs_written": any(uniq[i]._version != versions[i] for i in uniq),
            "env": {k: _plain_tensor(v) for k, v in env.items()}, "rng": torch.get_rng_state()}


def _transformed(transform, loss, diff, n):
    if transform.startswith("eager"):
        ctx = torch.autograd.graph.allow_mutation_on_saved_tensors() if transform == "eager_allow_mutation" else contextlib.nullcontext()
        with ctx:
            value = loss(*diff)
            torch.rand(3)  # the generator moves on between the forward and the backward
            with torch._C.DisableTorchFunctionSubclass():  # (Tagged would claim Wrap's gradient)
                return value, torch.autograd.grad(value, diff, allow_unused=True, materialize_grads=True)
    if transform == "grad":
        return torch.func.grad_and_value(loss, argnums=tuple(range(n)))(*diff)
    if transform == "vjp":
        value, fn_ = vjp(loss, *diff)
        return value, fn_(torch.ones_like(value))
    if transform == "jvp":
        return jvp(loss, tuple(diff), tuple(torch.ones_like(d) for d in diff))
    if transform == "grad_grad":  # a Hessian-vector product w.r.t. the first input
        gfn = lambda d0: grad(loss, argnums=tuple(range(n)))(d0, *diff[1:])  # noqa: E731
        return jvp(gfn, (diff[0],), (torch.ones_like(diff[0]),))
    raise AssertionError(transform)


def check_feature(program, policy, transform, seed, wrt):
    try:
        want = run_feature(transform, program, lambda f, p: f, None, seed, wrt)
    except Exception:  # noqa: BLE001 - a program plain torch rejects is no test case
        want = None
    assume(want is not None)
    got = run_feature(transform, program, lambda f, p: remat(f, policy=p), POLICIES[policy], seed, wrt)
    if "refused" in got:  # documented: a write into an input is refused before anything is written
        if not want["inputs_written"]:
            raise got["refused"]
        assert_tree_close((got["inputs"], got["env"]), got["before"], exact=True)
        return
    assert got["types"][0] == want["types"][0], (got["types"], want["types"])
    assert_tree_close(got["res"], want["res"], rtol=1e-10, atol=1e-12)
    assert_tree_close(got["env"], want["env"], exact=True)
    assert_tree_close(got["inputs"], want["inputs"], exact=True)
    assert torch.equal(got["rng"], want["rng"]), "the global generator ends elsewhere than plain leaves it"


def _feature_test(feature):
    # (explain: minutes; filter_too_much: programs plain torch rejects are filtered out, and some draws of
    # the alias programs are mostly such: hypothesis's health check failed one full run on it, remat untested)
    @settings(max_examples=N_FEATURE, deadline=None, phases=[p for p in Phase if p != Phase.explain],
              suppress_health_check=[HealthCheck.filter_too_much])
    @given(program=feature_programs(feature), policy=st.sampled_from(sorted(POLICIES)),
           transform=st.sampled_from(FEATURE_TRANSFORMS[feature]), seed=st.integers(0, 2**16), data=st.data())
    def test(program, policy, transform, seed, data):
        n_in = program[1]
        wrt = data.draw(st.lists(st.integers(0, n_in - 1), min_size=1, max_size=n_in, unique=True))
        check_feature(program, policy, transform, seed, wrt)

    test.__name__ = f"test_programs_with_{feature}"
    return test


test_programs_with_custom_random_ops = _feature_test("custom_random")
test_programs_with_tensor_subclasses = pytest.mark.xfail(
    strict=False,
    reason="under torch.func, where eager remat runs these programs (the capture path threads closed-over "
           "tensors, issue 31): a no_grad write into a differentiated wrapper subclass the region closes over "
           "does not reach the caller's tensor (silent; found with REMAT_TEST_PROGRAM_EXAMPLES=150); the function "
           "sees an as_subclass tensor as a plain Tensor; a write into a captured tensor is refused (RematError "
           "or functorch's error)")(_feature_test("subclass"))
test_programs_with_aliases_of_outside_tensors = _feature_test("alias")
test_programs_with_writes_after_save = _feature_test("write_after_save")
