"""``memory_budget(fraction)``: choose what to save on the recorded forward.

There is no separate measuring pass.  The first call of a region for a given
plan key runs under :class:`Measuring`, a policy that keeps nothing (that call
is fully recomputed) and records every op output's bytes and recompute cost
(FLOPs for matmul-like ops, output elements otherwise) and which outputs
autograd saved (seen by the saved-tensor hooks in eager mode, in the graph's
saved tensors under ``torch.func``).  Their bytes are the reference ``B``;
:func:`plan_on_graph` picks the ops to save, with the bytes the replay reads <=
``fraction * B``, that minimise what backward replays on the region's recorded
forward (:func:`solve`, a knapsack over the saved values alone, plans regions too
large for it); later calls use that plan.  Nothing runs
twice: no extra draw from any RNG, no extra graph, no worker thread, and the
first call costs no more memory than the plan's calls.

Plans live in one bounded, process-wide cache keyed by what determines them:
the function's code (and the shapes of the tensors it closes over, or of a
module's parameters), the shapes, dtypes and devices of the inputs, the
autograd path (and the torch.func transforms around the call) and the fraction.  A ``remat`` built anew for every call (as
``remat_fn.compat`` and Hugging Face's hook do) finds its plan there.  The
cache holds no tensors.
"""

from __future__ import annotations

import collections
import functools
import math
import threading
import types
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from ._functorch import storage_ptr, transform_kinds
from ._ops import ALIASING
from .policies import DOT_OPS, NAMED

__all__ = ["Plan", "Measuring", "BudgetPlanner", "solve", "op_cost", "make_plan", "plan_on_graph", "stats",
           "clear_plans"]

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


def make_plan(fraction: float, items: dict, reference: int, fixed: int = 0) -> Plan:
    """Save at most ``fraction * reference`` bytes in all, ``fixed`` of which (the
    region's activation inputs, kept by remat anyway) are already spent."""
    capacity = max(0.0, fraction * reference - fixed)
    lst = [(k, v[0], v[1]) for k, v in items.items()]
    keys = solve(lst, capacity)
    saved = sum(items[k][0] for k in keys)
    cost = sum(v[1] for k, v in items.items() if k not in set(keys))
    return Plan(keys, int(capacity), reference, saved, cost, lst)


#: above this many candidate ops the plan falls back to the knapsack over saved values
GRAPH_CANDIDATES = 160


def plan_on_graph(fraction: float, items: dict, reference: int, fixed: int, tape, roots) -> Plan | None:
    """The plan, chosen on the recorded forward (remat_fn._tape): which op outputs to keep
    so that the ops backward must replay cost least, within ``fraction * reference -
    fixed`` bytes.  A choice is judged by what the replay of it runs (JAX's rule: a kept
    value stops the walk back from what autograd saved, anything else is recomputed
    with everything it needs that is not kept) and by the bytes of the kept values the
    replay reads; values nobody reads cost nothing.  Greedy: add the output with the
    most recompute cost saved per byte added while one fits.  Unlike the knapsack over
    the saved values alone, keeping a value also spares the ops upstream of it, and
    keeping an upstream value can spare several saved ones.  None when the region has
    more than ``GRAPH_CANDIDATES`` candidates (the knapsack plans those)."""
    nodes = tape.nodes
    cand = [k for k, n in enumerate(nodes) if n is not None and n.key in items]
    if not cand or len(cand) > GRAPH_CANDIDATES:
        return None
    capacity = max(0.0, fraction * reference - fixed)
    ncost = [items[n.key][1] if n is not None and n.key in items else 0.0 for n in nodes]
    nbytes = {k: items[nodes[k].key][0] for k in cand}

    def judge(chosen: set) -> tuple[float, int, set]:
        """(replay cost, bytes kept, the chosen nodes the replay reads) of a choice."""
        run, used, _ = tape.plan(roots, {id(v) for k in chosen for v in nodes[k].values()})
        read = {v.node for v in used}
        return sum(ncost[k] for k in run), sum(nbytes[k] for k in read), read

    chosen: set[int] = set()
    cost, held, keep = judge(chosen)
    while True:
        best = None
        for k in cand:
            if k in chosen:
                continue
            c, b, read = judge(chosen | {k})
            if b <= capacity and c < cost:
                score = (cost - c) / max(b - held, 1)
                if best is None or score > best[0]:
                    best = (score, k, c, b, read)
        if best is None:
            break
        _, k, cost, held, keep = best
        chosen.add(k)
    keys = [nodes[k].key for k in sorted(keep)]
    return Plan(keys, int(capacity), reference, held, cost, [(nodes[k].key, nbytes[k], ncost[k]) for k in cand])


