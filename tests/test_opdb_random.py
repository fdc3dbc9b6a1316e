"""Op-database sweep of the random ops: ``remat(op)`` against the plain ``op`` for every
OpInfo of torch's ``op_db`` that draws random numbers (dropout and its variants, ``rrelu``,
``bernoulli``, ``normal``, fractional max pooling, ``svd_lowrank``, ``pca_lowrank``), which
``tests/test_opdb.py`` leaves out: their results depend on the generator.

Each cell seeds the default generator, runs the transform on the plain function and on the
region, and compares every result (outputs, gradients, tangents) and the generator's state
after it: the recomputation must draw what the forward drew (from the state the forward drew
from, not the generator as it is then) and leave the generator where plain code leaves it,
also where backward, a ``jvp`` rule or a ``vmap`` batches it.  Under ``vmap`` the cells use
``randomness='different'`` and ``'same'`` (under ``'error'``, vmap's default, plain code
raises).  The harness (``Case``, the cells' weighted sums and cotangents) is
``tests/test_opdb.py``'s.
"""

from __future__ import annotations

import pytest

pytest.importorskip("expecttest")  # op_db imports it
pytest.importorskip("numpy")  # (and this)

import torch  # noqa: E402
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402

from remat_fn import remat  # noqa: E402

from .test_opdb import (  # noqa: E402
    CELLS,
    DEVICE,
    DTYPE,
    NOT_RANDOM,
    RANDOM_OPS,
    RANDOM_WORDS,
    Case,
    _diff,
    _gen,
    _key,
    _randn_like,
    _samples,
    _wanted,
    attempt,
    save_all,
)

SAMPLES = 2
SEED = 1234


def _random(op) -> bool:
    if not op.supports_autograd or DTYPE not in op.supported_dtypes(DEVICE) or op.name in NOT_RANDOM:
        return False
    if op.name.startswith("sparse."):  # (sparse layouts: outside the sweep, as in test_opdb)
        return False
    return op.name in RANDOM_OPS or any(w in op.name for w in RANDOM_WORDS)


OPS = {_key(op): op for op in op_db if _random(op)}
assert not any(_wanted(op) for op in OPS.values())  # (the two sweeps are disjoint)


def _stacked(case):
    return tuple(torch.stack([p, p * 0.9]) for p in case.primals)


def _vmap_vjp(randomness):
    def cell(case, fn, g):
        f = case.f(fn)
        ps = _stacked(case)
        outs = torch.func.vmap(f, randomness=randomness)(*ps)
        cts = tuple(_randn_like(o, g) for o in outs)

        def one(p, c):  # (per-example gradients: vmap(vjp))
            out, vjp_fn = torch.func.vjp(f, *p)
            return out, vjp_fn(c)
        return outs, torch.func.vmap(one, randomness=randomness)(ps, cts)
    return cell


def _grad_vmap(randomness):
    def cell(case, fn, g):
        f = torch.func.vmap(case.f(fn), randomness=randomness)
        ps = _stacked(case)
        outs, vjp_fn = torch.func.vjp(f, *ps)
        return outs, vjp_fn(tuple(_randn_like(o, g) for o in outs))
    return cell


RANDOM_CELLS = {
    "eager": CELLS["eager"], "eager_double": CELLS["eager_double"], "vjp": CELLS["vjp"],
    "vjp_nograd": CELLS["vjp_nograd"], "jvp": CELLS["jvp"], "vjp_vjp": CELLS["vjp_vjp"],
    "jvp_vjp": CELLS["jvp_vjp"],
    "vmap_vjp_different": _vmap_vjp("different"), "vmap_vjp_same": _vmap_vjp("same"),
    "vjp_vmap_different": _grad_vmap("different"), "vjp_vmap_same": _grad_vmap("same"),
}
POLICIES = {"none": None, "save_all": save_all}


def _run(run, case, fn, salt):
    """The cell's results and the default generator's state after it, from a seeded start."""
    torch.manual_seed(SEED)
    res = run(case, fn, _gen(salt))
    return res, torch.get_rng_state()


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.filterwarnings("ignore:dropout2d. Received a 3D input:UserWarning")
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("cell", list(RANDOM_CELLS))
@pytest.mark.parametrize("key", sorted(OPS))
def test_opdb_random(key, cell, policy):
    op = OPS[key]
    run = RANDOM_CELLS[cell]
    checked, skipped = 0, []
    for si, sample in enumerate(_samples(op, SAMPLES)):
        case = Case(sample)
        if not case.idx:
            skipped.append(f"sample {si}: nothing requires grad")
            continue
        salt = f"random/{key}/{cell}/{si}"
        rfn = remat(op.op, policy=POLICIES[policy])
        torch.manual_seed(SEED)
        got = attempt(si, skipped, case, op.op, lambda: _run(run, case, op.op, salt), lambda: _run(run, case, rfn, salt))
        if got is None:
            continue
        (expected, state), (actual, r_state) = got
        d = _diff(actual, expected)
        if d is not None:
            if _diff(_run(run, case, op.op, salt)[0], expected) is not None:
                skipped.append(f"sample {si}: plain is non-deterministic under a seed")
                continue
            pytest.fail(f"SILENT sample {si}: {d}", pytrace=False)
        assert torch.equal(r_state, state), f"sample {si}: the generator is left elsewhere than plain code leaves it"
        checked += 1
    if not checked:
        pytest.skip("; ".join(skipped)[:500] or "no sample")


def test_opdb_random_covers_the_random_ops():
    """The sweep sees dropout, rrelu, bernoulli and normal (a guard against an empty parametrisation)."""
    for name in ("nn.functional.dropout", "nn.functional.rrelu", "bernoulli", "normal"):
        assert name in OPS, sorted(OPS)
