"""The recorded forward as a function of the region's inputs, under every transform.

On the ``torch.func`` path backward differentiates the graph the region's forward
built under a ``vjp`` level of its own, its saved tensors rebuilt from the tape (see
:mod:`remat_fn._func_graph`), where nothing outside differentiates that backward.
Where something does (``grad`` of ``grad``, ``jvp`` of ``grad``, meta-learning's outer
loop, eager autograd around a ``torch.func`` call), :func:`replay_outputs` stands in
for the function: it runs the recorded ops on the Function's inputs as backward holds
them (``subst``: the forward's plain tensor -> that tensor), through every active
transform, and returns the region's outputs.  Backward differentiates it with
``torch.func.vjp`` (and the Function's ``jvp`` with ``torch.func.jvp``), so an outer
``grad`` differentiates the replay, a ``jvp`` pushes tangents through it and a ``vmap``
batches it, and the function's Python does not run again: its side effects happen once.
(The forward level's own graph cannot serve there: autograd gives a tensor that a
saved-tensor hook returns a new autograd identity, which drops the outer level's
history when that level's wrapper is the outermost one.)

Each op runs as the function called it: with the grad mode of the torch call that
issued it (off under the function's ``no_grad``), its random numbers drawn from the
recorded generator state.  Ops whose values do not depend on the inputs run below
every transform, as the plain replay runs them: random ops among them (a dropout
mask), which a ``vmap`` in ``'error'`` randomness mode would refuse.  A replay that
cannot be exact raises :class:`CannotReplay` and the function runs again instead
(see ``docs/design.md``): a random op whose result depends on the inputs
(``native_dropout``, ``rrelu``), a random op whose outputs the tape holds and that
depends on them, and a custom ``autograd.Function`` that cannot run as one step.

A custom ``autograd.Function`` the region applied is one step (``FunctionStep``, noted
by the region's torch function mode): the replay applies it to the replayed arguments,
its forward the span's recorded ops and its context as the forward left it, so each
transform differentiates it by its own rules (its ``backward``, not its forward's ops,
is what autograd differentiates; see :mod:`remat_fn._function_steps`).
"""

from __future__ import annotations

import contextlib

import torch

from ._func_semantics import replace_at
from ._function_steps import FunctionStep, apply_step
from ._functorch import from_physical, is_vmap_kind, live_levels, peel_vmaps, sum_levels, to_physical, unwrap_all, vmap_sizes
from ._ops import ALIASING, DETACH, arg_meta, no_autocast, reenter, run_recorded
from ._tape import Value
from ._torch_internals import DisableFuncTorch, TorchDispatchMode, below_level, below_transforms

__all__ = ["CannotReplay", "replay_outputs", "replay_fn", "replay_jvp", "forward_reached", "inputs_reaching",
           "INDEPENDENT"]

_NULL = contextlib.nullcontext()


class CannotReplay(Exception):
    """Internal: this recorded forward cannot be replayed exactly under the active
    transforms; backward runs the function again."""


def _ops(*names):
    out = []
    for n in names:
        packet, _, overload = n.partition(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload or "default", None)
        if op is not None:
            out.append(op)
    return frozenset(out)


# ops whose outputs' values do not depend on their tensor arguments' values (only on
# their sizes, dtypes and devices)
INDEPENDENT = _ops("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
                   "randint_like", "randint_like.low_dtype", "new_empty", "new_zeros", "new_ones",
                   "new_full", "new_empty_strided")


def _plain(x):
    return unwrap_all(x) if isinstance(x, torch.Tensor) else x


