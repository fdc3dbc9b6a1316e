"""Op-database sweep: ``remat(op)`` against the plain ``op`` for every OpInfo of
torch's ``op_db`` that supports autograd (float64, CPU), checked the way
functorch's ``test/functorch/test_ops.py`` checks its transforms.

Each test id is one (op, transform, policy) cell, e.g.
``test_opdb[sin-vmap_vjp-none]``.  In a cell the same transform is applied to
``f = lambda *leaves: op(*sample)`` and to the same function with the op wrapped
in ``remat(op, policy=...)``; every result (outputs, gradients, tangents,
Jacobians) must agree to ``rtol = atol = 1e-10`` (NaN equal to NaN).

The sample is flattened as functorch's ``normalize_op_input_output`` does: the
transforms differentiate the floating-point tensor leaves of
``(sample.input, sample.args, sample.kwargs)`` that require grad; every other
leaf (integer index tensors, sizes, dtypes, float tensors the OpInfo marks as
non-differentiable) is a constant the function closes over.  The region itself
is ``remat(op.op)`` called with the sample's own structure, so remat sees the
op's real pytree of arguments.  Only floating-point tensor outputs (after
``sample.output_process_fn_grad``) are differentiated.

Outcomes:

* the plain function raises, or the results differ and the plain function is
  non-deterministic or non-finite there: **skip** (nothing to compare with);
* remat raises a :class:`remat_fn.RematError`: **fail** with ``REFUSAL`` (a loud
  refusal; the goal is none for ops the plain function handles);
* remat raises anything else: **fail** with ``CRASH``;
* the results differ: **fail** with ``SILENT``.

Transforms (``CELLS``): ``eager`` (``torch.autograd.grad`` of a random-cotangent
weighted sum), ``eager_double`` (``create_graph=True`` then a second grad),
``vjp`` (inputs that require grad), ``vjp_nograd`` (detached inputs), ``jvp``,
``vmap_jvp`` (``jvp`` under ``vmap`` of a batch of two primals),
``vmap_vjp`` (batched cotangents), ``jvp_vmap`` / ``vjp_vmap`` (``jvp`` / ``vjp``
around ``vmap`` of a batch of two primals), ``vjp_vjp_vmap`` (``vjp`` of that ``vjp``),
``vmap_vjp_vmap`` (``vmap`` around it, a batch of two batches), ``vjp_vjp``, ``jvp_vjp``, ``jacrev``,
``jacfwd``, ``hessian`` (of a scalar reduction; small inputs only) and, for
OpInfos with an in-place variant, ``inplace_eager`` / ``inplace_vjp`` on the
region ``lambda x, *a: op.inplace_variant(x.clone(), *a)``.
Policies: ``none`` (the default, nothing saved), ``save_all`` (a callable that
saves every op's output; not ``everything_saveable``, which remat short-cuts to
the plain call) and ``dots`` (``policies.dots_saveable``, matmul-like ops only).

Modes (``REMAT_OPDB`` environment variable):

* unset (default, plain ``pytest``): every op, its first sample, the cells in
  ``DEFAULT_CELLS`` (~6,000 tests; about 3 minutes on 2 cores).
* ``REMAT_OPDB=full``: every cell of every op, its first ``FULL_SAMPLES`` samples
  (2; ``REMAT_OPDB_SAMPLES=n`` for more) (~13,500 tests; about 5 minutes on 2
  idle cores).

Known failures are listed in ``KNOWN`` (expected to fail, ``strict=False``).
"""

from __future__ import annotations

import os
import zlib

import pytest

pytest.importorskip("expecttest")  # op_db imports it
pytest.importorskip("numpy")  # (and this)

import torch  # noqa: E402
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402
from torch.utils._pytree import tree_flatten, tree_unflatten  # noqa: E402

import remat_fn  # noqa: E402
from remat_fn import RematError, policies, remat  # noqa: E402

MODE = os.environ.get("REMAT_OPDB", "default")
FULL = MODE == "full"
FULL_SAMPLES = int(os.environ.get("REMAT_OPDB_SAMPLES", "2"))  # samples per op in full mode
DEVICE, DTYPE = "cpu", torch.float64
RTOL = ATOL = 1e-10
# a Jacobian cell materialises (sum of input numels) x (sum of output numels)
JAC_LIMIT = 20_000
HESSIAN_IN_LIMIT = 40  # hessian: jacfwd(jacrev) over at most this many input elements

