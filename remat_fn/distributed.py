"""Partitioned activations: ``remat`` whose saved tensors are split across ranks.

``remat_fn.distributed.remat`` is :func:`remat_fn.remat` plus activation
partitioning, the idea of DeepSpeed's ``partition_activations`` and Megatron's
``distribute_saved_activations``: when several ranks hold the *same*
activations (the ranks of a tensor/model-parallel group, which all see the same
hidden states between their parallel layers), each rank needs to keep only
``1/world_size`` of every tensor a rematerialised region keeps for backward.
Before the region is recomputed the full tensor is rebuilt with one
all-gather.

How it works (eager autograd).  Around each call of the region a pair of
saved-tensor hooks is pushed.  A region called while hooks are active stores
its tensor inputs (and, with a policy, the tensors the policy saves) through
them (see :mod:`remat_fn._path_hooks`), so:

* ``pack`` keeps a *copy* of this rank's ``1/world_size`` slice of the
  tensor's bytes (padded so that every rank's slice has the same length; the
  caller's tensor is never modified) plus its shape, strides, dtype, device and
  an integer checksum of the whole tensor;
* ``unpack`` all-gathers the slices of every rank of ``group`` into one buffer
  and views it with the original shape *and strides* (so the recomputation runs
  the same kernels on the same layout and reproduces the forward bit for bit),
  then checks the checksum: a tensor that was not identical on every rank (for
  example because ``group`` is a data-parallel group whose ranks see different
  data) raises :class:`~remat_fn.RematError` instead of silently giving wrong
  gradients.

What is partitioned: strided tensors that carry autograd history
(``grad_fn is not None``: activations produced by the network), including
views of activations (transposes, ``qkv.split(...)`` pieces, expanded tensors,
which are sent unexpanded), of at least ``min_bytes`` bytes.  What is kept by
reference, unpartitioned: leaves (parameters, buffers, input batches, masks;
they are alive anyway, so partitioning them would add communication and save
nothing), views or aliases of leaves (``w.t()``), tensor subclasses
(``nn.Parameter``, ``DTensor``: already sharded), sparse / nested tensors,
tensors whose elements overlap in memory, empty tensors.  Pass
``should_partition=`` to choose yourself.  Values computed inside the region
that a ``policy`` saves (e.g. the matmul outputs of ``dots_saveable``) are
intermediates the region alone keeps alive: they are always partitioned,
unless they share storage with an argument that is kept whole.

Collectives.  ``unpack`` is a collective on ``group``: every rank must
recompute the same regions, on tensors of the same shapes, in the same order.
That holds for SPMD training (DDP, FSDP, tensor parallelism) where every rank
runs the same program; it does not hold if ranks branch differently on data.
With ``prefetch=True`` the unpack of a region also starts (``async_op=True``)
the all-gathers of the region called just before it in forward, i.e. the one
backward needs next, so that communication overlaps this region's recompute
and backward; the decision depends only on the call order, so it is the same
on every rank.

Where it does not partition: under ``torch.func`` transforms (they refuse
saved-tensor hooks), under ``torch.compile``, with grad mode off, and when
``group`` has one rank or no process group is initialised, the function is
exactly :func:`remat_fn.remat` (still correct; it just keeps full tensors).

Randomness across model-parallel ranks.  Use keys instead of an RNG tracker:
``remat_fn.random.fold_in(key, rank)`` gives each rank its own stream (for
dropout on *sharded* activations), while the unfolded key gives the same mask
on every rank (dropout on *replicated* activations).  Keys are arguments, so
recomputation replays the same masks with nothing saved or restored:

>>> import torch
>>> from remat_fn import random as rnd
>>> from remat_fn import distributed as rd
>>> @rd.remat
... def block(x, w, key):
...     return rnd.dropout(key, torch.tanh(x @ w), p=0.1)
>>> k = rnd.key(0)
>>> tp_rank = 0                       # torch.distributed.get_rank(tp_group)
>>> sharded_key = rnd.fold_in(k, tp_rank)
>>> x = torch.randn(4, 8, requires_grad=True)
>>> block(x, torch.randn(8, 8), sharded_key).sum().backward()
>>> x.grad.shape
torch.Size([4, 8])

See ``docs/distributed.md``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ._describe import describe_meta
from ._errors import RematError, explain_misuse
from ._functorch import transforms_active
from ._offload import Stored, take_request
from ._path_hooks import hooks_enabled
from ._region import Options, RegionCall
from ._torch_internals import assert_async, set_version_counter
from ._torch_internals import top_hooks as _top_hooks
from ._torch_internals import version as version_of
from ._transform import make_wrapper

__all__ = ["remat", "checkpoint", "default_should_partition"]

F = TypeVar("F", bound=Callable[..., Any])

_set_version = set_version_counter
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}

# Counters for tests and benchmarks (per process; not part of the API).
_stats = {"partitioned": 0, "kept": 0, "gathers": 0, "gathered_bytes": 0, "prefetched": 0, "offloaded": 0}


def _reset_stats() -> None:
    for k in _stats:
        _stats[k] = 0


# ---------------------------------------------------------------------------
# Which tensors are partitioned
# ---------------------------------------------------------------------------


def default_should_partition(t: torch.Tensor) -> bool:
    """The default rule: partition activations, keep everything that is alive anyway.

    True for a plain ``torch.Tensor`` (not a subclass such as ``nn.Parameter``
    or ``DTensor``) with a strided layout, at least one element, autograd
    history (``grad_fn`` set), that is not a view of a leaf and whose elements
    do not overlap once broadcast (stride-0) dimensions are collapsed.  Leaves
    (parameters, buffers, input batches, masks) and their views are kept by
    reference: they stay alive regardless, so slicing them would only add an
    all-gather.  Views of activations (``x.t()``, ``qkv.split(...)``,
    ``x.expand(...)``) are partitioned: keeping them whole would keep their
    whole base alive.
    """
    if type(t) is not torch.Tensor or t.layout is not torch.strided:
        return False
    if t.grad_fn is None or t.numel() == 0 or t.device.type == "meta":
        return False
    base = t._base
    if base is not None and base.grad_fn is None:
        return False  # a view (e.g. ``w.t()``) of a parameter or other leaf
    return _non_overlapping(_collapse_broadcast(t))


def _collapse_broadcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every expanded (stride-0) dimension narrowed to one element."""
    for i, (size, stride) in enumerate(zip(t.shape, t.stride())):
        if stride == 0 and size > 1:
            t = t.narrow(i, 0, 1)
    return t