def _through_transforms(tape, run, inputs: set, fns: list) -> tuple[set, set]:
    """The nodes of ``run`` that run through the active transforms: those reading a value
    that depends on the inputs (``inputs``: ids of their Values) or was made by such a
    node, those making a value such a node writes into (it must be a value of the
    transforms too: ``h = zeros(..); h[1:].copy_(x)``), and every node of a custom
    Function's span (``fns``: ``(nodes, step)``) one of whose arguments or nodes is such
    (the Function's rules differentiate it, whatever its ops read).  Returns them and the
    ids of the values they make (with ``inputs``)."""
    nodes = tape.nodes
    top: set[int] = set()
    while True:
        live = set(inputs)
        for k in run:
            n = nodes[k]
            if n is None:
                raise CannotReplay("a node was let go of")
            if k in top or (n.func not in INDEPENDENT and any(id(r) in live for r in n.reads)):
                top.add(k)
                live.update(id(v) for v in n.outs if v is not None)
                live.update(id(w) for _, w in n.writes)
        grow = set()
        for k in top:
            n = nodes[k]
            if n.writes:
                todo = [w for w in tape.written_values(n) if id(w) not in live]
                while todo:  # (the written value, and the values it is a view of)
                    w = todo.pop()
                    if w.node < 0 or w.node in top or w.node in grow:
                        continue
                    grow.add(w.node)
                    m = nodes[w.node]
                    if m is not None and (m.func.is_view or m.func in ALIASING):
                        todo.extend(m.reads[:1])
        for ks, fn in fns:
            if not ks <= top and (ks & top or any(type(x) is Value and id(x) in live for x in fn.flat)):
                grow |= ks
        if not grow:
            break
        top |= grow
    for k in top:
        if nodes[k].rng is not None:
            raise CannotReplay(f"{nodes[k].func} draws random numbers into values that depend on the inputs")
    return top, live


def forward_reached(tape, outs, bases: set, grad_only: bool = False) -> list[bool]:
    """Which of ``outs`` (the region's outputs, while the tape records) the tape computes
    from the tensors ``bases`` (ids of the plain tensors below the Function's inputs)
    through ops other than ``detach`` (and those run under ``inference_mode``): what forward
    mode differentiates, whatever the grad mode (a tangent is not stopped by ``no_grad``);
    ``grad_only``: through ops run in grad mode, what reverse mode differentiates."""
    return [m != 0 for m in _reach_masks(tape, outs, dict.fromkeys(bases, 1), grad_only)]


def inputs_reaching(tape, outs, bases: list, grad_only: bool = False) -> list[bool]:
    """For each of ``bases`` (ids as in :func:`forward_reached`, one per input), whether the tape
    computes any of ``outs`` from it: one walk for all of them."""
    bit_of: dict[int, int] = {}
    for k, b in enumerate(bases):
        bit_of[b] = bit_of.get(b, 0) | 1 << k
    reached = 0
    for m in _reach_masks(tape, outs, bit_of, grad_only):
        reached |= m
    return [bool(reached >> k & 1) for k in range(len(bases))]


def _reach_masks(tape, outs, bit_of: dict[int, int], grad_only: bool) -> list[int]:
    """For each of ``outs``, the bits (``bit_of``: plain tensor id -> bits) of the bases it is computed
    from (see :func:`forward_reached`)."""
    live: dict[int, int] = {}
    for n in tape.nodes:
        if n is None or n.func is DETACH or n.func in INDEPENDENT or n.inference or (grad_only and not n.grad):
            continue
        m = 0
        for r in n.reads:
            m |= live.get(id(r), 0) | (bit_of.get(id(r.t), 0) if r.node < 0 and r.t is not None else 0)
        if m:
            for i in [id(v) for v in n.outs if v is not None] + [id(w) for _, w in n.writes]:
                live[i] = live.get(i, 0) | m
    out = []
    for t in outs:
        if not isinstance(t, torch.Tensor):
            out.append(0)
            continue
        b = unwrap_all(t)
        # (an input returned as it came carries its tangent; the last write into an output's storage, too)
        m = bit_of.get(id(b), 0)
        for v in (tape.value_of(b), tape.write_before(b)):
            if v is not None:
                m |= live.get(id(v), 0)
        out.append(m)
    return out