# -- which ops --------------------------------------------------------------------

RANDOM_WORDS = ("rand", "normal", "bernoulli", "dropout", "multinomial", "uniform", "cauchy",
                "exponential", "geometric", "log_normal", "poisson")
# ops that draw random numbers or are otherwise non-deterministic without a word
# above in their name (functorch's test_ops / test_vmap skip them the same way)
RANDOM_OPS = {"nn.functional.rrelu", "nn.functional.fractional_max_pool2d",
              "nn.functional.fractional_max_pool3d", "nn.functional.feature_alpha_dropout",
              "nn.functional.alpha_dropout", "randint_like", "randn_like", "empty_like",
              "empty", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided",
              "nn.functional.gaussian_nll_loss_random", "sparse.sampled_addmm", "sparse.mm",
              "torch.ops.aten._efficient_attention_forward",
              "torch.ops.aten._flash_attention_forward", "torch._scaled_mm", "torch._scaled_mm_v2",
              # draw random projections from the global generator
              "svd_lowrank", "pca_lowrank"}
# deterministic ops that a word above would drop
NOT_RANDOM = {"nn.functional.normalize", "masked.normalize", "nn.functional.poisson_nll_loss",
              "native_dropout_backward"}

DOT_WORDS = ("mm", "matmul", "linear", "einsum", "tensordot", "inner", "outer", "mv", "dot",
             "multi_dot", "conv", "bilinear", "attention", "addr", "vecdot", "chain_matmul")
NOT_DOTS = {"cummax", "cummin", "igamma", "igammac", "digamma", "lgamma", "mvlgamma", "polygamma",
            "special.polygamma", "nn.functional.upsample_bilinear", "_upsample_bilinear2d_aa",
            "signal.windows.hamming", "signal.windows.general_hamming"}


def _key(op) -> str:
    return op.name + (f"_{op.variant_test_name}" if op.variant_test_name else "")


def _wanted(op) -> bool:
    if not op.supports_autograd or DTYPE not in op.supported_dtypes(DEVICE):
        return False
    if op.name in NOT_RANDOM:
        return True
    return op.name not in RANDOM_OPS and not any(w in op.name for w in RANDOM_WORDS)


def _is_dot(op) -> bool:
    return op.name not in NOT_DOTS and any(w in op.name for w in DOT_WORDS)


OPS = {_key(op): op for op in op_db if _wanted(op)}


def save_all(ctx, op, *args, **kwargs):
    """Save every op's output (goes through remat's machinery, unlike everything_saveable)."""
    return True


POLICIES = {"none": None, "save_all": save_all, "dots": policies.dots_saveable}

# -- harness ------------------------------------------------------------------------


def _gen(salt: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(salt.encode()))


def _randn_like(t, g, batch=()):
    return torch.randn((*batch, *t.shape), generator=g, dtype=t.dtype)


class Case:
    """One sample, flattened: ``call(fn, *leaves)`` runs ``fn`` on the sample with
    ``leaves`` in place of its differentiable leaves and returns the tuple of its
    floating-point tensor outputs."""

    def __init__(self, sample, inplace=None):
        self.sample = sample
        leaves, self.spec = tree_flatten((sample.input, sample.args, sample.kwargs))
        self.leaves = leaves
        self.idx = [i for i, t in enumerate(leaves)
                    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
        self.primals = tuple(leaves[i].detach() for i in self.idx)
        self.inplace = inplace

    def region(self, fn):
        if self.inplace is None:
            return fn
        op = self.inplace
        return lambda x, *a, **k: op(x.clone(), *a, **k)

    def call(self, fn, *ds):
        ls = list(self.leaves)
        for i, d in zip(self.idx, ds):
            ls[i] = d
        inp, args, kwargs = tree_unflatten(ls, self.spec)
        out = self.sample.output_process_fn_grad(fn(inp, *args, **kwargs))
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.is_floating_point()]
        return tuple(outs)

    def f(self, fn):
        return lambda *ds: self.call(fn, *ds)


def _weighted(outs, cts):
    return sum(((o * c).sum() for o, c in zip(outs, cts)), torch.zeros((), dtype=DTYPE))


