"""Mutation check: deliberate bugs that the test suite must catch.

Each mutation is a small text patch to one module of ``remat_fn`` that breaks one
claim of the SPEC (closed-over tensors get gradients, RNG is replayed, policies
keep values, early stop, names, offloading).  For every mutation the script
copies ``remat_fn/``, ``tests/`` and ``pyproject.toml`` into a fresh temporary
directory, applies the patch there (the working tree is never touched), runs the
test files relevant to that claim against the copy (``PYTHONPATH`` and the
working directory point at the copy, so the editable install is not used) and
counts the tests that fail.  A mutation is caught when at least one test fails.

Run it from the repository root (about 5 minutes on 2 CPU cores)::

    python tests/mutations/run.py                 # baseline + every mutation
    python tests/mutations/run.py --only early_stop_off --show
    python tests/mutations/run.py --list

``--show`` lists the failing tests of each mutation; ``--no-baseline`` skips the
unmutated run.  The exit status is 1 when a mutation is caught by no test, when
its patch no longer applies (the code it targets changed: update the patch
here), or when the unmutated baseline has failures.  This file is not collected
by pytest (``tests/mutations/conftest.py``) and is not part of the default run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    claim: str
    file: str  # path under the repository root
    patches: tuple[tuple[str, str], ...]  # (exact old text, new text), each must occur once
    tests: tuple[str, ...]  # test files run against the mutated copy


MUTATIONS = (
    Mutation(
        "zero_closure_grads_torch_func",
        "tensors a region closes over get their gradients under torch.func",
        "remat_fn/_path_torch_func.py",
        (("            result[i + 1] = g\n",
          "            result[i + 1] = g if i < spec.n_in else torch.zeros_like(g)\n"),),
        ("tests/test_path_torch_func.py", "tests/test_programs.py", "tests/test_properties.py"),
    ),
    Mutation(
        "no_rng_restore",
        "preserve_rng_state=True: the recomputation draws the forward's random numbers",
        "remat_fn/_rng_state.py",
        (("        if self.cpu is not None:\n            torch.set_rng_state(self.cpu)\n        return self\n",
          "        return self\n"),),
        ("tests/test_rng_state.py", "tests/test_compat.py", "tests/test_torch_parity.py"),
    ),
    Mutation(
        "policies_save_nothing",
        "a value the policy saves is kept, not recomputed",
        "remat_fn/policies.py",
        (('    if d is True:\n        return "save"\n', '    if d is True:\n        return "recompute"\n'),
         ('        if d in _SAVE:\n            return "save"\n', '        if d in _SAVE:\n            return "recompute"\n')),
        ("tests/test_policies.py", "tests/test_jax_parity.py", "tests/test_torch_parity.py"),
    ),
    Mutation(
        "early_stop_off",
        "a recomputation stops once the last needed tensor is rebuilt",
        "remat_fn/_path_hooks.py",
        (("            if i == last and early:\n", "            if False:\n"),),
        ("tests/test_path_hooks.py", "tests/test_compat.py", "tests/test_torch_parity.py"),
    ),
    Mutation(
        "names_ignored",
        "checkpoint_name tags a value so that name policies save or offload it",
        "remat_fn/_record.py",
        (("                        mode.rec.named(t, name)\n", "                        pass\n"),),
        ("tests/test_policies.py", "tests/test_jax_parity.py", "tests/test_residuals.py"),
    ),
    Mutation(
        "offload_never_fetched",
        "an offloaded value comes back from its destination (no copy backward does not fetch)",
        "remat_fn/_record.py",
        (("else self.offloader.fetch(e.offloaded[0])\n", "else func(*args, **kwargs)\n"),
         ("            leaves[i] = self.offloader.fetch(h)\n", "            pass\n")),
        ("tests/test_policies.py", "tests/test_jax_parity.py"),
    ),
)

MUTATIONS += (
    Mutation(
        "side_outputs_dropped",
        "under torch.func a tensor leaving the region by a side channel gets its gradient",
        "remat_fn/_path_torch_func.py",
        (("            self.escaped = mode.escaped(outs)\n", "            self.escaped = []\n"),),
        ("tests/test_func_exactness.py", "tests/test_hf.py"),
    ),
    Mutation(
        "argument_identity_lost",
        "under torch.func the same tensor passed twice is one input (a is b)",
        "remat_fn/_path_torch_func.py",
        (("        args = [tensors[k] for k in self.expand]",
          "        args = [tensors[k] if i == self.expand.index(k) else tensors[k].view_as(tensors[k]) "
          "for i, k in enumerate(self.expand)]"),),
        ("tests/test_func_exactness.py",),
    ),
    Mutation(
        "detached_outputs_differentiable",
        "under torch.func a detached output of a region gets no gradient",
        "remat_fn/_path_torch_func.py",
        (("                mask = [_is_diff(t) and carries_grad(t) for t in o]", "                mask = [_is_diff(t) for t in o]"),),
        ("tests/test_func_exactness.py",),
    ),
)

# Claims the issue lists for which no code path exists to break yet.
NOT_APPLICABLE = {
    "side_effects_replayed": "the recomputation re-runs the user's function, so side effects of the "
                             "forward happen again today; there is no code path that prevents it "
                             "to mutate (issue 19)",
}


def _copy_tree(dst: Path) -> None:
    shutil.copytree(ROOT / "remat_fn", dst / "remat_fn", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "tests", dst / "tests", ignore=shutil.ignore_patterns("__pycache__", "mutations"))
    shutil.copy2(ROOT / "pyproject.toml", dst / "pyproject.toml")


def _apply(dst: Path, m: Mutation) -> str | None:
    """Patch the copy; return an error message if a patch does not apply."""
    path = dst / m.file
    text = path.read_text()
    for old, new in m.patches:
        n = text.count(old)
        if n != 1:
            return f"patch target found {n} times in {m.file}: {old.strip()[:70]!r}"
        text = text.replace(old, new)
    path.write_text(text)
    return None


_SUMMARY = re.compile(r"(\d+) (failed|errors?|passed|xfailed|xpassed|skipped)")


def _pytest(dst: Path, tests: tuple[str, ...], timeout: float) -> tuple[dict[str, int], list[str], str]:
    env = dict(os.environ, PYTHONPATH=str(dst), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=no", "-rfE", *tests]
    try:
        p = subprocess.run(cmd, cwd=dst, env=env, capture_output=True, text=True, timeout=timeout)
        out = p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"timeout": 1}, [], out
    counts: dict[str, int] = {}
    lines = out.strip().splitlines()
    for line in reversed(lines):
        found = _SUMMARY.findall(line)
        if found and (" in " in line or "no tests ran" in line):
            for n, kind in found:
                counts["error" if kind.startswith("error") else kind] = int(n)
            break
    failing = [ln.split(" ", 1)[1].split(" - ")[0] for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    return counts, failing, out


def _check_runs_from_copy(dst: Path) -> None:
    """The copy, not the editable install, must be what the tests import."""
    env = dict(os.environ, PYTHONPATH=str(dst))
    where = subprocess.run([sys.executable, "-c", "import remat_fn; print(remat_fn.__file__)"], cwd=dst,
                           env=env, capture_output=True, text=True).stdout.strip()
    if not where.startswith(str(dst)):
        raise SystemExit(f"the mutated copy is not imported (got {where}); run from a normal checkout")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", help="run only this mutation (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--show", action="store_true", help="print the failing tests of each mutation")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per pytest run")
    args = ap.parse_args(argv)

    muts = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:32s} {m.file:30s} {m.claim}")
        for name, why in NOT_APPLICABLE.items():
            print(f"{name:32s} {'(not applicable)':30s} {why}")
        return 0
    if args.only and len(muts) != len(set(args.only)):
        raise SystemExit(f"unknown mutation in {args.only}; see --list")

    status = 0
    rows = []
    if not args.no_baseline:
        files = tuple(sorted({f for m in muts for f in m.tests}))
        with tempfile.TemporaryDirectory(prefix="remat-mut-") as d:
            dst = Path(d)
            _copy_tree(dst)
            _check_runs_from_copy(dst)
            t0 = time.perf_counter()
            counts, failing, out = _pytest(dst, files, args.timeout)
            bad = counts.get("failed", 0) + counts.get("error", 0) + counts.get("timeout", 0)
            print(f"baseline ({len(files)} files, {time.perf_counter() - t0:.0f}s): {counts}")
            if bad or not counts.get("passed"):
                print("the unmutated copy does not pass; mutation counts would mean nothing:")
                print("\n".join(failing) or out[-3000:])
                return 1

    for m in muts:
        with tempfile.TemporaryDirectory(prefix="remat-mut-") as d:
            dst = Path(d)
            _copy_tree(dst)
            err = _apply(dst, m)
            if err:
                rows.append((m.name, "NOT APPLIED", err))
                status = 1
                continue
            t0 = time.perf_counter()
            counts, failing, out = _pytest(dst, m.tests, args.timeout)
            caught = counts.get("failed", 0) + counts.get("error", 0)
            secs = time.perf_counter() - t0
            if counts.get("timeout"):
                verdict = "caught (timed out)"
            elif caught:
                verdict = "caught"
            else:
                verdict = "NOT CAUGHT"
                status = 1
            rows.append((m.name, verdict, f"{caught} failing tests of {sum(counts.values())} ({secs:.0f}s)"))
            print(f"{m.name}: {verdict}, {caught} failing", flush=True)
            if args.show:
                for f in failing:
                    print("    " + f)
            if not counts:
                print(out[-3000:])
    for name, why in NOT_APPLICABLE.items():
        if not args.only:
            rows.append((name, "n/a", why))

    print()
    print(f"{'mutation':32s} {'verdict':12s} detail")
    for name, verdict, detail in rows:
        print(f"{name:32s} {verdict:12s} {detail}")
    return status


if __name__ == "__main__":
    sys.exit(main())
