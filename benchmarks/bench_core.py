"""Core benchmark: per-call overhead and full-remat training-step cost.

A thin entry point over the suite in :mod:`remat_fn.bench` (sections
``overhead`` and ``step``): per-call overhead of a tiny function against
``torch.utils.checkpoint``, and a full-remat training step of a 6-block MLP
stack against the one-extra-forward limit, eager and under ``torch.func.grad``,
measured side by side in one run.  Nothing here is asserted.

Run: python benchmarks/bench_core.py [--quick] [--out DIR]
"""

from __future__ import annotations

import sys

from remat_fn.bench import main

if __name__ == "__main__":
    main(["--only", "overhead,step", *sys.argv[1:]])
