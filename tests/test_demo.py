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
    for opt in ("--steps", "--size", "--out", "--seed", "--no-plot", "--repeats", "--threads"):
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
    out = run("--steps", "8", "--size", "tiny", "--out", str(tmp_path), "--repeats", "2", "--threads", "2",
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
    # table.md carries the caption the terminal prints: what the columns and spreads mean
    table = (tmp_path / "table.md").read_text()
    caption = table.split("\n\n")[0]
    for words in ("LiveBytes", "*peak*", "*after fwd*", "keeps for backward", "median of 2 interleaved rounds",
                  "min-max", "torch.func = grad_and_value(functional_call)", "eager = loss.backward()"):
        assert words in caption, words
    assert table.split("\n\n")[1].startswith("| variant |")
    assert " ".join(caption.split()) in " ".join(out.split())
    assert res["repeats"] == 2
    # --threads overrides torch's default (the run's environment says OMP_NUM_THREADS=1)
    assert ", 2 threads," in out and res["info"]["threads"] == 2
    if plots:
        assert (tmp_path / "memory_vs_time.png").stat().st_size > 0
        assert (tmp_path / "loss.png").stat().st_size > 0
    # one forward of the plain model, timed in the same rounds, and what the times say about it
    for mode in ("func", "eager"):
        f = res["forward"][mode]
        assert len(f["rounds_ms"]) == 2 and f["ms_min"] <= f["ms"] <= f["ms_max"]
        assert len(rows["no remat"][f"{mode}_rounds_ms"]) == 2
    notes = table.split("\n\n")[2]
    assert notes.startswith("Time against one extra forward") and "full remat takes" in notes
    assert " ".join(notes.split()) in " ".join(out.split())


def _demo_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("remat_fn_demo", DEMO)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, mod)  # its dataclasses look their module up
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


def _boxes(points, placed, char_w=5.0, text_h=6.0):
    return [(points[i][0] + dx, points[i][1] + dy, points[i][0] + dx + char_w * len(t), points[i][1] + dy + text_h)
            for t, i, dx, dy in placed]


def _overlap(a, b):
    return min(a[2], b[2]) > max(a[0], b[0]) and min(a[3], b[3]) > max(a[1], b[1])


def test_plot_labels_do_not_overlap():
    """memory_vs_time.png: coinciding points share one label ("1,4", not "41"), and
    labels of nearby points go where they overlap no other label and no other marker."""
    place = _demo_module().place_labels
    # the committed demo's eager panel had 1 and 4 on top of each other, 6 and 9 close
    pts = [(100.0, 100.0), (200.0, 50.0), (205.0, 50.0), (100.0, 100.0), (300.0, 80.0), (310.0, 80.0),
           (310.0, 92.0), (300.0, 92.0), (150.0, 150.0), (158.0, 150.0)]
    texts = [str(i + 1) for i in range(len(pts))]
    placed = place(pts, texts)
    labels = [t for t, *_ in placed]
    assert "1,4" in labels and "2,3" in labels and "1" not in labels and "4" not in labels
    assert sorted(",".join(labels).split(",")) == sorted(texts)
    boxes = _boxes(pts, placed)
    for a in range(len(boxes)):
        for b in range(a + 1, len(boxes)):
            assert not _overlap(boxes[a], boxes[b]), (placed[a], placed[b])
    r = 3.5
    for (t, *_), box in zip(placed, boxes):
        own = [j for j in range(len(pts)) if str(j + 1) in t.split(",")]
        for j, (x, y) in enumerate(pts):
            if j not in own:
                assert not _overlap(box, (x - r, y - r, x + r, y + r)), (t, j + 1)


def test_time_axis_cuts_an_outlier_whisker():
    """memory_vs_time.png: one slow round (a 1700 ms maximum among 20-40 ms medians)
    no longer squeezes every median into the left edge; whiskers that fit are kept."""
    axis = _demo_module().time_axis
    assert axis([20.0, 30.0, 40.0], [25.0, 45.0, 1700.0]) == 1.6 * 40.0
    assert axis([20.0, 30.0, 40.0], [25.0, 45.0, 50.0]) == 50.0 * 1.04


def test_time_notes_compare_with_one_extra_forward():
    """The notes under the table: full remat's step per round against the no-remat
    step and the no-remat step plus one forward; what is left is named overhead."""
    demo = _demo_module()
    rows = [{"variant": "no remat", "func_rounds_ms": [40.0, 42.0, 38.0], "eager_rounds_ms": [30.0, 30.0, 30.0]},
            {"variant": "remat nothing_saveable (default)", "func_rounds_ms": [74.0, 80.0, 70.0],
             "eager_rounds_ms": [36.0, 36.0, 36.0]}]
    fwd = {"func": {"ms": 8.0, "rounds_ms": [8.0, 8.0, 8.0]}, "eager": {"ms": 6.0, "rounds_ms": [6.0, 6.0, 6.0]}}
    text = demo.time_notes(rows, fwd, demo.SIZES["tiny"])
    assert "under torch.func full remat takes 1.85 (1.84-1.90)x the no-remat step" in text
    assert "at most 1.20 (1.19-1.21)x for one extra forward (8.0 ms here)" in text
    assert "in eager autograd full remat takes 1.20 (1.20-1.20)x" in text
    assert "about 26.0 ms (3.2x the forward) under torch.func per step, is what the 2 regions cost beyond" in text
    assert "vary widely" not in text
    rows[1]["eager_rounds_ms"] = [36.0, 90.0, 36.0]  # one round 3x slower: a busy machine, said so
    assert "The ratios vary widely between rounds" in demo.time_notes(rows, fwd, demo.SIZES["tiny"])
    fwd["func"]["rounds_ms"] = [40.0, 40.0, 40.0]  # a forward dearer than the difference: nothing left over
    fwd["eager"]["rounds_ms"] = [10.0, 10.0, 10.0]
    assert "Full remat stays within the no-remat step plus one forward here" in demo.time_notes(rows, fwd, demo.SIZES["tiny"])