def _dims_by_stride(t: torch.Tensor):
    return sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1)


def _non_overlapping(t: torch.Tensor) -> bool:
    span = 1
    for stride, size in _dims_by_stride(t):
        if stride < span:
            return False
        span = stride * size
    return True


def _dense(t: torch.Tensor) -> bool:
    """True if the elements fill ``numel`` consecutive storage slots (any dim order)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in _dims_by_stride(t):
        if stride != expected:
            return False
        expected *= size
    return True


# ---------------------------------------------------------------------------
# Process group
# ---------------------------------------------------------------------------


def _active_group(group):
    """``(group, rank, size)`` if partitioning applies, else None."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    if group is not None and hasattr(group, "get_group") and not isinstance(
        group, dist.ProcessGroup
    ):
        group = group.get_group()  # a 1-D DeviceMesh
    if group is None:
        group = dist.group.WORLD
    size = dist.get_world_size(group)
    if size < 0:
        raise RematError(
            f"remat_fn.distributed.remat: rank {dist.get_rank()} is not a member of the process "
            "group passed as group=. Fix: call the region only on the ranks of that group, or "
            "pass the group this rank belongs to (e.g. its tensor-parallel group)."
        )
    if size <= 1:
        return None
    return group, dist.get_rank(group), size


def _gather_fn():
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ---------------------------------------------------------------------------
# Packed handles
# ---------------------------------------------------------------------------


class _Kept:
    """A tensor kept by reference (or through the enclosing hooks)."""

    __slots__ = ("obj", "outer_unpack")

    def __init__(self, obj, outer_unpack):
        self.obj = obj
        self.outer_unpack = outer_unpack


class _Batch:
    """The partitioned tensors of one call of a region, linked to the previous call."""

    __slots__ = ("parts", "prev", "prefetched", "__weakref__")

    def __init__(self, prev):
        self.parts: list[weakref.ref] = []
        self.prev = prev
        self.prefetched = False


