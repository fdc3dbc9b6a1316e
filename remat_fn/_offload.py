"""Offloading: values and region inputs moved to another device and back.

* :class:`Offloader` (one per region call) copies a tensor to its destination
  (:meth:`~Offloader.put`, giving a :class:`Stored`), brings it back
  (:meth:`~Offloader.fetch`) and, on the first fetch of a backward, issues the
  copies back of all its values and of the region called before it in the
  forward (the one backward reaches next): Megatron-style prefetching.
* On CUDA every copy runs on one side stream per device: device-to-host
  copies wait for the compute stream and ``record_stream`` keeps the source
  alive until they are done; host-to-device copies are waited for by the
  compute stream through an event.  Elsewhere (CPU to CPU in CI) the copies
  are synchronous and a prefetch only marks the value (no early copy, so CPU
  memory figures are not distorted); the logic is the same.
* Destination buffers come from :data:`POOL` (pinned host memory for CUDA
  sources), reused across steps: after the first step, offloading allocates
  nothing.  With ``contiguous`` they are carved out of one :class:`Arena` per
  destination, sized from the first step (DeepSpeed's contiguous checkpointing).
* Copies are invisible to dispatch modes (so :class:`remat_fn.memory.LiveBytes`
  does not count pooled buffers as new tensors); meters registered with
  :func:`add_meter` count the bytes held offloaded, by destination.
* :func:`input_offloads` decides which arguments of a region are offloaded
  (the :data:`~remat_fn.policies.INPUT` question, names given with
  ``checkpoint_name`` before the call, and the op that produced the argument in
  another region); :func:`hooks_for_inputs` stores them that way on the eager
  path, and :func:`requesting` lets enclosing hooks (``remat_fn.distributed``)
  offload the slice they keep instead.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any

import optree
import torch
from torch.utils.weak import WeakTensorKeyDictionary

from ._ambient import AMBIENT
from ._functorch import C as _C
from ._functorch import forward_mode_active, is_wrapped, storage_ptr, transform_stack, unwrap_one
from ._functorch import unwrap_all as _base
from ._offload_buffers import POOL, Arena, Block, Meter, Pool, add_meter, meters, quiet, remove_meter, reset_stats, stats
from ._torch_internals import DisableTorchFunction, set_version_counter, version
from .policies import INPUT, NAMED, Offload, PolicyContext, decide

__all__ = ["Offloader", "Stored", "Pool", "Arena", "POOL", "Meter", "stats", "reset_stats", "add_meter",
           "remove_meter", "input_offloads", "hooks_for_inputs", "requesting", "take_request", "tag_name", "hint",
           "meta_args", "unaliased", "report_inputs", "named_inputs", "offloads_names", "FuncInputs"]


_no_torch_function = DisableTorchFunction
_set_version = set_version_counter  # NOTE [version counters]

# ---------------------------------------------------------------------------
# Stored values
# ---------------------------------------------------------------------------


def _layout(t: torch.Tensor) -> tuple:
    """Strides for the copy: ``t``'s own when its elements are dense and do not
    overlap (the copy is then one block in the same order), else contiguous."""
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            strides, acc = [], 1
            for sz2 in reversed(t.shape):
                strides.append(acc)
                acc *= max(sz2, 1)
            return tuple(reversed(strides))
        expected *= sz
    return tuple(t.stride())


def _release(block: Block, dst: str, nbytes: int, meters: list) -> None:
    if block.arena is not None:
        block.arena.release(block)
    else:
        POOL.release(block)
    for m in meters:
        m.sub(dst, nbytes)


class Stored:
    """One offloaded tensor: its copy on the destination and how to bring it back."""

    __slots__ = ("host", "device", "shape", "stride", "dtype", "nbytes", "dst", "event", "back", "back_event",
                 "prefetched", "offloader", "block", "version", "__weakref__")

    @property
    def is_cuda(self) -> bool:
        """Copied from a CUDA tensor: the copies are asynchronous, on the side stream."""
        return self.device.type == "cuda"

    def fetch(self) -> torch.Tensor:
        return self.offloader.fetch(self)


class Offloader:
    """Moves one region call's offloaded values to their destination and back, counting transfers.

    ``to_dst``/``to_src`` count copies made and fetched.  The first offloader of
    a thread to store something links to the previously storing one, so a
    backward that starts fetching this region's values also prefetches that
    region's (the one backward reaches next).
    """

    _streams: dict[str, Any] = {}

    def __init__(self):
        self.to_dst = 0
        self.to_src = 0
        self.stored: list[weakref.ref] = []
        self.prev: weakref.ref | None = None
        # ids of the values not fetched yet in this backward (None: no backward under way)
        self._unfetched: set[int] | None = None
        self.has_inputs = False  # region inputs are stored here (fetched first, see begin)

    # -- streams (CUDA) ------------------------------------------------------
    @classmethod
    def _side_stream(cls, device: torch.device):  # pragma: no cover - needs CUDA
        key = str(device)
        s = cls._streams.get(key)
        if s is None:
            s = cls._streams[key] = torch.cuda.Stream(device)
        return s

    # -- forward -------------------------------------------------------------
    def put(self, t: torch.Tensor, dst: torch.device, contiguous: bool = False, input: bool = False) -> Stored:
        """Copy ``t`` to ``dst`` (into a pooled or arena buffer); ``input``: ``t`` is
        an argument of the region."""
        self.to_dst += 1
        self.has_inputs = self.has_inputs or input
        with quiet():  # (called from pack hooks too: no op of this may enter a region's op sequence)
            base = _base(t).detach()
        dst = torch.device(dst)
        if dst.type == "cuda" and dst.index is None:
            dst = torch.device("cuda", torch.cuda.current_device())  # pragma: no cover - needs CUDA
        nbytes = base.numel() * base.element_size()
        pinned = base.is_cuda and dst.type == "cpu"
        block = Arena.get(dst, pinned).acquire(nbytes) if contiguous else POOL.acquire(nbytes, dst, pinned)
        stride = _layout(base)
        s = Stored()
        s.device, s.shape, s.stride, s.dtype, s.nbytes, s.dst = base.device, tuple(base.shape), stride, base.dtype, \
            nbytes, str(dst)
        s.back = s.back_event = None
        s.prefetched = False
        s.offloader = self
        s.version = version(base)
        s.block = block
        with quiet():
            host = block.buf[:nbytes].view(base.dtype).as_strided(base.shape, stride)
            if base.is_cuda:  # pragma: no cover - needs CUDA
                stream = self._side_stream(base.device)
                stream.wait_stream(torch.cuda.current_stream(base.device))  # base is computed
                if block.event is not None:
                    stream.wait_event(block.event)  # the buffer's last copy is done
                with torch.cuda.stream(stream):
                    host.copy_(base, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                base.record_stream(stream)  # not freed (and reused) before the copy is done
                s.event = block.event = ev
            else:
                if block.event is not None:  # pragma: no cover - a buffer a CUDA copy used
                    block.event.synchronize()
                host.copy_(base)
                s.event = None
        s.host = host
        stats["to_dst"] += 1
        stats["bytes_to_dst"] += nbytes
        ms = meters()
        for m in ms:
            m.add(s.dst, nbytes)
        weakref.finalize(s, _release, block, s.dst, nbytes, ms)
        if not self.stored:
            tail = AMBIENT.offload_tail
            self.prev = tail
            AMBIENT.offload_tail = weakref.ref(self)
        self.stored.append(weakref.ref(s))
        return s

    # -- backward ------------------------------------------------------------
    def prefetch(self, s: Stored) -> None:
        """Start bringing ``s`` back (asynchronously on CUDA; on CPU only marks it)."""
        if s.prefetched:
            return
        s.prefetched = True
        stats["prefetched"] += 1
        if not s.is_cuda:
            return
        stream = self._side_stream(s.device)  # pragma: no cover - needs CUDA
        with quiet(), torch.cuda.stream(stream):  # pragma: no cover
            if s.event is not None:
                stream.wait_event(s.event)
            # a new tensor (no in-place copy: under a functorch level that would
            # mutate a captured tensor); the op comes back wrapped there, and
            # streams and record_stream need the plain tensor underneath
            back = _base(s.host.to(s.device, non_blocking=True))
            ev = torch.cuda.Event()
            ev.record(stream)
        s.back, s.back_event = back, ev  # pragma: no cover
        s.block.event = ev  # pragma: no cover - the buffer is read until then

    def _live(self) -> list[Stored]:
        return [s for w in self.stored if (s := w()) is not None]

    def begin(self, recompute: bool = False) -> None:
        """Backward reached this region: prefetch all its values and those of the
        region called before it in the forward (once per backward pass: from the
        first fetch until every value came back).  ``recompute``: called as the
        recomputation starts, which is after the inputs were fetched (and the pass
        begun) if the region stores any."""
        if self._unfetched is not None or (recompute and self.has_inputs):
            return
        live = self._live()
        self._unfetched = {id(s) for s in live}
        for s in live:
            self.prefetch(s)
        prev = self.prev() if self.prev is not None else None
        if prev is not None:
            for s in prev._live():
                prev.prefetch(s)

    def fetch(self, s: Stored) -> torch.Tensor:
        """The value back on its device (a new tensor each time: a retained graph
        can fetch it again)."""
        self.to_src += 1
        stats["to_src"] += 1
        self.begin()
        left = self._unfetched
        if left is not None:
            left.discard(id(s))
            if not left:
                self._unfetched = None  # every value came back: a next backward starts afresh
        s.prefetched = False
        if s.is_cuda:  # pragma: no cover - needs CUDA
            back, ev = s.back, s.back_event
            s.back = s.back_event = None
            if back is None:
                self.prefetch(s)
                back, ev = s.back, s.back_event
                s.back = s.back_event = None
                s.prefetched = False
            cur = torch.cuda.current_stream(s.device)
            cur.wait_event(ev)
            back.record_stream(cur)  # allocated on the side stream, used here
            _set_version((back,), (s.version,))
            return back
        # visible to dispatch modes: the copy back is a real allocation on the device
        with _no_torch_function():
            back = _base(s.host.to(s.device, copy=True))
        # it stands for the tensor that was put: the recomputation's in-place checks
        # compare versions, and the copy's writes are no mutation
        _set_version((back,), (s.version,))
        return back

    def bytes_by_dst(self) -> dict[str, int]:
        """Bytes of this region's live offloaded values, by destination."""
        out: dict[str, int] = {}
        for w in self.stored:
            s = w()
            if s is not None:
                out[s.dst] = out.get(s.dst, 0) + s.nbytes
        return out


