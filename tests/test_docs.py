"""Every Python code block in README.md and docs/*.md runs, so the docs cannot
drift from the code.  The blocks of one file run in order in one namespace, like
a notebook; a block may rely on names an earlier block of the same file defined.
A few names the prose introduces without defining (a model's ``block``, a
batch) are provided by the small per-file setup below, written as a reader
would."""

from __future__ import annotations

import contextlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

SETUP = """
import torch
import remat_fn
from remat_fn import remat, policies, checkpoint_name
torch.manual_seed(0)
"""


# Names the prose of a page introduces without defining them.
PAGE_SETUP = {
    "docs/migration.md": """
block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
x = torch.randn(4, 8, requires_grad=True)
""",
    "docs/policies.md": """
def block(x, w1, w2):
    return x + torch.tanh(x @ w1) @ w2
""",
    "docs/random.md": """
batch, seed, step = 4, 0, 0
xs = torch.randn(batch, 512)
""",
    "docs/transform.md": """
from remat_fn import random as rnd
some_module = torch.nn.Linear(4, 4)
class _Obj:
    def method(self, x, n):
        return x * n
obj = _Obj()
steps, w, x = 2, torch.randn(8, 8), torch.randn(4, 8)
def model(x, key):
    return block(x, w, rnd.fold_in(key, 0)).sum()
""",
}


def blocks(path):
    return BLOCK.findall((ROOT / path).read_text())


@pytest.mark.parametrize("path", [f for f in FILES if blocks(f)])
def test_python_blocks_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TQDM_DISABLE", "1")
    if path in ("docs/migration.md", "docs/recipes.md"):
        pytest.importorskip("transformers")
    ns: dict = {"__name__": "__docs__"}
    exec(compile(SETUP + PAGE_SETUP.get(path, ""), "<setup>", "exec"), ns)
    with _process_group() if path == "docs/distributed.md" else _nothing():
        for i, code in enumerate(blocks(path)):
            try:
                exec(compile(code, f"{path}[block {i}]", "exec"), ns)
            except Exception as e:  # pragma: no cover - the failure message is the point
                raise AssertionError(f"{path}, python block {i} failed: {e!r}\n{code}") from e


@contextlib.contextmanager
def _nothing():
    yield


@contextlib.contextmanager
def _process_group():
    """A one-rank gloo group: the distributed page's code runs as on rank 0."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
