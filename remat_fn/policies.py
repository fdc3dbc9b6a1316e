"""Rematerialisation policies: which intermediate values to save, offload or recompute.

A policy is a small callable with the signature of
``torch.utils.checkpoint``'s selective-checkpoint policies::

    policy(ctx, op, *args, **kwargs) -> bool | CheckpointPolicy | Offload

It is called once per aten op that runs inside a region during the forward
(``op`` is the ``OpOverload``, ``args``/``kwargs`` its arguments, and
``ctx.is_recompute`` is ``False``), and once per :func:`remat_fn.checkpoint_name`
call, with ``op`` the :data:`NAMED` marker, ``args == (tensor,)`` and
``kwargs == {"name": name}``.  Before the forward it is also asked about each
floating-point tensor argument of the region, with ``op`` the :data:`INPUT`
marker (``args == (tensor,)``, ``kwargs == {"name": name or None}``), if it has
an ``offloads_inputs`` attribute that is true (:class:`offload_inputs` and
combinators over it); only an offload answer changes anything there.  ``True`` / ``MUST_SAVE`` / ``PREFER_SAVE`` save
the value (its op is not re-run in backward), ``False`` / ``PREFER_RECOMPUTE``
recompute it, ``MUST_RECOMPUTE`` on a name forces recomputation even if an op
rule saved it, and an :class:`Offload` (or torch's ``MUST_CPU_OFFLOAD``) moves
it to another device until backward needs it.  Any existing torch SAC policy
function, or a list of ops ("save these"; one op alone means the same as a list
of one), works unchanged.

The built-in policies carry JAX's names.  Parameterised ones are frozen
dataclasses, so they compare and hash:

>>> from remat_fn import policies
>>> policies.save_only_these_names("a", "b") == policies.save_only_these_names("a", "b")
True
>>> policies.dots_saveable is policies.checkpoint_dots
True
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch.utils.checkpoint import CheckpointPolicy

from ._errors import PolicyError
from ._torch_internals import OpOverload, OpOverloadPacket

__all__ = [
    "CheckpointPolicy",
    "Offload",
    "NAMED",
    "INPUT",
    "everything_saveable",
    "nothing_saveable",
    "dots_saveable",
    "checkpoint_dots",
    "dots_with_no_batch_dims_saveable",
    "checkpoint_dots_with_no_batch_dims",
    "save_only_these_names",
    "save_any_names_but_these",
    "save_anything_except_these_names",
    "save_from_both_policies",
    "save_and_offload_only_these_names",
    "offload_dot_with_no_batch_dims",
    "offload_inputs",
    "memory_budget",
    "DOT_OPS",
    "DOT_OPS_NO_BATCH",
    "PolicyContext",
    "decide",
    "normalize_policy",
]

aten = torch.ops.aten


class _Named:
    """Marker passed as ``op`` when a policy is asked about a named value."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "remat_fn.policies.NAMED"


NAMED = _Named()