# ---------------------------------------------------------------------------
# Which region inputs are offloaded
# ---------------------------------------------------------------------------

_names = WeakTensorKeyDictionary()  # tensor -> name given by checkpoint_name
_hints = WeakTensorKeyDictionary()  # region output -> (op, meta args, meta kwargs) its region offloaded


def tag_name(t: torch.Tensor, name: str) -> None:
    """Remember ``checkpoint_name``'s name for ``t`` (asked about when ``t`` enters a region)."""
    try:
        _names[t] = name
    except TypeError:  # pragma: no cover - a tensor that cannot be weakly referenced
        pass


def meta_args(args, kwargs) -> tuple | None:
    """``(args, kwargs)`` with every tensor replaced by a meta tensor of its shape,
    strides and dtype (None where that cannot be made: sparse tensors, say)."""
    def m(a):
        if isinstance(a, torch.Tensor):
            b = _base(a)
            return torch.empty_strided(b.shape, b.stride(), dtype=b.dtype, device="meta")
        return a

    try:
        with quiet():
            return optree.tree_map(m, (args, kwargs), none_is_leaf=True)
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def hint(t: torch.Tensor, info) -> None:
    """Record that ``t`` (a region's output) was made by an op its region's policy
    offloads: the region ``t`` enters next asks its own policy about that op."""
    try:
        _hints[t] = info
    except TypeError:  # pragma: no cover
        pass


