"""The benchmark suite (``python -m benchmarks``): its harness, and a smoke run of the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import harness  # noqa: E402


def test_interleaved_keeps_one_sample_per_round_and_alternates():
    order = []
    s = harness.interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, repeats=3,
                            warmup=1, before=lambda: order.append("|"))
    assert [len(v) for v in s.values()] == [3, 3]
    assert order == ["a", "b"] + ["|", "a", "|", "b"] * 3


def test_spread_and_per_round_ratio():
    assert harness.Spread.of([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert harness.ratio([2.0, 4.0, 9.0], [1.0, 2.0, 3.0]) == (2.0, 2.0, 3.0)
    assert harness.Spread(1.5, 1.0, 2.0).fmt(scale=1e3, digits=0, unit=" ms") == "1500 ms (1000-2000)"


def test_variants_cover_baselines_and_every_policy_family():
    labels = [lab for lab, _ in harness.variants()]
    assert labels[:3] == ["no remat", "torch.utils.checkpoint", "torch SAC (save mm/addmm/bmm)"]
    assert any("memory_budget" in lab for lab in labels) and any("names" in lab for lab in labels)


def _cli(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], capture_output=True, text=True,
                          env=env, timeout=600, cwd=ROOT)


def test_sections_run_and_report_spread(tmp_path):
    proc = _cli("--quick", "--only", "overhead,func", "--out", str(tmp_path), "--no-plot")
    assert proc.returncode == 0, proc.stderr
    assert "## Per-call overhead of a region" in proc.stdout
    res = json.loads((tmp_path / "results.json").read_text())
    assert {"info", "overhead", "func"} <= set(res)
    med, lo, hi = res["overhead"]["us"]["2mm eager remat"]
    assert lo <= med <= hi
    grad_row = res["func"]["rows"][0]
    assert grad_row["torch.utils.checkpoint"].startswith("fails")
    assert grad_row["remat"] < grad_row["no remat"]


def test_replay_section_reports_backward_peaks_and_recording_time(tmp_path):
    pytest.importorskip("transformers")
    proc = _cli("--quick", "--only", "replay", "--out", str(tmp_path), "--no-plot")
    assert proc.returncode == 0, proc.stderr
    assert "## Replay: live bytes during backward" in proc.stdout
    r = json.loads((tmp_path / "results.json").read_text())["replay"]
    chain = r["chain"]["rows"]
    assert 2.5 <= chain["torch"]["backward_peak_MiB"] <= 3.5  # input grad, incoming grad, one recomputed value
    for kind in ("gpt2", "llama"):
        rows = r[kind]["rows"]
        assert set(rows) == {"none", "torch", "compat", "torch_sac", "dots"}
        assert all(row["backward_peak_MiB"] >= row["after_forward_MiB"] > 0 for row in rows.values())
        assert rows["torch"]["backward_peak_MiB"] < rows["none"]["backward_peak_MiB"]
    for row in r["recording"]["rows"]:
        assert row["ops"] >= 2 * row["n"]
        for med, lo, hi in row["us_per_op"].values():
            assert lo <= med <= hi


def test_above_vmap_section_reports_calls_memory_and_time(tmp_path):
    proc = _cli("--quick", "--only", "above_vmap", "--out", str(tmp_path), "--no-plot")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "results.json").read_text())["above_vmap"]["rows"]
    by = {(r["step"], r["variant"]): r for r in rows}
    for step in {r["step"] for r in rows}:
        plain, rem = by[(step, "no remat")], by[(step, "remat")]
        assert rem["calls"] == plain["calls"] > 0  # (the blocks' Python once per forward: the calls replay)
        med, lo, hi = rem["time"]
        assert lo <= med <= hi


def test_rejects_unknown_section(tmp_path):
    proc = _cli("--only", "nope", "--out", str(tmp_path))
    assert proc.returncode != 0 and "unknown section" in proc.stderr


@pytest.mark.parametrize("path", ["remat_fn/bench.py", "remat_fn/demo.py"])
def test_tooling_lives_outside_the_package(path):
    assert not os.path.exists(os.path.join(ROOT, path))