class _Kept(TorchDispatchMode):
    """Around one op of the replay that runs through the transforms and whose output the
    policy kept: below them the op is not computed, its kept output is returned (what the
    torch.func path's re-run did), so each transform records the op as it is, its
    inputs and its output, and the policy saves the compute it promised."""

    def __init__(self, node, rec):
        super().__init__()
        self.node, self.rec, self.done = node, rec, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.done and func is self.node.func:
            self.done = True
            meta = self.rec.entries[self.node.key].meta
            if meta is None or meta == arg_meta(args):
                return self.rec.replay(func, self.node.key, args, kwargs)
        return func(*args, **kwargs)


class _Span:
    """A region nested in the replayed one, as one step of the replay (see :func:`_steps`):
    its planned nodes run as a region of their own, on the values they read from before it
    (``flat``), returning the values read after it (``outs``)."""

    __slots__ = ("call", "flat", "spec", "kw", "outs", "writes")

    def __init__(self, call, flat, outs):
        self.call, self.flat, self.outs = call, flat, outs
        self.spec, self.kw, self.writes = None, {}, ()


def _written_from_before(tape, sub, start: int) -> bool:
    """A node of ``sub`` writes into a value made before ``start`` (through a view of it)."""
    nodes = tape.nodes
    for k in sub:
        if nodes[k].writes:
            todo = list(tape.written_values(nodes[k]))
            while todo:
                w = todo.pop()
                if w.node < start:
                    return True
                m = nodes[w.node]
                if m.func.is_view or m.func in ALIASING:
                    todo.extend(m.reads[:1])
    return False


def _steps(tape, run, top: set, roots, make_call) -> list:
    """``run`` as the replay's steps: each region nested in the replayed one whose nodes
    depend on the inputs becomes one :class:`_Span` (``make_call(sub, steps, inputs,
    outputs, opts, name)``: the function that runs it; None: no region runs), each custom
    Function whose nodes do one :class:`FunctionStep`, the rest node by node.  Replayed
    as plain nodes, a vjp of the replay would keep every activation of the nested regions
    at once; as regions, each keeps what its policy saves, as in the forward.  A span that
    writes into a value from before it, or reads a buffer's private copy, runs node by node
    (a Function's cannot: :class:`CannotReplay`)."""
    nodes = tape.nodes
    last: dict[int, int] = {}  # id(value) -> the last node of run reading it
    for k in run:
        for x in nodes[k].flat:
            if type(x) is Value:
                last[id(x)] = k
    for a, _, fn, _ in tape.spans:  # (a Function step reads its arguments where it starts)
        if type(fn) is FunctionStep:
            for x in fn.flat:
                if type(x) is Value:
                    last[id(x)] = max(last.get(id(x), -1), a)
    for v in roots:
        last[id(v)] = len(nodes)
    spans = sorted((s for s in tape.spans if s[1] > s[0]), key=lambda s: (s[0], -s[1]))

    def build(ks: list, spans: list) -> list:
        steps: list = []
        i = 0
        while spans:
            (a, b, opts, name), inner = spans[0], []
            rest = spans[1:]
            while rest and rest[0][0] < b:
                s = rest.pop(0)
                if s[1] <= b:  # (nested in it; one that is not, from a forward tried again, is left out)
                    inner.append(s)
            spans = rest
            while i < len(ks) and ks[i] < a:
                steps.append((ks[i], nodes[ks[i]]))
                i += 1
            j = i
            while j < len(ks) and ks[j] < b:
                j += 1
            sub, i = ks[i:j], j
            if not sub:
                continue
            sub_steps = build(sub, inner)
            made = [v for k in sub for v in (*nodes[k].outs, *(w for _, w in nodes[k].writes)) if v is not None]
            outputs = list({id(v): v for v in made if last.get(id(v), -1) >= b}.values())
            if type(opts) is FunctionStep:
                if any(k in top for k in sub):
                    _function_step(tape, sub, inner, outputs, opts, a)
                    steps.append((sub[-1], opts))
                else:  # (no transform differentiates it: its ops, as they ran)
                    steps.extend(sub_steps)
                continue
            inputs = list({id(x): x for k in sub for x in nodes[k].flat if type(x) is Value and x.node < a}.values())
            if make_call is None or not outputs or not any(k in top for k in sub) or any(x.node < 0 and x.snap is not None for x in inputs) \
                    or _written_from_before(tape, sub, a):
                steps.extend(sub_steps)
                continue
            steps.append((sub[-1], _Span(make_call(sub, sub_steps, inputs, outputs, opts, name), inputs, outputs)))
        steps.extend((k, nodes[k]) for k in ks[i:])
        return steps

    return build(list(run), spans)


