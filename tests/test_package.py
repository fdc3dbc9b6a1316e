"""The package surface: lazy submodules, early policy errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

import remat_fn
from remat_fn import PolicyError, policies, remat


def test_submodules_reachable_after_import_and_loaded_lazily():
    code = (
        "import sys, remat_fn\n"
        "lazy = ['random', 'compat', 'nn', 'distributed']\n"
        "assert not any(f'remat_fn.{m}' in sys.modules for m in lazy), sorted(sys.modules)\n"
        "assert remat_fn.random.key(0).shape == (2,)\n"
        "assert callable(remat_fn.compat.checkpoint) and callable(remat_fn.nn.remat_module)\n"
        "assert callable(remat_fn.distributed.remat)\n"
        "assert remat_fn.policies is remat_fn.checkpoint_policies\n"
        "assert 'distributed' in dir(remat_fn)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        remat_fn.nope  # noqa: B018


@pytest.mark.parametrize("bad,match", [
    (policies.save_only_these_names, r"factory.*save_only_these_names\(\.\.\.\)"),
    (policies.memory_budget, r"factory.*memory_budget\(\.\.\.\)"),
    ("dots_saveable", r"string 'dots_saveable'.*policies\.dots_saveable"),
    ("no_such_policy", r"string 'no_such_policy'"),
    (3, r"got int 3.*Fix"),
])
def test_misused_policies_are_refused_when_remat_is_built(bad, match):
    with pytest.raises(PolicyError, match=match):
        remat(lambda x: x, policy=bad)  # refused here, not at the first call
    with pytest.raises(PolicyError, match=match):
        remat(policy=bad)