def _eligible(t: torch.Tensor) -> bool:
    if not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter):
        return False
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return False
    if t.layout is not torch.strided or t.device.type == "meta":
        return False
    return True


def input_offloads(policy, tensors) -> dict[int, Offload]:
    """``{index: Offload}`` for the region arguments ``tensors`` that ``policy`` offloads.

    Asked in order: the :data:`INPUT` question; for a tensor named with
    ``checkpoint_name`` before the call, the :data:`NAMED` question; for the
    output of an op that another region offloaded, the question about that op
    (meta tensors in place of its arguments).  The first offload answer wins;
    any other answer leaves the argument as it is (kept on its device).
    """
    if policy is None or type(policy).__name__ in ("Measuring", "Plan"):
        return {}
    # only policies that say so are asked about arguments (a stateful torch SAC
    # policy sees the calls it sees under torch); names and producers are asked
    # as the values would be
    ask_input = bool(getattr(policy, "offloads_inputs", False))
    out: dict[int, Offload] = {}
    ctx = PolicyContext()
    for i, t in enumerate(tensors):
        if not _eligible(t):
            continue
        name = _names.get(t)
        ctx.key = None
        ctx.name = name
        ctx.op_output = t
        try:
            d = decide(policy, ctx, INPUT, (t,), {"name": name}) if ask_input else None
            if not isinstance(d, Offload) and name is not None:
                d = decide(policy, ctx, NAMED, (t,), {"name": name})
            if not isinstance(d, Offload):
                info = _hints.get(t)
                if info is not None and info[1] is not None:
                    ctx.name = None
                    op, (a, kw) = info
                    d = decide(policy, ctx, op, a, kw)
        finally:
            ctx.op_output = None
        if isinstance(d, Offload) and _src_ok(t.device.type, d):
            out[i] = d
    return out