class _Part:
    """This rank's slice of one tensor and what is needed to rebuild it."""

    __slots__ = (
        "shard", "outer_unpack", "shape", "stride", "dtype", "device", "nbytes", "chunk",
        "check", "group", "size", "batch", "work", "buf", "stream", "requires_grad", "dense", "expand",
        "version",
        "__weakref__",
    )

    def launch(self) -> None:
        shard = self.shard
        if self.outer_unpack is not None:
            shard = self.outer_unpack(shard)
        elif type(shard) is Stored:  # offloaded (offload_inputs): back on the device first
            shard = shard.fetch()
        buf = torch.empty(self.chunk * self.size, dtype=torch.uint8, device=self.device)
        self.stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self.work = _gather_fn()(buf, shard, group=self.group, async_op=True)
        self.buf = buf
        _stats["gathers"] += 1
        _stats["gathered_bytes"] += buf.numel()

    def take(self) -> torch.Tensor:
        """Wait for the gather, rebuild the tensor, verify it, forget the buffer."""
        work, buf = self.work, self.buf
        self.work = self.buf = None
        batch = self.batch
        if batch.prefetched and not any(
            (p := w()) is not None and p.work is not None for w in batch.parts
        ):
            batch.prefetched = False  # a later backward (retain_graph) may prefetch again
        work.wait()  # on CUDA: makes the current stream wait for the collective
        if self.stream is not None:
            cur = torch.cuda.current_stream(self.device)
            if cur != self.stream:
                buf.record_stream(cur)  # allocated on the launching stream, used here
        flat = buf[: self.nbytes].view(self.dtype)
        if self.check is not None:
            s = _checksum(flat)
            if self.device.type == "cpu":
                if not torch.equal(s, self.check):
                    raise RematError(_not_replicated_msg(self))
            else:  # no host synchronisation on accelerators
                assert_async(s == self.check, _not_replicated_msg(self))
        if self.dense:
            out = flat.as_strided(self.shape, self.stride, 0)
        else:
            out = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
            out.copy_(flat.view(self.shape))
        # The rebuilt tensor stands for the packed one: give it the packed
        # tensor's version, so that remat's in-place-mutation check (which
        # compares versions) does not mistake the gather's write for a mutation.
        _set_version((out,), (self.version,))
        if self.expand is not None:
            out = out.expand(self.expand)
        if self.requires_grad:
            # The region recomputes from this tensor: it must require grad as
            # the original did, or autograd would save a different set of
            # tensors (``mm`` saves only one operand when the other needs no grad).
            out.requires_grad_(True)
        return out


def _checksum(flat: torch.Tensor) -> torch.Tensor:
    """Exact, order-independent integer sum of the bits of a 1-D contiguous tensor."""
    if flat.dtype is torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(_INT_OF_SIZE[flat.element_size()]).sum(dtype=torch.int64)


def _not_replicated_msg(part: _Part) -> str:
    return (
        f"remat_fn.distributed.remat: the tensor {describe_meta(part.shape, part.dtype)} rebuilt from "
        f"the slices of the {part.size} ranks of the group differs from the one this rank saved: "
        "it was not identical on every rank. Partitioning is for activations that are "
        "replicated across the group (a tensor/model-parallel group), not for data-parallel "
        "ranks that see different data, nor for tensors computed with rank-dependent "
        "randomness. Fix: pass group= the group over which the region's inputs are "
        "replicated, restrict what is partitioned with should_partition=, or use plain "
        "remat_fn.remat."
    )