def _function_step(tape, sub, inner, outputs, fn, a) -> None:
    """Check that the custom Function of span ``sub`` can replay as one step: nothing after
    it reads a value its forward made but did not return, its forward reads no value of the
    region but its arguments, it neither draws random numbers nor writes a value from before
    it, and no region is nested in it."""
    outs = {id(v) for v in fn.outs if v is not None}
    if any(id(v) not in outs for v in outputs):
        raise CannotReplay(f"a value {fn.cls.__name__}'s forward made is read outside it")
    if any(type(s[2]) is not FunctionStep for s in inner):
        raise CannotReplay(f"a region is nested in {fn.cls.__name__}'s forward")
    args = {id(x) for x in fn.flat if type(x) is Value}
    if any(type(x) is Value and 0 <= x.node < a and id(x) not in args for k in sub for x in tape.nodes[k].flat):
        raise CannotReplay(f"{fn.cls.__name__}'s forward reads a value of the region it was not given")
    if any(tape.nodes[k].rng is not None for k in sub) or _written_from_before(tape, sub, a):
        raise CannotReplay(f"{fn.cls.__name__}'s forward draws random numbers or writes a value from before it")


def _not_an_input(v):  # pragma: no cover - _steps makes every value from before a span an input
    raise CannotReplay("a nested region's span reads a value that is not among its inputs")


def replay_outputs(tape, outs: list, subst: dict, name: str, rec=None, region=None) -> list:
    """The region's outputs (``outs``: see remat_fn._frame.output_value) computed by replaying the tape on
    the tensors ``subst`` gives for the forward's plain ones (``id`` -> tensor); ``rec``:
    the policy's record, whose kept values stand in for their ops' results; ``region(fun,
    name, opts, args)``: runs ``fun`` as a region (the regions nested in this one, see
    :func:`_steps`)."""
    roots = [v for v in outs if type(v) is Value]
    want = [*roots, *tape.out_writes]
    # (a custom Function replays as one step: its every argument and output is computed)
    _, run, held, outside, fns = tape.plan_steps(want)
    nodes = tape.nodes
    # (a value of a storage the region writes, a BatchNorm's running statistics, is read from
    # a private copy, as the plain replay reads it: a constant, never the caller's tensor)
    read = [*outside, *(x for _, fn in fns for x in fn.flat if type(x) is Value and x.node < 0)]
    inputs = {id(v) for v in read if v.snap is None and v.t is not None and id(v.t) in subst}
    top, live = _through_transforms(tape, run, inputs, fns)
    for v in held:
        n = nodes[v.node]
        if n is None or any(id(r) in live for r in n.reads):
            raise CannotReplay("a held random op depends on the inputs")

    env: dict = {}
    writes = any(nodes[k].writes for k in run)

    def outside(v):
        t = subst.get(id(v.t)) if v.t is not None and v.snap is None else None
        if t is None:  # (a constant: plain, as the forward read it)
            with DisableFuncTorch():
                t = tape.outside_value(v, name, env)
        return t

    get = tape.getter(env, writes, None, outside)

    top_ids = {id(nodes[k]) for k in top}

    entries = rec.entries if rec is not None else None

    def make_runner(get_outside, keep: bool):
        # (``get_outside``: the replay's getter or a span's: a Function's forward reads constants through it.  The
        # runner a span's region keeps (in its function, in the replay's graph) refers to no replay's env: a cycle)
        def runner(node, args, kwargs):
            if type(node) is _Span:
                return node.call(*args)
            if type(node) is FunctionStep:  # (through the transforms: see _through_transforms)
                return apply_step(node, args, kwargs, lambda given: _function_forward(tape, run, node, given, get_outside))
            kept = keep and bool(entries) and node.key is not None and entries.get(node.key) is not None \
                and not node.writes and node.rng is None
            if id(node) in top_ids:
                with torch.set_grad_enabled(node.grad), torch.inference_mode() if node.inference else _NULL, \
                        _Kept(node, rec) if kept else _NULL:
                    return run_recorded(node, args, kwargs)
            with DisableFuncTorch(), torch.no_grad():
                if node.func in INDEPENDENT:  # (its tensor argument may be an input: its sizes only)
                    args = [_plain(a) for a in args]
                return rec.replay(node.func, node.key, args, kwargs) if kept else run_recorded(node, args, kwargs)
        return runner

    def make_call(sub, steps, inputs, outputs, opts, span_name):
        sub_writes = any(nodes[k].writes for k in sub)

        def span(*tensors):
            env2 = {id(v): t for v, t in zip(inputs, tensors)}
            # (every value from before the span is an input: nothing here refers to the replay's
            # env, which the span's region, in the replay's graph, would keep alive in a cycle)
            get2 = tape.getter(env2, sub_writes, None, _not_an_input)
            # (values this region's policy kept are computed in the span: returned in place of their
            # op, they would be constants of the span's region, which its own replay drops)
            return tuple(tape.run_nodes(sub, [(v, sub[-1] + 1) for v in outputs], get2, env2, sub_writes, make_runner(get2, False),
                                        steps))

        return lambda *tensors: region(span, span_name, opts, tensors)

    end = len(nodes)
    steps = _steps(tape, run, top, roots, make_call if region is not None else None) if tape.spans and run else None
    with no_autocast(), reenter(tape.modes), rec.replaying() if entries else _NULL:
        got = tape.run_nodes(run, [(v, end) for v in roots], get, env, writes, make_runner(get, True), steps) if run else [get(v) for v in roots]
    it = iter(got)
    return [next(it) if type(v) is Value else subst.get(id(v), v) for v in outs]