def _zeros_for_none(gs, like):
    return tuple(torch.zeros_like(x) if g is None else g for g, x in zip(gs, like))


def cell_eager(case, fn, g):
    xs = tuple(p.clone().requires_grad_() for p in case.primals)
    outs = case.call(fn, *xs)
    cts = tuple(_randn_like(o, g) for o in outs)
    gs = torch.autograd.grad(_weighted(outs, cts), xs, allow_unused=True)
    return tuple(o.detach() for o in outs), _zeros_for_none(gs, xs)


def cell_eager_double(case, fn, g):
    xs = tuple(p.clone().requires_grad_() for p in case.primals)
    outs = case.call(fn, *xs)
    cts = tuple(_randn_like(o, g) for o in outs)
    gs = torch.autograd.grad(_weighted(outs, cts), xs, allow_unused=True, create_graph=True)
    vs = tuple(_randn_like(x, g) for x in xs)
    pairs = [(gr, v) for gr, v in zip(gs, vs) if gr is not None and gr.requires_grad]
    if not pairs:
        raise _NothingToCompare("no first-order gradient requires grad")
    gs2 = torch.autograd.grad(sum((gr * v).sum() for gr, v in pairs), xs, allow_unused=True)
    return tuple(gr.detach() for gr in gs if gr is not None), _zeros_for_none(gs2, xs)


def _vjp(case, fn, g, detach):
    xs = tuple(p.clone().requires_grad_(not detach) for p in case.primals)
    outs, vjp_fn = torch.func.vjp(case.f(fn), *xs)
    return outs, vjp_fn(tuple(_randn_like(o, g) for o in outs))


def cell_vjp(case, fn, g):
    return _vjp(case, fn, g, detach=False)


def cell_vjp_nograd(case, fn, g):
    return _vjp(case, fn, g, detach=True)


def cell_jvp(case, fn, g):
    ts = tuple(_randn_like(p, g) for p in case.primals)
    return torch.func.jvp(case.f(fn), case.primals, ts)


def cell_vmap_jvp(case, fn, g):
    # (a batch of two primals, the second scaled (domains stay: positive, SPD, [-1, 1]), random tangents:
    # the forward runs on the batched tensors below the vmap, the jvp rule replays them there)
    ps = tuple(torch.stack([p, p * 0.9]) for p in case.primals)
    ts = tuple(_randn_like(p, g) for p in ps)
    return torch.func.vmap(lambda ps, ts: torch.func.jvp(case.f(fn), ps, ts))(ps, ts)


def cell_jvp_vmap(case, fn, g):
    # (jvp around vmap: no grad level, the forward keeps its tape and the jvp rule replays it on the
    # batched tensors below the vmap, its ops lifted to the jvp level)
    ps = tuple(torch.stack([p, p * 0.9]) for p in case.primals)
    ts = tuple(_randn_like(p, g) for p in ps)
    return torch.func.jvp(torch.func.vmap(case.f(fn)), ps, ts)


def cell_vjp_vmap(case, fn, g):
    # (vjp around vmap, the functional loop's batch under a grad level: backward replays the
    # recorded forward on the batched tensors below the vmap)
    ps = tuple(torch.stack([p, p * 0.9]) for p in case.primals)
    outs, vjp_fn = torch.func.vjp(torch.func.vmap(case.f(fn)), *ps)
    return outs, vjp_fn(tuple(_randn_like(o, g) for o in outs))


def cell_vjp_vjp_vmap(case, fn, g):
    # (vjp of vjp around vmap, hessian(vmap)'s shape: the inner backward replays the recorded forward on
    # the batched tensors below the vmap, under the outer vjp level, which differentiates that replay)
    ps = tuple(torch.stack([p, p * 0.9]) for p in case.primals)
    vf = torch.func.vmap(case.f(fn))
    outs = vf(*ps)
    cts = tuple(_randn_like(o, g) for o in outs)

    def h(primals, cts):
        return torch.func.vjp(vf, *primals)[1](cts)
    res, vjp_fn = torch.func.vjp(h, ps, cts)
    return res, vjp_fn(tuple(_randn_like(r, g) for r in res))