class _Input:
    """Marker passed as ``op`` when a policy is asked about a region's argument."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "remat_fn.policies.INPUT"


INPUT = _Input()


def _packets(*names: str) -> frozenset:
    out = []
    for n in names:
        p = getattr(aten, n, None)
        if p is not None:
            out.append(p)
    return frozenset(out)


#: matmul-like and attention ops (as aten overload packets).
DOT_OPS = _packets(
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear", "dot", "vdot", "mv", "addmv",
    "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "cudnn_convolution",
    "mkldnn_convolution", "convolution_overrideable",
    "scaled_dot_product_attention", "_scaled_dot_product_attention_math",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward",
)
#: matmul-like ops whose operands have no batch dimension.
DOT_OPS_NO_BATCH = _packets("mm", "addmm", "dot", "vdot", "mv", "addmv")
_BATCHED_DOTS = _packets("bmm", "baddbmm")
_BADDBMM = torch.ops.aten.baddbmm


def _dot_without_batch_dims(op: Any, args: tuple) -> bool:
    """A matmul whose contraction has no batch dimension.

    ``torch.einsum("ij,jk->ik", a, b)`` (and other contractions torch lowers
    that way) runs as ``aten.bmm`` over a batch of one: classified by the
    contraction written, as ``jax.checkpoint_policies`` classifies
    ``dot_general``, it has no batch dimension.
    """
    p = _packet(op)
    if p in DOT_OPS_NO_BATCH:
        return True
    if p in _BATCHED_DOTS:
        a = args[1] if p is _BADDBMM and len(args) > 1 else (args[0] if args else None)
        return isinstance(a, torch.Tensor) and a.dim() == 3 and a.shape[0] == 1
    return False


def _packet(op: Any):
    return getattr(op, "overloadpacket", op)


@dataclasses.dataclass(frozen=True)
class Offload:
    """Decision: keep the value on ``dst`` (e.g. ``"cpu"``) until backward needs it.

    ``src`` restricts the offload to values living on that device type
    (``None``: any); values elsewhere are simply saved.  ``contiguous``: the
    copies of one step are carved out of one preallocated buffer per
    destination (DeepSpeed's ``contiguous_memory_optimization``; with
    ``dst`` the compute device itself, that buffer is on the device).
    """

    dst: str = "cpu"
    src: str | None = None
    contiguous: bool = False

    def __post_init__(self) -> None:
        for what, dev in (("offload_dst", self.dst), ("offload_src", self.src)):
            if dev is None:
                continue
            try:
                torch.device(dev)
            except (RuntimeError, TypeError):
                raise PolicyError(
                    f"unknown {what} device {dev!r}; use a torch device string such as "
                    "'cpu' or 'cuda'."
                ) from None

    @property
    def name(self) -> str:
        """Lets ``torch.compile`` map the decision onto torch's ``MUST_CPU_OFFLOAD``."""
        return "MUST_CPU_OFFLOAD"


def _is_named(op: Any) -> bool:
    return op is NAMED


# -- simple policies ---------------------------------------------------------


def everything_saveable(ctx, op, *args, **kwargs) -> bool:
    """Save every value: nothing is recomputed.  ``remat(f, policy=everything_saveable)``
    runs ``f`` as plain autograd would (remat becomes a no-op, as in JAX); inside
    combinators it means "save every op's output"."""
    return True


def nothing_saveable(ctx, op, *args, **kwargs) -> bool:
    """Save nothing but the region's inputs: recompute everything (the default)."""
    return False


def dots_saveable(ctx, op, *args, **kwargs) -> bool:
    """Save the outputs of matmul-like ops (mm, bmm, addmm, baddbmm, matmul, linear,
    convolution) and attention ops; recompute the rest."""
    return not _is_named(op) and _packet(op) in DOT_OPS


checkpoint_dots = dots_saveable


def dots_with_no_batch_dims_saveable(ctx, op, *args, **kwargs) -> bool:
    """Save the outputs of matmuls without batch dimensions (mm, addmm, mv, dot, and
    ``einsum("ij,jk->ik")``, which torch runs as a ``bmm`` over a batch of one)."""
    return not _is_named(op) and _dot_without_batch_dims(op, args)


checkpoint_dots_with_no_batch_dims = dots_with_no_batch_dims_saveable


# -- name policies -------------------------------------------------------------


def _names(names: tuple) -> frozenset[str]:
    for n in names:
        if not isinstance(n, str):
            raise PolicyError(f"policy names must be strings, got {n!r}")
    return frozenset(names)


@dataclasses.dataclass(frozen=True, init=False)
class save_only_these_names:
    """Save only the values named (with :func:`remat_fn.checkpoint_name`) in ``names``."""

    names: frozenset[str]

    def __init__(self, *names: str):
        object.__setattr__(self, "names", _names(names))

    def __call__(self, ctx, op, *args, **kwargs):
        return _is_named(op) and kwargs.get("name") in self.names


@dataclasses.dataclass(frozen=True, init=False)
class save_any_names_but_these:
    """Save every named value except those in ``names``; recompute unnamed values."""

    names: frozenset[str]

    def __init__(self, *names: str):
        object.__setattr__(self, "names", _names(names))

    def __call__(self, ctx, op, *args, **kwargs):
        return _is_named(op) and kwargs.get("name") not in self.names


