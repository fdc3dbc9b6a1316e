"""The supported torch range is claimed in one voice: pyproject.toml's dependency,
SUPPORTED_TORCH (named in the error a torch without an internal gets), the docs'
install commands and "Supported torch", and CI, which runs the suite on both ends."""

from __future__ import annotations

import pathlib
import re

import pytest

from remat_fn._torch_internals import SUPPORTED_TORCH

ROOT = pathlib.Path(__file__).resolve().parent.parent
# a range written as >=A.B,<C.D (spaces allowed), after "torch"
_RANGE = re.compile(r"torch\s*(>=\s*\d+\.\d+(?:\.\d+)?\s*,\s*<\s*\d+\.\d+(?:\.\d+)?)")
_BOUNDS = re.compile(r">=\s*(\d+)\.(\d+)(?:\.\d+)?\s*,\s*<\s*(\d+)\.(\d+)")


def _text(rel: str) -> str:
    p = ROOT / rel
    if not p.exists():
        pytest.skip(f"{rel} is not in this checkout")
    return p.read_text(encoding="utf-8")


def _norm(spec: str) -> str:
    return re.sub(r"\s+", "", spec)


def _bounds(spec: str) -> tuple[tuple[int, int], tuple[int, int]]:
    m = _BOUNDS.fullmatch(_norm(spec))
    assert m, f"{spec!r} is not of the form >=A.B,<C.D"
    a, b, c, d = map(int, m.groups())
    return (a, b), (c, d)


def test_pyproject_claims_the_range_the_library_names():
    deps = re.search(r"^dependencies\s*=\s*\[(.*?)\]", _text("pyproject.toml"), re.M | re.S)
    assert deps, "no dependencies list in pyproject.toml"
    torch_deps = [d for d in re.findall(r'"([^"]+)"', deps.group(1)) if re.match(r"torch\b", d)]
    assert torch_deps == [f"torch{SUPPORTED_TORCH}"], (torch_deps, SUPPORTED_TORCH)
    (lo_major, lo_minor), (hi_major, hi_minor) = _bounds(SUPPORTED_TORCH)
    assert (lo_major, lo_minor) < (hi_major, hi_minor)


@pytest.mark.parametrize("rel", ["README.md", "docs/getting-started.md", "docs/design.md"])
def test_docs_claim_the_same_range(rel):
    text = _text(rel)
    claims = {_norm(m.group(1)) for m in _RANGE.finditer(text)}
    assert claims == {_norm(SUPPORTED_TORCH)}, f"{rel} claims torch{sorted(claims)}; pyproject.toml claims torch{SUPPORTED_TORCH}"
    # no other lower bound ("any torch >= 2.5") next to it
    others = {_norm(m.group(0)) for m in re.finditer(r"torch\s*>=\s*\d+\.\d+(?:\.\d+)?(?![\d.])(?!\s*,\s*<)", text)}
    assert not others, f"{rel} also says {sorted(others)}"
    (lo_major, lo_minor), (hi_major, hi_minor) = _bounds(SUPPORTED_TORCH)
    words = f"torch {lo_major}.{lo_minor} through {hi_major}.{hi_minor - 1}"
    if rel != "docs/design.md":
        assert words in text, f"{rel} should say {words!r}"


def test_ci_runs_the_suite_on_both_ends_of_the_range():
    run = _text(".ci/run")
    pins = dict(re.findall(r'^(TORCH_NEWEST|TORCH_LOWEST)="torch==(\d+\.\d+)\.\d+"', run, re.M))
    assert set(pins) == {"TORCH_NEWEST", "TORCH_LOWEST"}, pins
    (lo_major, lo_minor), (hi_major, hi_minor) = _bounds(SUPPORTED_TORCH)
    assert pins["TORCH_LOWEST"] == f"{lo_major}.{lo_minor}", (pins, SUPPORTED_TORCH)
    assert pins["TORCH_NEWEST"] == f"{hi_major}.{hi_minor - 1}", (pins, SUPPORTED_TORCH)
    # each of the two runs the suite (not only an import)
    for var in ("TORCH_NEWEST", "TORCH_LOWEST"):
        after = run[run.index(f'"${{PIP[@]}}" "${var}"'):]
        assert re.search(r"python -m pytest", after.split("\necho \"== job")[0]), f"the job installing ${var} runs no suite"