def unaliased(offloads: dict, tensors, outputs) -> dict:
    """``offloads`` (by input id) without the inputs whose memory an output shares:
    the output keeps it alive on the device anyway, so a copy would only add."""
    if not offloads:
        return offloads
    outs = {storage_ptr(o) for o in optree.tree_leaves(outputs) if isinstance(o, torch.Tensor)}
    outs.discard(None)
    by_id = {id(t): t for t in tensors}
    return {k: d for k, d in offloads.items() if k in by_id and storage_ptr(by_id[k]) not in outs}


def _src_ok(device_type: str, d: Offload) -> bool:
    return d.src is None or device_type == torch.device(d.src).type


def named_inputs(tensors, offload_ids: dict):
    """``Record.on_input`` for the eager path: ``checkpoint_name`` on an argument of the
    region, *inside* it, offloads the argument when the policy offloads that name (as a
    name given before the call does): its id enters ``offload_ids``, the region's input
    decisions, which the saves after it and the end of the forward consult.  (Ids only:
    the listener lives as long as the region's record and must not hold the inputs.)"""
    index = {id(t): t.device.type for t in tensors if _eligible(t)}

    def on_input(base: torch.Tensor, d: Offload) -> None:
        dev = index.get(id(base))
        if dev is not None and _src_ok(dev, d):
            offload_ids.setdefault(id(base), d)

    return on_input


def offloads_names(policy) -> bool:
    """Whether ``policy`` may offload a value for its ``checkpoint_name``: it says so
    (an ``offloads_names`` attribute, which a custom policy may set), or it offloads
    names (``save_and_offload_only_these_names``) or combines one that does."""
    flag = getattr(policy, "offloads_names", None)
    if flag is not None:
        return bool(flag)
    if getattr(policy, "names_which_can_be_offloaded", None):
        return True
    inner = (getattr(policy, a, None) for a in ("policy_1", "policy_2", "policy"))
    return any(offloads_names(p) for p in inner if p is not None)


def report_inputs(sink: list, tensors, offloads: dict) -> None:
    """Tell ``saved_residuals`` which inputs the region keeps offloaded, and where."""
    for t in tensors:
        d = offloads.get(id(t))
        if d is not None:
            sink.append((t, "offloaded_input", _names.get(t), d.dst))


# ---------------------------------------------------------------------------
# Storing region inputs offloaded (eager path)
# ---------------------------------------------------------------------------


def hooks_for_inputs(offloads: dict[int, Offload], offloader: Offloader):
    """A ``(pack, unpack)`` pair for ``Frame.stash_inputs``: the tensors whose ids
    are in ``offloads`` go to their destination, the others are kept as they are."""

    def pack(x: torch.Tensor):
        d = offloads.get(id(x))
        if d is None:
            return x
        return offloader.put(x, torch.device(d.dst), d.contiguous, input=True)

    def unpack(v):
        return v if isinstance(v, torch.Tensor) else offloader.fetch(v)

    return pack, unpack


@contextlib.contextmanager
def _request(d: Offload | None, offloader: Offloader):
    prev = AMBIENT.offload_request
    AMBIENT.offload_request = None if d is None else (d, offloader)
    try:
        yield
    finally:
        AMBIENT.offload_request = prev


def requesting(outer, offloads: dict[int, Offload], offloader: Offloader):
    """Enclosing saved-tensor hooks ``outer`` with a request to offload the tensors in
    ``offloads`` (ids): hooks that keep a slice of them (``remat_fn.distributed``)
    take the request (:func:`take_request`) and offload the slice; others ignore it."""
    opack, ounpack = outer

    def pack(x):
        with _request(offloads.get(id(x)), offloader):
            return opack(x)

    return pack, ounpack


def take_request():
    """The offload requested for the tensor being packed, as ``put(t) -> Stored``, or None."""
    r = AMBIENT.offload_request
    if r is None:
        return None
    AMBIENT.offload_request = None
    d, offloader = r
    return lambda t: offloader.put(t, torch.device(d.dst), d.contiguous, input=True)