# -- the first call: measure while running ------------------------------------------
class Measuring:
    """The policy of a region's first call: keep nothing (the call is recomputed
    like ``nothing_saveable``, so it costs no extra memory) and record, for every
    op output, its bytes and recompute cost and which op made each storage;
    autograd's saved tensors are attributed to the op that made them
    (:meth:`note_saved`), and :meth:`finish` turns that into a plan."""

    __slots__ = ("planner", "key", "items", "producer", "saved", "input_ptrs", "saved_inputs")

    def __init__(self, planner: BudgetPlanner, key: tuple):
        self.planner = planner
        self.key = key
        self.items: dict[Any, tuple[int, float]] = {}  # op key -> (bytes, cost)
        self.producer: dict[int, Any] = {}  # storage pointer -> key of the op that made it last
        # (op key, storage) -> bytes of what autograd saved; the pair, because a
        # storage freed after it was saved can be reused by a later op's output
        self.saved: dict[tuple[Any, int], int] = {}
        # The region's inputs that are activations (made by earlier ops, not
        # parameters or data): no-remat autograd saves them too and remat keeps
        # them, so they count against the budget (SPEC: saved activation bytes
        # <= fraction x the no-remat amount).
        self.input_ptrs: set[int] = set()
        self.saved_inputs: dict[int, int] = {}

    def note_inputs(self, ptrs) -> None:
        """The storages of the region's activation inputs."""
        self.input_ptrs.update(p for p in ptrs if p is not None)

    def __call__(self, ctx, op, *args, **kwargs):
        if op is NAMED:
            return CheckpointPolicy.PREFER_RECOMPUTE
        out = ctx.op_output
        outs = out if isinstance(out, (tuple, list)) else (out,)
        nbytes = 0
        for o in outs:
            if isinstance(o, torch.Tensor):  # (integer outputs too: a kept op keeps them)
                ptr = storage_ptr(o)
                if ptr is None:  # (a wrapper subclass: no storage of its own to count)
                    continue
                nbytes += o.untyped_storage().nbytes()
                # storages are reused once freed: the latest producer owns the pointer
                self.producer[ptr] = ctx.key
        if nbytes:
            self.items[ctx.key] = (nbytes, op_cost(op, args, out))
        return CheckpointPolicy.PREFER_RECOMPUTE

    def note_saved(self, ptr: int, nbytes: int) -> None:
        """Autograd saved a tensor with this storage (called when it is saved)."""
        key = self.producer.get(ptr)
        if key is not None:
            self.saved[(key, ptr)] = nbytes
        elif ptr in self.input_ptrs:
            self.saved_inputs[ptr] = nbytes

    def finish(self, saved: dict[int, int] | None = None, tape=None, roots=()) -> Plan:
        """The plan (cached).  ``saved``: storages autograd holds at the end of the
        forward (pointer -> bytes), for a path that cannot note them as they are saved.
        ``tape`` and ``roots``: the recorded forward and the values autograd saved, to
        plan on the graph (:func:`plan_on_graph`)."""
        for ptr, nbytes in (saved or {}).items():
            self.note_saved(ptr, nbytes)
        if tape is not None and roots:  # (what a dead branch saved is not kept by plain autograd either)
            live = {k for v in roots for k in _storage_makers(tape, v)}
            self.saved = {(k, p): b for (k, p), b in self.saved.items() if k in live}
        fixed = sum(self.saved_inputs.values())
        reference = sum(self.saved.values()) + fixed
        plan = None
        if tape is not None and roots:
            plan = plan_on_graph(self.planner.fraction, self.items, reference, fixed, tape, roots)
        if plan is None:
            keys = {k for k, _ in self.saved}
            items = {k: [b, c] for k, (b, c) in self.items.items() if k in keys}
            plan = make_plan(self.planner.fraction, items, reference, fixed)
        self.items, self.producer, self.saved, self.saved_inputs = {}, {}, {}, {}
        self.planner.store(self.key, plan)
        return plan


