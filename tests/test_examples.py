"""Smoke tests: every script in examples/ runs (tiny sizes, in a subprocess) and says OK."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# script -> text its output must contain
EXPECTED = {
    "quickstart.py": "remat=True",
    "per_sample_grads.py": "matches a loop: OK",
    "maml.py": "equals the plain one (second order): OK",
    "hvp.py": "matches torch.func.hessian",
    "hf_compat.py": "enable_hf_remat",
}


def run(script: str) -> str:
    env = dict(os.environ, REMAT_FN_EXAMPLES_SMALL="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), "--small"] if script != "quickstart.py"
                          else [sys.executable, str(EXAMPLES / script)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_every_example_is_covered():
    # demo.py has its own tests (tests/test_demo.py)
    assert {p.name for p in EXAMPLES.glob("*.py")} - {"demo.py"} == set(EXPECTED)


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_example_runs(script):
    if script == "hf_compat.py":
        pytest.importorskip("transformers")
    out = run(script)
    assert EXPECTED[script] in out, out
    if script == "hf_compat.py":
        lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
        assert "fails" in lines["transformers'"]  # its hook and torch's checkpoint cannot run under grad
        norm = lines["no"].split("|g|")[1]
        for row in ("enable_hf_remat", "enable_hf_remat(dots)"):
            assert "torch.func.grad: peak" in lines[row] and lines[row].split("|g|")[1] == norm
