"""Smoke tests for ``python -m remat_fn.demo`` and ``python -m remat_fn.bench`` (subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_demo_help():
    out = run("remat_fn.demo", "--help").stdout
    for opt in ("--steps", "--size", "--out", "--seed", "--no-plot"):
        assert opt in out


def test_demo_short_run(tmp_path):
    try:
        import matplotlib  # noqa: F401

        plots = True
    except ImportError:
        plots = False
    out = run("remat_fn.demo", "--steps", "8", "--size", "tiny", "--out", str(tmp_path), "--repeats", "1",
              *([] if plots else ["--no-plot"])).stdout
    assert "| no remat |" in out and "| torch.utils.checkpoint | fails under torch.func" in out
    res = json.loads((tmp_path / "results.json").read_text())
    assert len(res["losses"]) == 8
    rows = {r["variant"]: r for r in res["results"]}
    # remat keeps less alive after the forward than no remat, under torch.func and eager
    assert rows["remat nothing_saveable (default)"]["func_after_fwd"] < rows["no remat"]["func_after_fwd"]
    assert rows["remat nothing_saveable (default)"]["eager_after_fwd"] < rows["no remat"]["eager_after_fwd"]
    assert "func_error" in rows["torch.utils.checkpoint"]
    assert (tmp_path / "table.md").exists()
    if plots:
        assert (tmp_path / "memory_vs_time.png").stat().st_size > 0
        assert (tmp_path / "loss.png").stat().st_size > 0


def test_bench_sections(tmp_path):
    out = run("remat_fn.bench", "--quick", "--only", "overhead,func,random", "--out", str(tmp_path),
              "--no-plot").stdout
    assert "## Per-call overhead" in out and "## torch.func.grad and vmap(grad) memory" in out
    res = json.loads((tmp_path / "results.json").read_text())
    assert {"info", "overhead", "func", "random"} <= set(res)
    assert res["info"]["torch"]
    grad_row = res["func"]["rows"][0]
    assert grad_row["torch.utils.checkpoint"] == "fails"
    assert grad_row["remat"] < grad_row["no remat"]
    assert (tmp_path / "results.md").read_text().startswith("# remat_fn benchmarks")


def test_bench_rejects_unknown_section(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "remat_fn.bench", "--only", "nope", "--out", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "unknown section" in proc.stderr