def _function_forward(tape, run, fn, given, get):
    """A custom Function's forward in a replay (``fn``: its step): its recorded ops, below the transforms, on the
    tensors it was ``given`` (``id`` of an argument's Value -> tensor); ``get`` reads the constants from outside."""
    ks = [k for k in run if fn.start <= k < fn.end]
    env2 = dict(given)

    def get2(v):
        t = env2.get(id(v))
        if t is None:  # (a constant from outside the region)
            t = env2[id(v)] = _plain(get(v))
        return t

    return tape.run_nodes(ks, [(v, fn.end) for v in fn.outs if v is not None], get2, env2,
                          any(tape.nodes[k].writes for k in ks), run_recorded)


def replay_fn(spec, tensors, wrt, out_diff, region=None):
    """The region's recorded forward (``spec``: the torch.func path's state of one call) as a
    function of its differentiated inputs (positions ``wrt`` of ``tensors``), returning its
    differentiable outputs (``out_diff``); the function's Python does not run.  ``region``:
    see :func:`replay_outputs`."""

    # Two inputs over one plain tensor (a parameter given to functional_call and the module's
    # own, closed over): the tape saw that tensor; the differentiated one stands for it
    bases = spec.bases
    diff = set(wrt)
    order = [k for k in range(len(bases)) if k not in diff] + list(wrt)
    if len({bases[k] for k in wrt}) < len(wrt):
        raise CannotReplay("two differentiated inputs share their plain tensor")

    def f(*diff_inputs):
        full = replace_at(tensors, wrt, diff_inputs)
        subst = {bases[k]: full[k] for k in order if full[k] is not None}
        outs = replay_outputs(spec.tape, spec.out_values, subst, spec.name, spec.rec, region)
        return tuple(o for o, d in zip(outs, out_diff) if d)

    return f