@dataclasses.dataclass(frozen=True, init=False)
class save_anything_except_these_names:
    """Save every value (named or not) except the values named in ``names``.

    Unlike JAX's version, the excluded values really are recomputed: the op
    that produced an excluded value is not saved even though "anything" else is.
    """

    names: frozenset[str]

    def __init__(self, *names: str):
        object.__setattr__(self, "names", _names(names))

    def __call__(self, ctx, op, *args, **kwargs):
        if _is_named(op):
            return CheckpointPolicy.MUST_RECOMPUTE if kwargs.get("name") in self.names else True
        return True


@dataclasses.dataclass(frozen=True)
class save_from_both_policies:
    """Save what either policy saves (offload what either offloads and neither saves)."""

    policy_1: Any
    policy_2: Any

    def __post_init__(self):
        # (a list of ops, or one op, means what it means as ``policy=``: save those ops' outputs)
        for field in ("policy_1", "policy_2"):
            p = getattr(self, field)
            if isinstance(p, (list, tuple, set, frozenset, OpOverload, OpOverloadPacket)):
                object.__setattr__(self, field, normalize_policy(p))

    @property
    def offloads_inputs(self) -> bool:
        """Asked about the region's arguments if either policy is (see :class:`offload_inputs`)."""
        return any(getattr(p, "offloads_inputs", False) for p in (self.policy_1, self.policy_2))

    def __call__(self, ctx, op, *args, **kwargs):

        d1 = decide(self.policy_1, ctx, op, args, kwargs)
        d2 = decide(self.policy_2, ctx, op, args, kwargs)
        if d1 == "save" or d2 == "save":
            return CheckpointPolicy.MUST_SAVE
        if isinstance(d1, Offload):
            return d1
        if isinstance(d2, Offload):
            return d2
        if d1 == "force" or d2 == "force":
            return CheckpointPolicy.MUST_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE


@dataclasses.dataclass(frozen=True, init=False)
class save_and_offload_only_these_names:
    """Save the values named in ``names_which_can_be_saved``, offload those named in
    ``names_which_can_be_offloaded`` from ``offload_src`` to ``offload_dst``, and
    recompute everything else."""

    names_which_can_be_saved: frozenset[str]
    names_which_can_be_offloaded: frozenset[str]
    offload_src: str
    offload_dst: str

    def __init__(self, *, names_which_can_be_saved=(), names_which_can_be_offloaded=(),
                 offload_src: str = "cuda", offload_dst: str = "cpu"):
        saved = _names(tuple(names_which_can_be_saved))
        offl = _names(tuple(names_which_can_be_offloaded))
        both = saved & offl
        if both:
            raise PolicyError(
                f"names {sorted(both)} are both in names_which_can_be_saved and "
                "names_which_can_be_offloaded; a value is either saved or offloaded. "
                "Remove them from one of the two."
            )
        Offload(offload_dst, offload_src)  # validates the devices
        object.__setattr__(self, "names_which_can_be_saved", saved)
        object.__setattr__(self, "names_which_can_be_offloaded", offl)
        object.__setattr__(self, "offload_src", offload_src)
        object.__setattr__(self, "offload_dst", offload_dst)

    def __call__(self, ctx, op, *args, **kwargs):
        if not _is_named(op):
            return False
        name = kwargs.get("name")
        if name in self.names_which_can_be_saved:
            return True
        if name in self.names_which_can_be_offloaded:
            return Offload(self.offload_dst, self.offload_src)
        return False


@dataclasses.dataclass(frozen=True)
class offload_dot_with_no_batch_dims:
    """Offload the outputs of matmuls without batch dimensions; recompute the rest."""

    offload_src: str = "cuda"
    offload_dst: str = "cpu"

    def __post_init__(self) -> None:
        Offload(self.offload_dst, self.offload_src)

    def __call__(self, ctx, op, *args, **kwargs):
        if not _is_named(op) and _dot_without_batch_dims(op, args):
            return Offload(self.offload_dst, self.offload_src)
        return False


def _is_activation(t: torch.Tensor) -> bool:
    """Made by a recorded op (``grad_fn`` set) and not a view of a leaf: what only
    the autograd graph keeps alive once the forward has moved on."""
    if t.grad_fn is None:
        return False
    base = t._base
    return base is None or base.grad_fn is not None


