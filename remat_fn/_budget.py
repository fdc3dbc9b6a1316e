"""``memory_budget(fraction)``: choose what to save by solving a 0-1 knapsack.

On the first call of a region for given input shapes/dtypes, :func:`measure`
runs the region once on detached copies of its inputs, in a worker thread
(functorch levels and disabled saved-tensor hooks are thread-local, so this
works under ``torch.func`` too), and records for every op its output bytes,
its recompute cost (FLOPs for matmul-like ops, output elements otherwise) and
whether plain autograd would save its output.  The bytes plain autograd would
keep are the reference ``B``; :func:`solve` then picks the ops to save, with
total bytes <= ``fraction * B``, that maximise the recompute cost avoided.
The plan (a set of op keys) is cached per input signature.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from .policies import DOT_OPS, NAMED

__all__ = ["Plan", "measure", "solve", "op_cost"]

aten = torch.ops.aten


def _numel(shape) -> int:
    return math.prod(int(s) for s in shape)


def op_cost(func, args, out) -> float:
    """Recompute cost estimate: FLOPs for matmul-like ops, output elements for the rest."""
    p = func.overloadpacket
    try:
        if p in (aten.mm, aten.addmm):
            a, b = (args[0], args[1]) if p is aten.mm else (args[1], args[2])
            return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
        if p in (aten.bmm, aten.baddbmm):
            a, b = (args[0], args[1]) if p is aten.bmm else (args[1], args[2])
            return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
        if p in (aten.mv, aten.addmv, aten.dot, aten.vdot):
            return 2.0 * sum(_numel(a.shape) for a in args if isinstance(a, torch.Tensor))
        if p in DOT_OPS:  # convolution, attention: ~2 * out elements * reduction size
            o = out[0] if isinstance(out, (tuple, list)) else out
            w = args[1]
            return 2.0 * _numel(o.shape) * max(1, _numel(w.shape[1:]))
    except (AttributeError, IndexError, TypeError):
        pass
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return float(sum(_numel(o.shape) for o in outs if isinstance(o, torch.Tensor)))


class Plan:
    """Keys of the ops to save; usable as a policy."""

    __slots__ = ("keys", "budget_bytes", "reference_bytes", "saved_bytes", "recompute_cost", "items")

    def __init__(self, keys, budget_bytes, reference_bytes, saved_bytes, recompute_cost, items):
        self.keys = frozenset(keys)
        self.budget_bytes = budget_bytes
        self.reference_bytes = reference_bytes
        self.saved_bytes = saved_bytes
        self.recompute_cost = recompute_cost
        self.items = items

    def __call__(self, ctx, op, *args, **kwargs):
        if op is NAMED:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if ctx.key in self.keys else CheckpointPolicy.PREFER_RECOMPUTE

    def __repr__(self):
        return (f"Plan(save {len(self.keys)} ops, {self.saved_bytes} of budget {self.budget_bytes} "
                f"bytes; reference {self.reference_bytes})")


def solve(items: list[tuple[Any, int, float]], capacity: float, resolution: int = 4096):
    """0-1 knapsack: pick items (key, bytes, cost) with sum(bytes) <= capacity, max sum(cost).

    Integer byte counts are divided by their greatest common divisor; when the
    table is then small enough (2e6 cells) the dynamic programme is exact.  Otherwise bytes are rounded *up* to units of ``capacity /
    resolution`` (so the choice never exceeds the capacity) and the leftover
    capacity is filled greedily by cost per byte.  Returns the chosen keys.
    """
    free = [k for k, b, c in items if b <= 0]
    items = [it for it in items if it[1] > 0 and it[2] > 0]
    if capacity <= 0 or not items:
        return free
    if sum(b for _, b, _ in items) <= capacity:
        return [k for k, _, _ in items] + free
    g = 0
    for _, b, _ in items:
        g = math.gcd(g, int(b)) if float(b).is_integer() else 0
        if g == 0:
            break
    work = 2_000_000  # DP cells: about a second of Python at most
    if g and capacity / g * len(items) <= work:
        w = [int(b) // g for _, b, _ in items]
        cap = int(capacity // g)
    else:
        resolution = max(64, min(resolution, work // len(items)))
        unit = capacity / resolution
        w = [max(1, math.ceil(b / unit - 1e-9)) for _, b, _ in items]
        cap = resolution
    best = [0.0] * (cap + 1)
    take = []
    for i, (_, _, c) in enumerate(items):
        wi = w[i]
        row = bytearray(cap + 1)
        if wi <= cap:
            for j in range(cap, wi - 1, -1):
                v = best[j - wi] + c
                if v > best[j]:
                    best[j] = v
                    row[j] = 1
        take.append(row)
    chosen: set[int] = set()
    j = max(range(cap + 1), key=lambda k: best[k])
    for i in range(len(items) - 1, -1, -1):
        if take[i][j]:
            chosen.add(i)
            j -= w[i]
    used = sum(items[i][1] for i in chosen)
    for i in sorted(set(range(len(items))) - chosen, key=lambda i: -items[i][2] / items[i][1]):
        if used + items[i][1] <= capacity:
            chosen.add(i)
            used += items[i][1]
    return [items[i][0] for i in sorted(chosen)] + free


class _Measure(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict[Any, int] = {}
        self.items: dict[tuple, list] = {}  # key -> [bytes, cost]
        self.by_storage: dict[int, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        n = self.counts.get(func, 0)
        self.counts[func] = n + 1
        out = func(*args, **kwargs)
        if func._schema.is_mutable or func.is_view:
            return out
        outs = out if isinstance(out, (tuple, list)) else (out,)
        nbytes = 0
        for o in outs:
            if isinstance(o, torch.Tensor) and (o.is_floating_point() or o.is_complex()):
                st = o.untyped_storage()
                nbytes += st.nbytes()
                self.by_storage[st.data_ptr()] = (func, n)
        if nbytes:
            self.items[(func, n)] = [nbytes, op_cost(func, args, out)]
        return out


def measure(run: Callable[[], Any]) -> tuple[dict, int]:
    """Run ``run()`` in a worker thread under grad mode; return (items, reference bytes).

    ``run`` must create its own leaf inputs (``requires_grad_``) so that
    autograd saves what it would save in plain training.
    """
    result: dict = {}

    def work():
        try:
            saved_storages: dict[int, int] = {}
            m = _Measure()

            def pack(t):
                try:
                    st = t.untyped_storage()
                    saved_storages[st.data_ptr()] = st.nbytes()
                except (RuntimeError, NotImplementedError):
                    pass
                return t

            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), m:
                out = run()
            del out
            ref = sum(nb for ptr, nb in saved_storages.items() if ptr in m.by_storage)
            result["v"] = (m.items, ref)
        except BaseException as e:  # re-raised in the caller's thread
            result["e"] = e

    th = threading.Thread(target=work, name="remat_fn-memory-budget")
    th.start()
    th.join()
    if "e" in result:
        raise result["e"]
    return result["v"]


def make_plan(fraction: float, items: dict, reference: int) -> Plan:
    capacity = fraction * reference
    lst = [(k, v[0], v[1]) for k, v in items.items()]
    keys = solve(lst, capacity)
    saved = sum(items[k][0] for k in keys)
    cost = sum(v[1] for k, v in items.items() if k not in set(keys))
    return Plan(keys, int(capacity), reference, saved, cost, lst)