def _storage_makers(tape, v) -> list:
    """The keys of the ops from saved Value ``v`` back through the views and aliases autograd saved of it to the op that
    made its storage (a Linear on a 3-D input saves ``view``s of ``addmm``'s output: the saved storage counts for whichever
    of them the policy was asked about last; keyed by the view alone, ``memory_budget`` planned on the LayerNorm's output
    alone, keeping nothing, a hostile pass)."""
    keys = []
    while v.node >= 0:
        n = tape.nodes[v.node]
        if n is None:
            break
        keys.append(n.key)
        if not (n.func.is_view or n.func in ALIASING) or not n.reads:
            break
        v = n.reads[0]
    return keys


# -- the cache -----------------------------------------------------------------------
_MAX_PLANS = 512
_plans: collections.OrderedDict = collections.OrderedDict()
_lock = threading.Lock()
stats = {"measured": 0, "reused": 0}


def clear_plans() -> None:
    """Forget every cached plan (tests, or after changing a model's structure)."""
    with _lock:
        _plans.clear()
        stats["measured"] = stats["reused"] = 0


def _tensor_key(t: torch.Tensor) -> tuple:
    return ("t", tuple(t.shape), t.dtype, t.device.type)


def _value_key(v: Any, depth: int = 0) -> Any:
    """A hashable description of ``v`` that holds no tensor."""
    if isinstance(v, torch.Tensor):
        return _tensor_key(v)
    if depth > 3:
        return type(v)
    if isinstance(v, (int, float, str, bool, bytes, type(None), torch.dtype, torch.device)):
        return v
    if isinstance(v, (tuple, list)):
        return (type(v), tuple(_value_key(x, depth + 1) for x in v))
    if isinstance(v, dict):
        return (dict, tuple((k, _value_key(x, depth + 1)) for k, x in v.items() if isinstance(k, (str, int))))
    if isinstance(v, torch.nn.Module):
        return (type(v), tuple((n, tuple(p.shape), p.dtype) for n, p in v.named_parameters()))
    return callable_key(v, depth + 1) if callable(v) else type(v)


def callable_key(fn: Any, depth: int = 0) -> Any:
    """What determines a function's ops, as a hashable value with no tensors in it."""
    if isinstance(fn, types.MethodType):
        return ("method", callable_key(fn.__func__, depth + 1), _value_key(fn.__self__, depth + 1))
    if isinstance(fn, functools.partial):
        return ("partial", callable_key(fn.func, depth + 1), _value_key(fn.args, depth + 1),
                _value_key(dict(fn.keywords), depth + 1))
    if isinstance(fn, types.FunctionType):
        cells = []
        for c in fn.__closure__ or ():
            try:
                cells.append(_value_key(c.cell_contents, depth + 1))
            except ValueError:  # empty cell
                cells.append(None)
        return ("function", fn.__code__, tuple(cells))
    if isinstance(fn, torch.nn.Module):
        return _value_key(fn, depth)
    d = getattr(fn, "__dict__", None)
    wrapped = d.get("__wrapped__") if isinstance(d, dict) else None
    if wrapped is not None and depth <= 3:  # a remat wrapper: what it wraps decides the ops
        return ("wrapper", type(fn), callable_key(wrapped, depth + 1))
    return ("object", type(fn))


class BudgetPlanner:
    """A ``memory_budget`` policy as both autograd paths use it: :meth:`policy_for`
    returns the cached :class:`Plan` for this call, or a :class:`Measuring`
    policy whose :meth:`Measuring.finish` makes and caches it."""

    __slots__ = ("budget", "fraction")

    def __init__(self, budget) -> None:
        self.budget = budget
        self.fraction = float(budget.fraction)

    def policy_for(self, fun: Any, tensors, path: str):
        # under torch.func the ops a region runs depend on the transforms around it
        # (vmap batches them): the stack of transform types is part of the key
        stack = transform_kinds()
        key = (path, stack, self.fraction, callable_key(fun), tuple(_tensor_key(t) for t in tensors))
        with _lock:
            plan = _plans.get(key)
            if plan is not None:
                _plans.move_to_end(key)
                stats["reused"] += 1
                return plan
        return Measuring(self, key)

    def store(self, key: tuple, plan: Plan) -> None:
        with _lock:
            _plans[key] = plan
            _plans.move_to_end(key)
            stats["measured"] += 1
            while len(_plans) > _MAX_PLANS:
                _plans.popitem(last=False)
