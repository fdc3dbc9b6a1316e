"""The library's ambient state: one object per thread, one for the process.

What a region's call depends on beyond its arguments (which regions enclose it,
which tapes record, which profile, offload request and residual sink are active,
the draw and the bookkeeping in progress) lives on :data:`AMBIENT`, a
``threading.local``, and nowhere else, so one look tells what is in force.  Each
field is set by one context manager of the module that gives it its meaning (named
below), which restores it in ``finally``: an exception leaves nothing behind.
Fields are read as attributes (no call): the hot path pays one lookup.

:data:`SWITCHES` holds the process-wide switches (``remat_fn.set_debug``).
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["AMBIENT", "SWITCHES"]


class _Ambient(threading.local):
    def __init__(self) -> None:
        # regions this thread is inside of (remat_fn._region.entered)
        self.depth = 0
        # the torch.func path's active CaptureModes, innermost last (remat_fn._captures)
        self.captures: list = []
        # the active recording modes, innermost last (remat_fn._record.saving)
        self.tapes: list = []
        # the active remat_fn.profile()s, innermost last (remat_fn._profile)
        self.profiles: list = []
        # where remat_fn.print_saved_residuals collects (remat_fn._residuals)
        self.residuals: list | None = None
        # torch's early stop of recomputations (remat_fn._debug.set_early_stop)
        self.early_stop = True
        # the offload a policy asked for the value being saved, and the newest stored
        # value of a chain (remat_fn._offload)
        self.offload_request: Any = None
        self.offload_tail: Any = None
        # (private generator, node) of each draw running (remat_fn._ops.draw): a draw inside
        # another is an enclosing region's, of the op the other issued (its own generator comes
        # down as another Python object: the stack, not identity, pairs them)
        self.draws: list = []
        # the grad mode of the torch call being made, set above every functorch layer
        # (remat_fn._captures; read by remat_fn._ops.call_grad_mode)
        self.call_grad: bool | None = None
        # > 0 while a tape makes its own copies inside a dispatch handler (remat_fn._ops.bookkeeping)
        self.bookkeeping = 0
        # the hooks an abandoned eager try left on the caller's tensors, which the torch.func path's
        # forward claims instead of registering them again (remat_fn._hook_targets.claiming)
        self.claims: dict | None = None
        # remat_fn.random's reused generators (remat_fn._random_impl)
        self.generators: dict = {}
        self.scratch: Any = None
        self.rng_buffer: Any = None


class _Switches:
    __slots__ = ("debug",)

    def __init__(self) -> None:
        self.debug: bool | None = None  # remat_fn.set_debug (None: each region's debug=)


AMBIENT = _Ambient()
SWITCHES = _Switches()