@dataclasses.dataclass(frozen=True)
class offload_inputs:
    """Offload the region's inputs (DeepSpeed's ``cpu_checkpointing``) and decide
    everything else with ``policy``.

    After the region's forward each floating-point tensor argument that is an
    activation (made by recorded ops, not a leaf or a view of one; with
    ``leaves=True`` every tensor argument except ``nn.Parameter``, DeepSpeed's
    rule) of at least ``min_bytes`` bytes, living on ``offload_src``, is copied
    to ``offload_dst``; the region keeps only that copy and brings it back when
    backward recomputes the region.  On CUDA the copies go to pinned, pooled host
    buffers on a side stream, and the next region's inputs are prefetched during
    backward.  ``contiguous=True`` carves one step's copies out of one
    preallocated buffer (``offload_dst=offload_src`` keeps them on the device:
    DeepSpeed's ``contiguous_memory_optimization``).

    >>> from remat_fn import policies
    >>> p = policies.offload_inputs(policies.dots_saveable, offload_src="cpu", offload_dst="cpu")
    >>> p.policy is policies.dots_saveable
    True
    """

    policy: Any = None
    offload_src: str = "cuda"
    offload_dst: str = "cpu"
    min_bytes: int = 0
    leaves: bool = False
    contiguous: bool = False
    #: asked about the region's arguments (``op`` is :data:`INPUT`); a custom
    #: policy that answers that question sets this too
    offloads_inputs: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if isinstance(self.policy, memory_budget):
            raise PolicyError(
                "offload_inputs(memory_budget(...)) is not supported: the budget plans what a region "
                "saves on its own. Fix: use memory_budget alone, or offload_inputs with another policy."
            )
        if isinstance(self.policy, (list, tuple, set, frozenset, OpOverload, OpOverloadPacket)):
            object.__setattr__(self, "policy", normalize_policy(self.policy))
        elif self.policy is not None:
            normalize_policy(self.policy)  # validates now
        if isinstance(self.min_bytes, bool) or not isinstance(self.min_bytes, int) or self.min_bytes < 0:
            raise PolicyError(f"min_bytes must be a non-negative int, got {self.min_bytes!r}")
        Offload(self.offload_dst, self.offload_src)

    def __call__(self, ctx, op, *args, **kwargs):
        if op is INPUT:
            t = args[0]
            if (self.leaves or _is_activation(t)) and t.numel() * t.element_size() >= self.min_bytes:
                return Offload(self.offload_dst, self.offload_src, self.contiguous)
        if self.policy is None or self.policy is nothing_saveable:
            return False
        return self.policy(ctx, op, *args, **kwargs)


@dataclasses.dataclass(frozen=True)
class memory_budget:
    """Automatic policy: save at most ``fraction`` of the activation bytes that the
    region would keep without remat, choosing what to save to minimise recompute.

    On the first call for given input shapes/dtypes the region is run once to
    measure each op's output bytes and cost (FLOPs for matmul-like ops, output
    elements for the rest) and which tensors autograd would save; the ops to save
    are then chosen on the recorded forward: a choice costs what backward must
    replay under it (keeping a value spares every op upstream of it) and the
    bytes of the kept values the replay reads (a 0-1 knapsack over the saved
    values plans regions of more than 160 candidate ops).  The plan is cached per
    input signature.  Works in eager mode and under ``torch.func``.
    """

    fraction: float

    def __post_init__(self) -> None:
        f = self.fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            raise PolicyError(f"memory_budget fraction must be a number in [0, 1], got {f!r}")

    def __call__(self, ctx, op, *args, **kwargs):
        # Under torch.compile the plan is not available; torch's own partitioner
        # decides (see torch._functorch.config.activation_memory_budget).
        return CheckpointPolicy.PREFER_RECOMPUTE


# -- the policy protocol: what a policy sees and how its answer is read ---------------


_SAVE = frozenset({CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE})
_CPU_OFFLOAD = frozenset(
    p for p in (getattr(CheckpointPolicy, "MUST_CPU_OFFLOAD", None),
                getattr(CheckpointPolicy, "PREFER_CPU_OFFLOAD", None)) if p is not None
)


class PolicyContext:
    """What a policy sees as ``ctx``: every attribute of torch's
    ``SelectiveCheckpointContext`` (``is_recompute``, always ``False`` since
    policies are only asked during the forward, and ``op_output``, the op's
    output) plus ``key`` (``(op, n-th call)``) and ``name`` (for named values)."""

    __slots__ = ("is_recompute", "op_output", "key", "name")

    def __init__(self):
        self.is_recompute = False
        self.op_output = None
        self.key = None
        self.name = None