def cell_vmap_vjp_vmap(case, fn, g):
    # (vmap around vjp around vmap, each outer example's gradient apart: the replay below both vmaps)
    ps = tuple(torch.stack([torch.stack([p, p * 0.9]), torch.stack([p * 0.95, p * 0.85])]) for p in case.primals)
    vf = torch.func.vmap(case.f(fn))
    outs = torch.func.vmap(vf)(*ps)
    cts = tuple(_randn_like(o, g) for o in outs)

    def h(primals, cts):
        return torch.func.vjp(vf, *primals)[1](cts)
    return torch.func.vmap(h)(ps, cts)


def _vjp_fn_of(case, fn):
    """``(primals, cotangents) -> vjp`` as functorch's get_vjp_fn_and_args_with_cotangents."""
    f = case.f(fn)

    def h(primals, cts):
        _, vjp_fn = torch.func.vjp(f, *primals)
        return vjp_fn(cts)
    return h


def cell_vmap_jvp_vjp(case, fn, g):
    # (per-example Hessian-vector products: a jvp level above the vmap differentiates the region's
    # backward, where the aten tape's batched ops cannot replay: the forward's torch calls replay
    # instead, see remat_fn._logical)
    ps = tuple(torch.stack([p, p * 0.9]) for p in case.primals)
    outs = torch.func.vmap(case.f(fn))(*ps)
    cts = tuple(_randn_like(o, g) for o in outs)
    tps = tuple(_randn_like(p, g) for p in ps)
    h = _vjp_fn_of(case, fn)
    return torch.func.vmap(lambda p, c, t: torch.func.jvp(lambda q: h(q, c), (p,), (t,)))(ps, cts, tps)


def cell_vmap_vjp(case, fn, g):
    outs = case.call(fn, *case.primals)
    cts = tuple(_randn_like(o, g, batch=(2,)) for o in outs)
    h = _vjp_fn_of(case, fn)
    return torch.func.vmap(h, in_dims=(None, 0))(case.primals, cts)


def cell_vjp_vjp(case, fn, g):
    outs = case.call(fn, *case.primals)
    cts = tuple(_randn_like(o, g) for o in outs)
    h = _vjp_fn_of(case, fn)
    res, vjp_fn = torch.func.vjp(h, case.primals, cts)
    return res, vjp_fn(tuple(_randn_like(r, g) for r in res))


def cell_jvp_vjp(case, fn, g):
    outs = case.call(fn, *case.primals)
    cts = tuple(_randn_like(o, g) for o in outs)
    tp = tuple(_randn_like(p, g) for p in case.primals)
    tc = tuple(_randn_like(c, g) for c in cts)
    return torch.func.jvp(_vjp_fn_of(case, fn), (case.primals, cts), (tp, tc))


def _jac_size(case, fn):
    outs = case.call(fn, *case.primals)
    n_in = sum(p.numel() for p in case.primals)
    n_out = sum(o.numel() for o in outs)
    if n_in * n_out > JAC_LIMIT:
        raise _NothingToCompare(f"Jacobian too large for the sweep ({n_in} x {n_out})")


def cell_jacrev(case, fn, g):
    _jac_size(case, fn)
    return torch.func.jacrev(case.f(fn), argnums=tuple(range(len(case.primals))))(*case.primals)


def cell_jacfwd(case, fn, g):
    _jac_size(case, fn)
    return torch.func.jacfwd(case.f(fn), argnums=tuple(range(len(case.primals))))(*case.primals)


def cell_hessian(case, fn, g):
    outs = case.call(fn, *case.primals)
    if sum(p.numel() for p in case.primals) > HESSIAN_IN_LIMIT:
        raise _NothingToCompare("input too large for the hessian cell")
    cts = tuple(_randn_like(o, g) for o in outs)
    f = case.f(fn)
    return torch.func.hessian(lambda *xs: _weighted(f(*xs), cts),
                              argnums=tuple(range(len(case.primals))))(*case.primals)


