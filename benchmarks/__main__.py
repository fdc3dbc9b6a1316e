"""``python -m benchmarks [--quick] [--out DIR] [--only SECTIONS] [--no-plot] [--threads N]``.

Runs the sections (all by default), prints one Markdown report and writes it
with the raw figures (``results.md``, ``results.json``) and plots (when
matplotlib is installed) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from . import above_vmap, budget, core, distributed, nested, offload, recorded, replay, rng
from .harness import machine_info

MODULES = (core, recorded, rng, budget, distributed, offload, replay, nested, above_vmap)
SECTIONS = {name: spec for m in MODULES for name, spec in m.SECTIONS.items()}
CHILDREN = {name: fn for m in MODULES for name, fn in m.CHILDREN.items()}
QUICK_DEFAULT = ("overhead", "step", "gpt2", "policies", "func", "rss", "random")


def render(res: dict) -> str:
    info = res["info"]
    parts = [f"# remat_fn benchmarks{' (--quick)' if res.get('quick') else ''}", "",
             f"torch {info['torch']}, python {info['python']}, optree {info['optree']}, "
             f"remat_fn {info['remat_fn']}; {info['cpu']} ({info['cpus']} CPUs, "
             f"{info['torch_threads']} torch threads); {info['platform']}; {info['date']}.",
             "Times: median (min-max) over interleaved rounds on a shared machine; ratios are per round."]
    for name, (_, md, title) in SECTIONS.items():
        if name in res:
            parts += ["", f"## {title}", "", md(res[name])]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0],
                                 epilog="Sections: " + ", ".join(SECTIONS))
    ap.add_argument("--quick", action="store_true", help="small models, few repeats (CI smoke run)")
    ap.add_argument("--out", default="bench_out", help="output folder (default ./bench_out)")
    ap.add_argument("--only", default=None,
                    help="comma-separated sections (default: all; with --quick: " + ",".join(QUICK_DEFAULT) + ")")
    ap.add_argument("--no-plot", action="store_true", help="do not write PNG plots")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--_child", dest="child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        CHILDREN[args.child[0]](args.child[1])
        return {}
    default = QUICK_DEFAULT if args.quick else tuple(SECTIONS)
    sections = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else list(default)
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        ap.error(f"unknown section(s) {bad}; choose from {', '.join(SECTIONS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    res: dict = {"info": machine_info(), "quick": args.quick}
    t_all = time.perf_counter()
    for name in sections:
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        res[name] = SECTIONS[name][0](args.quick)
        res[name]["seconds"] = time.perf_counter() - t0
    res["seconds"] = time.perf_counter() - t_all
    text = render(res)
    print(text)
    with open(os.path.join(args.out, "results.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(res, fh, indent=2, default=str)
    plots = [] if args.no_plot else core.plots(res, args.out)
    print(f"wrote {args.out}/results.json, {args.out}/results.md" + "".join(f", {p}" for p in plots)
          + f"  ({res['seconds']:.0f} s)")
    return res


if __name__ == "__main__":
    main()
