"""Offloading policy-kept values to another device and back.

:class:`Offloader` moves a value chosen by an offload policy to its destination
during the forward and back before backward uses it.  On CUDA sources with a
CPU destination the copy goes into pinned host memory on a side stream, and all
host-to-device copies of a region are issued when its recomputation starts, so
they overlap compute.  Elsewhere (CPU to CPU in this project's CI) the copies
are synchronous.
"""

from __future__ import annotations

import torch

from ._functorch import unwrap_all as _base

__all__ = ["Offloader"]


class Offloader:
    """Moves offloaded values to their destination and back, counting transfers.

    On CUDA sources with a CPU destination the copy goes into pinned host
    memory on a side stream (the source tensor is kept alive on that stream
    until the copy is done via ``record_stream``); :meth:`prefetch` issues all
    host-to-device copies of a region on the side stream when its
    recomputation starts, and :meth:`fetch` makes the compute stream wait on
    the copy's event.  Elsewhere (CPU to CPU in this project's CI) the copies
    are synchronous.
    """

    def __init__(self):
        self.to_dst = 0
        self.to_src = 0
        self._stream = None

    def _side_stream(self, device):  # pragma: no cover - needs CUDA
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def put(self, t: torch.Tensor, dst: torch.device):
        self.to_dst += 1
        if t.is_cuda and dst.type == "cpu":  # pragma: no cover - needs CUDA
            stream = self._side_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            buf = torch.empty_like(t, device="cpu", pin_memory=True)
            with torch.cuda.stream(stream):
                buf.copy_(t, non_blocking=True)
                t.record_stream(stream)
                ev = torch.cuda.Event()
                ev.record(stream)
            return [buf, t.device, ev, None]
        # ops called inside a dispatch mode may come back wrapped by an active
        # functorch level: keep the plain tensor underneath
        return [_base(t.to(dst, copy=True)), t.device, None, None]

    def prefetch(self, h) -> None:
        buf, device, ev, back = h
        if back is not None or device.type != "cuda":
            return
        stream = self._side_stream(device)  # pragma: no cover - needs CUDA
        with torch.cuda.stream(stream):  # pragma: no cover
            if ev is not None:
                stream.wait_event(ev)
            # inside a dispatch mode under a functorch level the copy comes
            # back wrapped; streams need the plain tensor underneath
            h[3] = _base(buf.to(device, non_blocking=True))
            ev2 = torch.cuda.Event()
            ev2.record(stream)
            h[2] = ev2

    def fetch(self, h) -> torch.Tensor:
        buf, device, ev, back = h
        self.to_src += 1
        if device.type == "cuda":  # pragma: no cover - needs CUDA
            if back is None:
                self.prefetch(h)
                back = h[3]
            torch.cuda.current_stream(device).wait_event(h[2])
            back.record_stream(torch.cuda.current_stream(device))
            h[3] = None  # the next backward fetches again
            return back
        return _base(buf.to(device, copy=True))