CELLS = {
    "eager": cell_eager, "eager_double": cell_eager_double, "vjp": cell_vjp,
    "vjp_nograd": cell_vjp_nograd, "jvp": cell_jvp, "vmap_jvp": cell_vmap_jvp, "vmap_vjp": cell_vmap_vjp,
    "vmap_jvp_vjp": cell_vmap_jvp_vjp,
    "jvp_vmap": cell_jvp_vmap, "vjp_vmap": cell_vjp_vmap, "vjp_vjp_vmap": cell_vjp_vjp_vmap,
    "vmap_vjp_vmap": cell_vmap_vjp_vmap,
    "vjp_vjp": cell_vjp_vjp, "jvp_vjp": cell_jvp_vjp, "jacrev": cell_jacrev,
    "jacfwd": cell_jacfwd, "hessian": cell_hessian,
    "inplace_eager": cell_eager, "inplace_vjp": cell_vjp,
}
# the cells plain pytest runs (first sample of every op); REMAT_OPDB=full runs all
DEFAULT_CELLS = {("eager", "none"), ("eager_double", "none"), ("vjp", "none"), ("jvp", "none"), ("vmap_jvp", "none"),
                 ("vmap_vjp", "none"), ("jvp_vmap", "none"), ("vjp_vmap", "none"),
                 ("vjp_vjp_vmap", "none"), ("jvp_vjp", "none"), ("vmap_jvp_vjp", "none"), ("eager", "save_all"), ("vjp", "save_all"),
                 ("eager", "dots"), ("vjp", "dots"), ("inplace_eager", "none")}


class _NothingToCompare(Exception):
    pass


# -- known failures -------------------------------------------------------------------
# (op key, transform, policy) -> reason; policy "*" matches every policy.  The op key is
# ``op.name`` plus ``_variant_test_name`` when the OpInfo has one.
# reasons shared by several entries
# (Fixed, no longer listed: jvp-of-vjp and hessian cells of solve, solve_ex, tensorsolve, det,
# slogdet and logdet (silently different) and of silu, mish, logit and group_norm (forward AD
# refused their *_backward kernels): the backward ran under no_grad while a jvp level was live.)
_LCE_CHUNKED_JVP = ('crash RuntimeError: In order to use an autograd.Function with functorch transforms ..., it must '
                    'override the setup_context staticmethod (torch: no forward AD on the chunked path; plain: zero tangent)')
_EIG_VJP_VJP = ('crash RuntimeError: linalg_eig_backward: The eigenvectors in the complex case are specified up to '
                'multiplication by e^{i phi}... ill-defined (plain vjp(vjp) works)')
KNOWN: dict[tuple[str, str, str], str] = {
    ('nn.functional.mish', 'jacrev', '*'):
        ('crash RuntimeError: Batching rule not implemented for aten::mish_backward. The fallback path does not '
         'support vmap over dims of size 0 (empty sample; plain decomposes mish_backward)'),
    ('linalg.eig', 'vjp_vjp', '*'): _EIG_VJP_VJP,
    ('linalg.eig', 'vjp_vjp_vmap', '*'): _EIG_VJP_VJP,
    ('nn.functional.linear_cross_entropy_chunked', 'jvp', '*'): _LCE_CHUNKED_JVP,
    ('nn.functional.linear_cross_entropy_chunked', 'jacfwd', '*'): _LCE_CHUNKED_JVP,
    ('nn.functional.linear_cross_entropy_chunked_none', 'jvp', '*'): _LCE_CHUNKED_JVP,
    ('nn.functional.linear_cross_entropy_chunked_none', 'jacfwd', '*'): _LCE_CHUNKED_JVP,
    ('nn.functional.linear_cross_entropy_chunked', 'vmap_jvp', '*'): _LCE_CHUNKED_JVP,
    ('nn.functional.linear_cross_entropy_chunked_none', 'vmap_jvp', '*'): _LCE_CHUNKED_JVP,
    ('nn.functional.linear_cross_entropy_chunked', 'jvp_vmap', '*'): _LCE_CHUNKED_JVP,
    ('nn.functional.linear_cross_entropy_chunked_none', 'jvp_vmap', '*'): _LCE_CHUNKED_JVP,
}


def _known(key, cell, policy):
    return KNOWN.get((key, cell, policy)) or KNOWN.get((key, cell, "*"))


def _params():
    out = []
    for key, op in OPS.items():
        for cell in CELLS:
            if cell.startswith("inplace") and op.inplace_variant is None:
                continue
            for pol in POLICIES:
                if pol == "dots" and not _is_dot(op):
                    continue
                if not FULL and (cell, pol) not in DEFAULT_CELLS:
                    continue
                reason = _known(key, cell, pol)
                marks = [pytest.mark.xfail(strict=False, reason=reason)] if reason else []
                out.append(pytest.param(key, cell, pol, id=f"{key}-{cell}-{pol}", marks=marks))
    return out


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0][:300] if s else ''}"