class _Hooks:
    """The pack/unpack pair pushed around one call of a region."""

    __slots__ = ("group", "rank", "size", "outer", "should", "min_bytes", "check", "prefetch",
                 "batch", "tail_key", "input_ids", "kept_ptrs")

    # the last batch packed on each group (forward order), for prefetching
    tails: dict[int, weakref.ref] = {}

    def __init__(self, info, outer, should, min_bytes, check, prefetch, inputs, with_policy):
        self.group, self.rank, self.size = info
        # ids and kept storages only: holding the inputs would keep them alive
        self.input_ids = {id(x) for x in inputs}
        self.kept_ptrs = set()
        if with_policy:
            for x in inputs:
                if not default_should_partition(x):
                    try:
                        self.kept_ptrs.add(x.untyped_storage().data_ptr())
                    except (RuntimeError, NotImplementedError):
                        pass
        self.outer = outer
        self.should = should
        self.min_bytes = min_bytes
        self.check = check
        self.prefetch = prefetch
        self.batch: _Batch | None = None
        self.tail_key = id(self.group)

    def pack(self, t: torch.Tensor):
        outer = self.outer
        # the region offloads this argument (policies.offload_inputs): offload what is kept of it
        put = take_request() if outer is None else None
        if self.should is not None:
            part = self.should(t)
        elif id(t) in self.input_ids:  # an argument of the region
            part = default_should_partition(t)
        else:  # a value computed inside the region that its policy saves
            part = (type(t) is torch.Tensor and t.layout is torch.strided and t.numel() > 0
                    and t.device.type != "meta" and not self._aliases_kept_input(t)
                    and _non_overlapping(_collapse_broadcast(t)))
        if not (part and t.numel() * t.element_size() >= self.min_bytes):
            _stats["kept"] += 1
            if put is not None:
                _stats["offloaded"] += 1
                return _Kept(put(t), Stored.fetch)
            if outer is None:
                return _Kept(t, None)
            return _Kept(outer[0](t), outer[1])
        size, rank = self.size, self.rank
        with torch.no_grad():
            d = t.detach()
            core = _collapse_broadcast(d)  # an expanded tensor is sent unexpanded
            n = core.numel()
            nbytes = n * core.element_size()
            if _dense(core):  # bytes in memory order: the rebuild is a view
                flat = core.as_strided((n,), (1,), core.storage_offset())
                dense = True
            else:  # strided view with gaps (e.g. a split of qkv): copy, restore strides later
                flat = core.reshape(-1)
                dense = False
            chunk = -(-nbytes // size)
            lo = min(rank * chunk, nbytes)
            hi = min(lo + chunk, nbytes)
            shard = torch.empty(chunk, dtype=torch.uint8, device=d.device)
            if hi > lo:
                shard[: hi - lo].copy_(flat.view(torch.uint8)[lo:hi])
            if hi - lo < chunk:
                shard[hi - lo:].zero_()  # padding: every rank sends `chunk` bytes
            check = _checksum(flat) if self.check else None
            del flat
        p = _Part()
        p.shape, p.stride, p.dtype, p.device = core.shape, core.stride(), d.dtype, d.device
        p.dense = dense
        p.expand = d.shape if core.shape != d.shape else None
        p.nbytes, p.chunk, p.check = nbytes, chunk, check
        p.requires_grad = t.requires_grad
        p.version = version_of(t)
        p.group, p.size = self.group, size
        p.work = p.buf = p.stream = None
        if outer is not None:
            # compose: the slice itself goes through the enclosing hooks
            # (an enclosing remat region, save_on_cpu, ...)
            p.shard, p.outer_unpack = outer[0](shard), outer[1]
        elif put is not None:  # DeepSpeed's partition_activations + cpu_checkpointing
            p.shard, p.outer_unpack = put(shard), None
            _stats["offloaded"] += 1
        else:
            p.shard, p.outer_unpack = shard, None
        batch = self.batch
        if batch is None:
            tails = _Hooks.tails
            batch = self.batch = _Batch(tails.get(self.tail_key))
            tails[self.tail_key] = weakref.ref(batch)
        batch.parts.append(weakref.ref(p))
        p.batch = batch
        _stats["partitioned"] += 1
        return p

    def _aliases_kept_input(self, t: torch.Tensor) -> bool:
        """A saved value sharing storage with an argument that is kept whole (``w.t()``)."""
        try:
            return t.untyped_storage().data_ptr() in self.kept_ptrs
        except (RuntimeError, NotImplementedError):
            return True

    def unpack(self, h):
        if type(h) is _Kept:
            return h.obj if h.outer_unpack is None else h.outer_unpack(h.obj)
        if h.work is None:
            h.launch()
        if self.prefetch:
            _prefetch(h.batch.prev)
        return h.take()


def _prefetch(prev_ref) -> None:
    batch = prev_ref() if prev_ref is not None else None
    if batch is None or batch.prefetched:
        return
    batch.prefetched = True
    for w in batch.parts:
        p = w()
        if p is not None and p.work is None and p.outer_unpack is None:
            p.launch()
            _stats["prefetched"] += 1


# ---------------------------------------------------------------------------
# The transform
# ---------------------------------------------------------------------------


def _partitioning_possible() -> bool:
    if torch.compiler.is_compiling():
        return False  # compiled regions delegate to torch's checkpoint (no hooks)
    if transforms_active():
        return False  # torch.func refuses saved-tensor hooks
    return torch.is_grad_enabled() and hooks_enabled()


def _deepspeed_habit(args: tuple, kwargs: dict) -> str | None:
    """The fix for calling it as DeepSpeed's or torch's ``checkpoint(function, *args)``."""
    if len(args) <= 1:
        return None
    return ("remat_fn.distributed.remat (alias checkpoint, as in JAX) takes only the function and returns a "
            "wrapper to call with the arguments: remat(fn, group=...)(*args). For the form "
            "checkpoint(function, *args) of DeepSpeed and torch.utils.checkpoint, use remat_fn.compat.checkpoint(fn, *args).")


@explain_misuse(_deepspeed_habit)
def remat(
    fun: F | None = None,
    /,
    *,
    group: Any = None,
    policy: Any = None,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    prevent_cse: bool = True,
    preserve_rng_state: bool = True,
    debug: bool = False,
    min_bytes: int = 0,
    prefetch: bool = True,
    check_replicated: bool = True,
    should_partition: Callable[[torch.Tensor], bool] | None = None,
) -> F:
    """:func:`remat_fn.remat` whose saved tensors are partitioned across ``group``.

    Works as ``@remat``, ``@remat(group=tp_group)`` and ``remat(fun, group=...)``.
    Values and gradients are those of ``fun`` (and of :func:`remat_fn.remat`).

    **Arguments** (those of :func:`remat_fn.remat`, plus):

    - `group`: the ``torch.distributed`` process group (or 1-D ``DeviceMesh``)
      over which the region's saved tensors are *replicated*, typically the
      tensor-parallel group.  ``None`` is the default (world) group, resolved
      at call time.  A group of one rank, or no initialised process group,
      gives exactly :func:`remat_fn.remat`.
    - `min_bytes`: tensors smaller than this are kept whole (one all-gather
      per tiny tensor costs latency and saves nothing).  Default 0.
    - `prefetch`: when a region is recomputed, start the all-gathers of the
      region called before it in forward asynchronously.  Default True.
    - `check_replicated`: verify, after each all-gather, that the rebuilt
      tensor equals (integer checksum of its bits) the one this rank saved;
      raise :class:`~remat_fn.RematError` otherwise (on CUDA an asynchronous
      device assert, no host sync).  Default True.
    - `should_partition`: ``tensor -> bool``, called for every tensor the
      region stores (arguments and policy-saved values), replacing the
      default rule (:func:`default_should_partition` for arguments; always
      for policy-saved values that do not alias a kept argument).

    Every rank of ``group`` must call the same regions on tensors of the same
    shapes, in the same order (SPMD): the rebuild is a collective.
    """
    if not isinstance(min_bytes, int) or min_bytes < 0:
        raise TypeError(f"min_bytes must be a non-negative int, got {min_bytes!r}")
    if should_partition is not None and not callable(should_partition):
        raise TypeError(f"should_partition must be callable, got {should_partition!r}")
    opts = dict(
        group=group, policy=policy, static_argnums=static_argnums,
        static_argnames=static_argnames, prevent_cse=prevent_cse,
        preserve_rng_state=preserve_rng_state, debug=debug, min_bytes=min_bytes,
        prefetch=bool(prefetch), check_replicated=bool(check_replicated),
        should_partition=should_partition,
    )
    if fun is None:
        Options.create(**{k: v for k, v in opts.items() if k in _REMAT_OPTIONS})  # validate now
        return functools.partial(_make, **opts)  # type: ignore[return-value]
    return _make(fun, **opts)


_REMAT_OPTIONS = ("policy", "static_argnums", "static_argnames", "prevent_cse", "preserve_rng_state",
                  "debug")
checkpoint = remat


def _make(fun, *, group, min_bytes, prefetch, check_replicated, should_partition, **remat_opts):
    with_policy = remat_opts["policy"] is not None

    def outer_hooks(call: RegionCall):
        """The partitioning hooks for one eager call of the region (None: plain remat)."""
        if not _partitioning_possible():
            return None
        info = _active_group(group)
        if info is None:
            return None
        hooks = _Hooks(info, _top_hooks(False), should_partition, min_bytes,
                       check_replicated, prefetch, call.all_tensors(), with_policy)
        return hooks.pack, hooks.unpack

    wrapper = make_wrapper(fun, Options.create(**remat_opts, outer_hooks=outer_hooks))
    wrapper.remat_options = dict(  # type: ignore[attr-defined]
        wrapper.remat_options, group=group, min_bytes=min_bytes, prefetch=prefetch,
        check_replicated=check_replicated, should_partition=should_partition,
    )
    wrapper._factory = remat  # pickling rebuilds it: remat(fun, **remat_options) (see RematFunction)
    return wrapper
