"""Smoke tests for the demo, ``python examples/demo.py`` (subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "examples", "demo.py")


def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    proc = subprocess.run([sys.executable, DEMO, *args], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_demo_help():
    out = run("--help").stdout
    for opt in ("--steps", "--size", "--out", "--seed", "--no-plot"):
        assert opt in out


def test_demo_imports_no_benchmark_code():
    src = open(DEMO).read()
    assert "benchmarks" not in src.replace("benchmarks.md", "")


def test_demo_short_run(tmp_path):
    try:
        import matplotlib  # noqa: F401

        plots = True
    except ImportError:
        plots = False
    out = run("--steps", "8", "--size", "tiny", "--out", str(tmp_path), "--repeats", "2",
              *([] if plots else ["--no-plot"])).stdout
    assert "| no remat |" in out and "| torch.utils.checkpoint | fails under torch.func" in out
    res = json.loads((tmp_path / "results.json").read_text())
    assert len(res["losses"]) == 8
    rows = {r["variant"]: r for r in res["results"]}
    # remat keeps less alive after the forward than no remat, under torch.func and eager
    assert rows["remat nothing_saveable (default)"]["func_after_fwd"] < rows["no remat"]["func_after_fwd"]
    assert rows["remat nothing_saveable (default)"]["eager_after_fwd"] < rows["no remat"]["eager_after_fwd"]
    assert "func_error" in rows["torch.utils.checkpoint"]
    r = rows["remat nothing_saveable (default)"]  # each time with its spread
    assert r["eager_ms_min"] <= r["eager_ms"] <= r["eager_ms_max"]
    assert (tmp_path / "table.md").exists()
    if plots:
        assert (tmp_path / "memory_vs_time.png").stat().st_size > 0
        assert (tmp_path / "loss.png").stat().st_size > 0