def _flat(res):
    return [x for x in tree_flatten(res)[0]]


def _diff(a, b):
    """None when ``a`` and ``b`` (pytrees of tensors) agree, else a description."""
    la, lb = _flat(a), _flat(b)
    if len(la) != len(lb):
        return f"{len(la)} results vs {len(lb)} plain"
    for i, (x, y) in enumerate(zip(la, lb)):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return f"result {i}: {type(x).__name__} vs plain {type(y).__name__}"
        if not isinstance(x, torch.Tensor):
            if x != y:
                return f"result {i}: {x!r} vs plain {y!r}"
            continue
        try:
            torch.testing.assert_close(x, y, rtol=RTOL, atol=ATOL, equal_nan=True)
        except AssertionError as e:
            return f"result {i}: {' '.join(str(e).split())[:400]}"
    return None


def _finite(res):
    return all(torch.isfinite(x).all() for x in _flat(res) if isinstance(x, torch.Tensor))


def attempt(si: int, skipped: list, case, plain_fn, plain, region):
    """A cell on sample ``si``: ``plain()`` (where the plain function has no floating output or cannot run the cell, the
    reason is appended to ``skipped`` and None returned) then ``region()`` (a RematError fails the test as a REFUSAL,
    anything else as a CRASH); returns ``(expected, actual)``."""
    try:
        if not case.call(plain_fn, *case.primals):
            skipped.append(f"sample {si}: no floating-point output")
            return None
        expected = plain()
    except _NothingToCompare as e:
        skipped.append(f"sample {si}: {e}")
        return None
    except Exception as e:  # the plain function cannot do this cell
        skipped.append(f"sample {si}: plain raises {_first_line(e)}")
        return None
    try:
        return expected, region()
    except RematError as e:
        pytest.fail(f"REFUSAL sample {si}: {_first_line(e)}", pytrace=False)
    except Exception as e:
        pytest.fail(f"CRASH sample {si}: {_first_line(e)}", pytrace=False)


def _samples(op, n):
    torch.manual_seed(0)
    out = []
    for s in op.sample_inputs(DEVICE, DTYPE, requires_grad=True):
        out.append(s)
        if len(out) == n:
            break
    return out


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("key, cell, policy", _params())
def test_opdb(key, cell, policy):
    op = OPS[key]
    inplace = op.inplace_variant if cell.startswith("inplace") else None
    checked, skipped = 0, []
    for si, sample in enumerate(_samples(op, FULL_SAMPLES if FULL else 1)):
        if inplace is not None and not (isinstance(sample.input, torch.Tensor)
                                        and sample.input.is_floating_point()):
            skipped.append(f"sample {si}: input is not a float tensor")
            continue
        case = Case(sample, inplace)
        if not case.idx:
            skipped.append(f"sample {si}: nothing requires grad")
            continue
        run = CELLS[cell]
        plain_fn = case.region(op.op)
        salt = f"{key}/{cell}/{si}"
        rfn = case.region(remat(op.op, policy=POLICIES[policy]))
        got = attempt(si, skipped, case, plain_fn, lambda: run(case, plain_fn, _gen(salt)), lambda: run(case, rfn, _gen(salt)))
        if got is None:
            continue
        expected, actual = got
        d = _diff(actual, expected)
        if d is not None:
            again = run(case, plain_fn, _gen(salt))
            if _diff(again, expected) is not None:
                skipped.append(f"sample {si}: plain is non-deterministic")
                continue
            if not _finite(expected):
                skipped.append(f"sample {si}: plain is non-finite and remat differs")
                continue
            pytest.fail(f"SILENT sample {si}: {d}", pytrace=False)
        checked += 1
    if not checked:
        pytest.skip("; ".join(skipped)[:500] or "no sample")


def test_opdb_covers_op_db():
    """The sweep sees the autograd ops of op_db (a guard against an empty parametrisation)."""
    assert len(OPS) > 400, len(OPS)
    assert remat_fn.RematError is RematError