def decide(policy, ctx, op, args, kwargs):
    """Normalise a policy's answer to ``"save"``, ``"recompute"``, ``"force"`` or an Offload."""
    d = policy(ctx, op, *args, **kwargs)
    if d is True:
        return "save"
    if d is False:
        return "recompute"
    if isinstance(d, CheckpointPolicy):
        if d in _SAVE:
            return "save"
        if d in _CPU_OFFLOAD:
            return Offload("cpu")
        if d is CheckpointPolicy.MUST_RECOMPUTE and op is NAMED:
            return "force"
        return "recompute"
    if isinstance(d, Offload):
        return d
    raise PolicyError(
        f"the policy {getattr(policy, '__name__', policy)!r} returned {d!r} for {op}; a policy "
        "must return a bool, a torch.utils.checkpoint.CheckpointPolicy or a "
        "remat_fn.policies.Offload. Fix the policy's return value."
    )


class _OpList:
    """A list of ops (or one op) given as a policy: save exactly those ops.

    It iterates over the ops in the order given, compares and hashes by the set
    of ops (so equal lists share cached options), and pickles by op name
    (torch's op objects do not pickle themselves)."""

    __slots__ = ("ops", "_order")

    def __init__(self, ops):
        order: list = []
        for o in ops:
            if not isinstance(o, (OpOverload, OpOverloadPacket)):
                raise PolicyError(
                    f"a list policy must contain aten ops (e.g. torch.ops.aten.mm.default), "
                    f"got {o!r}"
                )
            if o not in order:
                order.append(o)
        self._order = tuple(order)
        self.ops = frozenset(order)

    def __call__(self, ctx, op, *args, **kwargs):
        return op is not NAMED and (op in self.ops or getattr(op, "overloadpacket", None) in self.ops)

    def __iter__(self):
        return iter(self._order)

    def __len__(self):
        return len(self._order)

    def __eq__(self, other):
        return isinstance(other, _OpList) and other.ops == self.ops

    def __hash__(self):
        return hash(self.ops)

    def __reduce__(self):
        return (_ops_by_name, (tuple(str(op) for op in self._order),))

    def __repr__(self):
        return f"ops({sorted(map(str, self.ops))})"


def _ops_by_name(names: tuple[str, ...]) -> _OpList:
    """Unpickling: ``("aten.mm.default", "aten.addmm")`` -> the policy of those ops."""
    ops = []
    for name in names:
        op: Any = torch.ops
        for part in name.split("."):
            op = getattr(op, part)
        ops.append(op)
    return _OpList(ops)


def normalize_policy(policy):
    """``None`` for "recompute everything", otherwise a callable policy."""
    if policy is None or policy is nothing_saveable:
        return None
    if isinstance(policy, _OpList):
        return policy
    if isinstance(policy, (list, tuple, set, frozenset)):
        return _OpList(policy)
    if isinstance(policy, (OpOverload, OpOverloadPacket)):
        return _OpList((policy,))  # one op: "save this op's outputs", as a list of one
    if isinstance(policy, str):
        hint = (f" Fix: policy=remat_fn.policies.{policy}" if callable(globals().get(policy))
                else " Fix: pass a policy object, e.g. remat_fn.policies.dots_saveable")
        raise PolicyError(f"policy must be a policy object, not the string {policy!r}.{hint}.")
    if isinstance(policy, type):
        # a parameterised policy class passed without calling it
        raise PolicyError(
            f"policy={policy.__name__} is a policy factory, not a policy: call it with its "
            f"arguments, e.g. policy=remat_fn.policies.{policy.__name__}(...)"
            + (" with the names to save." if "names" in policy.__name__ else ".")
        )
    if callable(policy):
        return policy
    raise PolicyError(
        f"policy must be None, a callable policy(ctx, op, *args, **kwargs) (e.g. one of "
        f"remat_fn.policies), a list of aten ops or one aten op; got {type(policy).__name__} {policy!r}. "
        "Fix: pass e.g. policy=remat_fn.policies.dots_saveable."
    )