def replay_jvp(spec, tensors, tangents, wrt, out_diff, region=None) -> tuple:
    """The Function's ``jvp`` rule: the tangents of its differentiable outputs (``out_diff``),
    ``torch.func.jvp`` of :func:`replay_fn`.  Where ``vmap`` levels batch the region (``vmap(jvp)``,
    ``vmap(jacfwd)``, ``vmap(hessian)``), the tape holds the ops as they ran on the batched
    tensors below those levels, so the tangents are pushed through that recorded program on
    those tensors (``torch.func.jvp`` of :func:`replay_fn`), each tangent laid out as its
    primal was there, and the output tangents are batched again as the forward's outputs
    were (``spec.layers``: the ``(level, bdim)`` of each input and output in the forward,
    at the levels of the vmap rule torch generates for the Function, which stand for the
    caller's vmap levels in order).  A tangent's own vmap levels (``jacfwd``'s basis) are
    taken off too, and a ``torch.func.vmap`` of this rule's own maps the jvp over them (the
    caller's levels below the rule's cannot take a new dual).  The function's Python does
    not run again."""
    if not spec.batched:
        return torch.func.jvp(replay_fn(spec, tensors, wrt, out_diff, region), tuple(tensors[i] for i in wrt),
                              tuple(tangents[i] for i in wrt))[1]
    phys, live, level_of = _physical_inputs(spec, tensors, {})
    out_layers = [lay for lay, d in zip(spec.layers[1], out_diff) if d]
    extra, tans = _physical_args([tangents[k] for k in wrt], [live[k] for k in wrt], level_of, {}, False)
    for k in wrt:  # (a dual of a tensor whose elements share memory (an expanded batch) is refused: its copy)
        if any(st == 0 and n > 1 for st, n in zip(phys[k].stride(), phys[k].shape)):
            phys[k] = phys[k].contiguous()
    f = replay_fn(spec, phys, wrt, out_diff, region)
    primals = tuple(phys[k] for k in wrt)

    def push(*tans):
        return torch.func.jvp(f, primals, tans)[1]

    for _ in extra:
        push = torch.func.vmap(push)
    metas = [m for m, d in zip(spec.out_meta, out_diff) if d]
    return _logical(push(*tans), [_live_layers(lay, level_of) for lay in out_layers], [len(m[0]) for m in metas], extra, {})


def replay_vjp(spec, tensors, cot, wrt, out_diff, region=None, quiet: bool = True, apart: bool = True) -> tuple:
    """The Function's ``backward`` where ``vmap`` levels inside the grad level batch the region
    (``grad(vmap(f))``, ``jacrev(vmap(f))``): the input gradients for the cotangents ``cot``, pulled
    back through the recorded forward on the batched tensors below the vmaps (the rule's own vmap
    levels, torch's generated vmap rule's, stand in order for the forward's), laid out as in
    :func:`replay_jvp`.  An input the vmaps do not batch gets its gradient summed over the batch,
    as plain code's.  ``quiet``: nothing differentiates the backward, which runs below every level;
    otherwise (``hessian(vmap(f))``, ``grad(grad(vmap(f)))``, ``create_graph=True`` around ``vmap(f)``)
    below the rule's vmap levels only, so that the levels outside, and autograd, differentiate the
    replay as they would the function.  The function's Python does not run.  ``apart``: the backward
    is a grad level's, which keeps each example of a vmap outside it apart (``spec.apart``: as the
    forward's levels say); eager autograd's, through the rule's vmap, sums them as plain code's.
    Under eager autograd too (``vmap(grad(f))``, a gradient penalty on the per-sample gradients),
    ``quiet`` runs it below every level: eager autograd records the batched ops, as plain code's."""
    outer = [lv for lv, kind in live_levels().items() if not is_vmap_kind(kind)]
    how = {"below": True} if quiet else {"above": max(outer, default=0)}
    phys, live, level_of = _physical_inputs(spec, tensors, how)
    # (vmap(grad(vmap(f))): a vmap outside the grad level keeps each example's gradient apart, which a
    # replay below it does too for an input it batches, and sums over its examples for one it does not;
    # judged by the forward's levels too: a vjp_fn called after its level exited sees no grad level)
    keep = {lv for lv in level_of.values() if outer and lv < max(outer)}
    if any(not keep <= {lv for lv, _ in live[k]} or (apart and spec.apart is not None and not spec.apart[k]) for k in wrt):
        raise CannotReplay("a vmap outside the grad level batches the region, not a differentiated input: its examples' gradients stay apart")
    out_layers = [_live_layers(lay, level_of) for lay, d in zip(spec.layers[1], out_diff) if d]
    extra, cots = _physical_args(cot, out_layers, level_of, how, True)
    # (on plain tensors, below every level: the replay, and a region nested in it, sees none, as
    # under plain autograd; a rule's vmap level around it holding no batched tensor made such a
    # region watch its every tensor as a side output.  Not quiet: below the levels inside the
    # outermost differentiating one, all vmaps, whose wrappers are off every tensor)
    with below_transforms() if quiet else below_level(how["above"]):
        vjp_fn = torch.func.vjp(replay_fn(spec, phys, wrt, out_diff, region), *[phys[k] for k in wrt])[1]
        for _ in extra:
            vjp_fn = torch.func.vmap(vjp_fn)
        gin = vjp_fn(tuple(cots))
    return _logical(gin, [_live_layers(spec.layers[0][k], level_of) for k in wrt], [tensors[k].dim() for k in wrt], extra, how)