# ---------------------------------------------------------------------------
# Storing region inputs offloaded (torch.func path)
# ---------------------------------------------------------------------------


def _func_eligible(t: torch.Tensor) -> bool:
    """A saved input the ``torch.func`` path may replace by a copy: wrapped by exactly
    the one grad level being differentiated (``grad``/``vjp``, no ``vmap``, no
    forward mode, no eager autograd below), so nothing differentiates the
    backward's use of it and the copy's value is all backward needs.  (The region
    was called with one transform active: see :class:`FuncInputs`.)"""
    if not (is_wrapped(t) and _C.is_gradtrackingtensor(t)) or _C.is_dead_tensor_wrapper(t):
        return False
    base = unwrap_one(t)
    if is_wrapped(base) or base.requires_grad:
        return False
    return len(transform_stack()) == 1 and not forward_mode_active()


class FuncInputs:
    """The ``torch.func`` path's offloaded inputs of one region call.

    ``decisions``: input index -> Offload (from :func:`input_offloads`);
    ``stored``: input index -> :class:`Stored` once the forward is done;
    ``hints``: per output, what :meth:`Record.hint_outputs` found.
    """

    __slots__ = ("single", "names", "decisions", "stored", "hints")

    def __init__(self, decisions: dict[int, Offload]):
        # only a region called under exactly one transform (grad or vjp) offloads:
        # under grad(grad) functorch also runs the Function one level down, where
        # the lone wrapper left is the outer level's
        self.single = len(transform_stack()) == 1
        self.decisions = decisions if self.single else {}
        self.names = False  # arguments named inside the region may be offloaded (see listen)
        self.stored: dict[int, Stored] = {}
        self.hints: list = []

    def listen(self, rec, inputs) -> None:
        """Let ``checkpoint_name`` on an argument *inside* the region offload it
        (``rec.on_input``), as a name given before the call does, where the policy can
        offload by name (:func:`offloads_names`).  Such a region runs again in backward
        (:attr:`rerun`), as one whose arguments are offloaded: the forward's own graph
        would hold its differentiated arguments (the leaves of its ``vjp`` level), so
        only the Function's copy, stored by :meth:`save`, can leave the device."""
        self.names = self.single and offloads_names(rec.policy)
        if not self.single:
            return  # (nested transforms: arguments are kept as they are, named or not)
        index = {id(_base(t)): (i, t.device.type) for i, t in enumerate(inputs)
                 if _eligible(t) and _func_eligible(t)}
        decisions, names = self.decisions, self.names

        def on_input(base: torch.Tensor, d: Offload) -> None:
            hit = index.get(id(base))
            if hit is None or hit[0] in decisions or not _src_ok(hit[1], d):
                return
            if not names:
                warnings.warn(
                    f"checkpoint_name named an argument of a remat region that the policy {rec.policy!r} "
                    "offloads, but under torch.func the argument stays on the device: the policy does "
                    "not say it offloads by name. Fix: set offloads_names = True on the policy (an "
                    "attribute, as remat_fn's name policies have), or name the argument before the call.",
                    stacklevel=2)
                return
            decisions[hit[0]] = d

        rec.on_input = on_input

    @property
    def rerun(self) -> bool:
        """Backward runs the function again: arguments are offloaded, or may be once named."""
        return bool(self.decisions) or self.names

    def save(self, inputs, outputs, offloader: Offloader | None) -> list:
        """What ``setup_context`` saves for backward: ``inputs`` with the offloaded
        ones replaced by None (their copies are in :attr:`stored`)."""
        saved = list(inputs)
        if not self.decisions or offloader is None:
            return saved
        outs = {storage_ptr(o) for o in outputs if isinstance(o, torch.Tensor)}
        for i, d in self.decisions.items():
            t = saved[i]
            if i in self.stored or not _func_eligible(t) or storage_ptr(t) in outs:
                continue
            self.stored[i] = offloader.put(t, torch.device(d.dst), d.contiguous, input=True)
            saved[i] = None
        return saved

    def restore(self, saved: tuple) -> tuple:
        """``saved`` with each offloaded input fetched back."""
        if not self.stored:
            return saved
        return tuple(self.stored[i].fetch() if t is None and i in self.stored else t
                     for i, t in enumerate(saved))

    def kept_inputs(self, inputs) -> list:
        return [t for i, t in enumerate(inputs) if i not in self.stored]