def _physical_inputs(spec, tensors, how):
    """The region's inputs as the tape read them (below their vmap wrappers), their live ``(level,
    bdim)``, and the live level standing for each of the forward's (see replay_jvp).  ``how``: which
    wrappers come off (see peel_vmaps)."""
    level_of: dict[int, int] = {}
    phys, live = [], []
    for t, lay in zip(tensors, spec.layers[0]):
        got = peel_vmaps(t, **how)
        if got is None or len(got[1]) != len(lay):
            raise CannotReplay("the rule's inputs are not batched as the forward's were")
        x, have, _ = got
        for (level, bdim), (fresh, fbdim) in zip(have, lay):
            if bdim != fbdim or level_of.setdefault(fresh, level) != level:
                raise CannotReplay("the rule's inputs are not batched as the forward's were")
        phys.append(x)
        live.append(have)
    return phys, live, level_of


def _live_layers(lay, level_of) -> list:
    if any(fresh not in level_of for fresh, _ in lay):
        raise CannotReplay("an output is batched at a level no input is")
    return [(level_of[fresh], bdim) for fresh, bdim in lay]


def _physical_args(args, layers, level_of, how, cotangents: bool) -> tuple[list, list]:
    """Tangents or cotangents ``args`` laid out as the plain tensors of ``layers`` (see
    to_physical), their own vmap levels (``extra``: jacfwd's or jacrev's basis) first."""
    peeled = [peel_vmaps(a, **how) for a in args]
    if any(p is None for p in peeled):
        raise CannotReplay("a tangent is wrapped at another level")
    mine = set(level_of.values())
    if cotangents:  # (where the recorded result is not batched at a level of the rule's, summed over it)
        peeled = [sum_levels(p, {lv for lv, _ in p[1]} & mine - {lv for lv, _ in lay}) for p, lay in zip(peeled, layers)]
    extra = sorted({lv for p in peeled for lv, _ in p[1]} - mine)
    sizes = dict(vmap_sizes())
    out = []
    for p, lay in zip(peeled, layers):
        x = to_physical(p, lay, sizes, extra)
        if x is None:
            raise CannotReplay("a tangent cannot be laid out as its primal")
        out.append(x.movedim(tuple(range(x.dim() - len(extra), x.dim())), tuple(range(len(extra)))))
    return extra, out


def _logical(ys, layers, dims, extra, how) -> tuple:
    """Results ``ys`` of the physical replay (``extra`` levels first) batched again at ``layers``."""
    out = []
    for y, lay, n in zip(ys, layers, dims):
        y = y.movedim(tuple(range(len(extra))), tuple(range(y.dim() - len(extra), y.dim())))
        t = from_physical(y, lay, n, extra, **how)
        if t is None:
            raise CannotReplay("a result is not batched as its tensor")
        out.append(t)
    return tuple(out)
