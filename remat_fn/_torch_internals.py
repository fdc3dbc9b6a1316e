"""Every private torch internal remat_fn uses, in one place, checked at import.

torch gives no public API for what a rematerialisation library must touch:
the default saved-tensor hooks stack (and torch.func's switch that turns it
off), the functorch wrappers and interpreter stack, the dispatch-mode base
class, version counters, op schemas, autograd nodes' saved tensors.  Each is
reached here and nowhere else (``tests/test_package.py`` fails if another
module names one), and each is looked up when ``remat_fn`` is imported: a
torch without one of them fails at once with an error naming the internal,
the installed version and the supported range, never later and never by
silently doing less.

Notes, cited from the code as ``NOTE [name]``:

- NOTE [saved-tensor hooks stack]: ``torch.autograd.graph.saved_tensors_hooks``
  is a context manager; a region pushes and pops its pair from code that is
  not a ``with`` block (an exception path, a forward split over calls), so it
  uses the stack's push/pop/top functions directly.  ``torch.func`` grad
  transforms switch hooks off (``..._disable``) and torch 2.11+ refuses a
  non-empty stack on entering one.
- NOTE [functorch wrappers]: under ``torch.func`` tensors are wrapped level by
  level; the library unwraps them to reach storages and version counters and
  asks which levels are alive (see :mod:`remat_fn._functorch`).
- NOTE [version counters]: saved and captured tensors are checked for in-place
  changes through ``Tensor._version``; offloading and partitioning put a
  tensor's counter back on its copy (``_unsafe_set_version_counter``).
- NOTE [op schemas]: policies and the record of a forward read an op's schema
  (mutability, returns) from ``OpOverload._schema``.
- NOTE [custom Functions under functorch]: a custom ``autograd.Function`` applied
  under a transform goes through ``custom_function_call`` (which a torch function
  mode sees, so a region records where it starts and ends), and its graph node's
  class is generated per level around the user's class (found in its closure).
- NOTE [autograd nodes' saved tensors]: what plain autograd would save is read
  from a graph's nodes (``_saved_*`` attributes) where hooks are refused.
- NOTE [dispatch modes and Dynamo]: torch wraps a dispatch mode's
  ``__torch_dispatch__`` so that Dynamo never traces the mode's frames (a region's
  recording mode must not be compiled when compiled code runs inside a region),
  and that wrapper imports ``torch._dynamo`` (1.3-1.9 s) at the first op of any
  mode.  remat_fn's modes subclass :class:`TorchDispatchMode` below, which opts out
  of torch's wrapper (``_should_skip_dynamo``) and wraps the same way but only
  once something else (``torch.compile``) has imported Dynamo: before that
  nothing can be compiling, so a region's first call does not load the compiler.
- NOTE [tensor hooks]: a tensor's hooks are the dicts ``Tensor._backward_hooks`` (and
  ``_post_accumulate_grad_hooks``), keyed by
  handle ids numbered in order (``RemovableHandle.next_id``): the hooks an abandoned try
  registered are those from an id on.  ``torch.func``'s transforms call
  ``torch.autograd.grad`` from one file (``torch._functorch.eager_transforms``), which a
  backward's Python frames name.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from typing import Any

import torch

__all__ = [
    "SUPPORTED_TORCH", "push_hooks", "pop_hooks", "top_hooks", "hooks_enabled", "hooks_disabled_message",
    "enable_hooks", "disable_hooks", "set_version_counter", "functorch", "functorch_active",
    "DisableTorchFunction", "set_grad_mode", "generator_key", "drop_hooks_since", "hooks_since", "TRANSFORMS_FILE",
    "DisableFuncTorch", "DisableTorchDispatch", "dispatch_stack_len", "function_mode_enabled", "TorchDispatchMode",
    "disable_current_modes", "mode_stack", "tree_leaves", "FakeTensorMode", "OpOverload", "OpOverloadPacket",
    "assert_async", "CachingTorchDispatchMode", "checkpoint_flag", "forward_ad_level", "version",
    "is_view", "use_count", "schema", "saved_tensor_attrs", "below_transforms", "below_level",
]

SUPPORTED_TORCH = ">=2.12,<2.16"


def _missing(what: str) -> ImportError:
    return ImportError(
        f"remat_fn needs {what}, which torch {torch.__version__} does not provide. remat_fn supports "
        f"torch{SUPPORTED_TORCH}: pip install 'torch{SUPPORTED_TORCH}'."
    )


def _attr(obj: Any, path: str, name: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _missing(f"{path}.{name}") from None


def _from(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise _missing(f"{module}.{name}") from None


# NOTE [saved-tensor hooks stack]
_A = torch._C._autograd
push_hooks = _attr(_A, "torch._C._autograd", "_push_saved_tensors_default_hooks")
pop_hooks = _attr(_A, "torch._C._autograd", "_pop_saved_tensors_default_hooks")
top_hooks = _attr(_A, "torch._C._autograd", "_top_saved_tensors_default_hooks")
hooks_enabled = _attr(_A, "torch._C._autograd", "_saved_tensors_hooks_is_enabled")
hooks_disabled_message = _attr(_A, "torch._C._autograd", "_saved_tensors_hooks_get_disabled_error_message")
enable_hooks = _attr(_A, "torch._C._autograd", "_saved_tensors_hooks_enable")
disable_hooks = _attr(_A, "torch._C._autograd", "_saved_tensors_hooks_disable")

# NOTE [version counters]
set_version_counter = _attr(_A, "torch._C._autograd", "_unsafe_set_version_counter")

# NOTE [functorch wrappers]
functorch = torch._C._functorch
for _name in ("is_functorch_wrapped_tensor", "get_unwrapped", "unwrap_if_dead", "get_interpreter_stack",
              "is_gradtrackingtensor", "maybe_get_level", "is_dead_tensor_wrapper", "TransformType",
              "CVmapInterpreterPtr", "RandomnessType", "is_batchedtensor", "maybe_get_bdim", "_add_batch_dim"):
    _attr(functorch, "torch._C._functorch", _name)
functorch_active = _attr(torch._C, "torch._C", "_are_functorch_transforms_active")
# (``requires_grad_()`` on a wrapper inside a transform, as ``torch.func.vjp`` makes its primals differentiable)
inplace_requires_grad = _from("torch._functorch.eager_transforms", "enable_inplace_requires_grad")
# NOTE [custom Functions under functorch]: under a functorch transform ``Function.apply``
# calls this higher-order op (a torch function mode sees it), and the graph's node is of a
# class generated per level, whose ``forward`` closes over the user's class
custom_function_call = _from("torch._functorch.autograd_function", "custom_function_call")
_GENERATED = "torch._functorch.autograd_function"  # (the module of the classes it generates)
# every functorch level set aside (as ``Function.apply`` runs a forward at the base level)
below_transforms = _from("torch._functorch.pyfunctorch", "temporarily_clear_interpreter_stack")
_pop_layer = _attr(functorch, "torch._C._functorch", "pop_dynamic_layer_stack")
_push_layer = _attr(functorch, "torch._C._functorch", "push_dynamic_layer_stack")
_peek_layer = _attr(functorch, "torch._C._functorch", "peek_interpreter_stack")


@contextlib.contextmanager
def below_level(level: int):
    """The functorch levels above ``level`` set aside (the innermost ones), as
    :data:`below_transforms` sets aside every level."""
    stack = []
    try:
        while (top := _peek_layer()) is not None and top.level() > level:
            stack.append(_pop_layer())
        yield
    finally:
        while stack:
            _push_layer(stack.pop())

# modes
DisableTorchFunction = _attr(torch._C, "torch._C", "DisableTorchFunction")
set_grad_mode = _attr(torch._C, "torch._C", "_set_grad_enabled")  # (torch.set_grad_enabled's own switch)
# ops on plain tensors run as plain ops, whatever functorch transform is active
DisableFuncTorch = _attr(torch._C, "torch._C", "_DisableFuncTorch")
# ops run below every Python dispatch mode (bookkeeping no recording tape sees)
DisableTorchDispatch = _attr(torch._C, "torch._C", "_DisableTorchDispatch")
dispatch_stack_len = _attr(torch._C, "torch._C", "_len_torch_dispatch_stack")
function_mode_enabled = _attr(torch._C, "torch._C", "_is_torch_function_mode_enabled")
# autocast on for any device (one call instead of one per device type)
any_autocast_enabled = getattr(torch._C, "_is_any_autocast_enabled", None)
_DispatchModeBase = _from("torch.utils._python_dispatch", "TorchDispatchMode")
disable_current_modes = _from("torch.utils._python_dispatch", "_disable_current_modes")
mode_stack = _from("torch.utils._python_dispatch", "_get_current_dispatch_mode_stack")
FakeTensorMode = _from("torch._subclasses.fake_tensor", "FakeTensorMode")

# ops and pytrees
OpOverload = _from("torch._ops", "OpOverload")
OpOverloadPacket = _from("torch._ops", "OpOverloadPacket")
tree_leaves = _from("torch.utils._pytree", "tree_leaves")
assert_async = _attr(torch, "torch", "_assert_async")

# torch's selective checkpointing (remat_fn.compat reads the policy out of it)
CachingTorchDispatchMode = _from("torch.utils.checkpoint", "_CachingTorchDispatchMode")
_checkpoint = importlib.import_module("torch.utils.checkpoint")

# forward-mode AD's eager dual level
_forward_ad = importlib.import_module("torch.autograd.forward_ad")
_attr(_forward_ad, "torch.autograd.forward_ad", "_current_level")

# private attributes of tensors, ops and autograd nodes
for _obj, _path, _name in ((torch.Tensor, "torch.Tensor", "_version"), (torch.Tensor, "torch.Tensor", "_is_view"),
                           (torch.Tensor, "torch.Tensor", "_use_count"),
                           (torch.ops.aten.sin.default, "torch._ops.OpOverload", "_schema")):
    _attr(_obj, _path, _name)


def checkpoint_flag(name: str) -> Any:
    """One of torch's checkpoint switches (``_checkpoint_debug_enabled``,
    ``_enable_checkpoint_early_stop``): ``None`` when unset, as torch keeps them."""
    return getattr(_checkpoint, name, None)


def forward_ad_level() -> int:
    """The current eager forward-mode AD level (-1 outside ``dual_level``)."""
    return _forward_ad._current_level


def version(t: torch.Tensor) -> int:
    """``t``'s version counter (NOTE [version counters]); 0 for an inference tensor, which has
    none: a write into one (inside ``inference_mode``) is not seen."""
    try:
        return t._version
    except RuntimeError:  # (an inference tensor)
        return 0


def is_view(t: torch.Tensor) -> bool:
    return t._is_view()


def use_count(t: torch.Tensor) -> int:
    """How many C++ references hold ``t``'s TensorImpl (1: only its Python object)."""
    return t._use_count()


def schema(op: Any) -> Any:
    """An ``OpOverload``'s schema (NOTE [op schemas])."""
    return op._schema


def function_class(node: Any) -> Any:
    """The user's ``autograd.Function`` class behind a graph node of a custom Function (its
    own class, or the one functorch generated for it at a level, NOTE [custom Functions
    under functorch]); None for any other node."""
    cls = getattr(node, "_forward_cls", None)
    if cls is None:
        return None
    if not issubclass(cls, torch.autograd.Function):  # (a _SingleLevelFunction)
        cls = _closed_class(cls) or cls
    # (under vmap, the class torch's generated vmap rule makes, one per vmap level, whose forward closes
    # over the class it batches: a region's own is taken for the region's, vmap(vmap(remat(f))) too)
    inner = cls
    while inner is not None and inner.__module__ == _GENERATED and inner.__name__.startswith("Vmapped"):
        inner = _closed_class(inner)
    if inner is not None and inner.__dict__.get("remat_fn_region"):
        cls = inner
    return cls.__dict__.get("remat_fn_replay_of", cls)  # (a replay's subclass: the user's class)


def _closed_class(cls: Any) -> Any:
    for cell in getattr(cls.forward, "__closure__", None) or ():
        c = cell.cell_contents
        if isinstance(c, type) and issubclass(c, torch.autograd.Function):
            return c
    return None


def saved_tensor_attrs(node: Any) -> tuple[str, ...]:
    """The names under which an autograd node exposes what it saved
    (NOTE [autograd nodes' saved tensors])."""
    return tuple(a for a in dir(node) if a.startswith("_saved_"))


# NOTE [dispatch modes and Dynamo]
_eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
_set_strategy = getattr(_eval_frame, "set_code_exec_strategy", None)
_Strategy = getattr(_eval_frame, "_FrameExecStrategy", None)
_Action = getattr(_eval_frame, "_FrameAction", None)
# without these (or torch's opt-out), torch's own wrapper stays: the same skipping,
# with Dynamo imported at a mode's first op
_LAZY_SKIP = None not in (_set_strategy, _Strategy, _Action) and hasattr(_DispatchModeBase, "_should_skip_dynamo")


def _skipped_by_dynamo(fn: Any) -> Any:
    """``fn`` as ``torch._disable_dynamo(fn, recursive=True)`` makes it, without
    importing ``torch._dynamo`` before Dynamo is in use: Dynamo never traces the
    wrapper's frame (torch._dynamo.eval_frame.skip_code, from the C module) and,
    once Dynamo is loaded, runs ``fn`` under ``torch._dynamo.disable``."""
    disabled = None

    @functools.wraps(fn)
    def dispatch(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            dynamo = sys.modules.get("torch._dynamo")
            if dynamo is None or not hasattr(dynamo, "disable"):
                return fn(*args, **kwargs)  # Dynamo not loaded: nothing is compiling
            disabled = dynamo.disable(fn, recursive=True)
        return disabled(*args, **kwargs)

    _set_strategy(dispatch.__code__, _Strategy(_Action.SKIP, _Action.DEFAULT))  # type: ignore[misc]
    return dispatch


class TorchDispatchMode(_DispatchModeBase):  # type: ignore[misc, valid-type]
    """torch's ``TorchDispatchMode`` as remat_fn's modes subclass it: Dynamo skips
    their ``__torch_dispatch__`` as torch arranges, without loading Dynamo before
    it is used (NOTE [dispatch modes and Dynamo])."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return not _LAZY_SKIP  # (torch's wrapper: only where ours cannot be made)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        raw = cls.__dict__.get("__torch_dispatch__")
        if _LAZY_SKIP and raw is not None and not isinstance(raw, classmethod):
            cls.__torch_dispatch__ = _skipped_by_dynamo(raw)  # type: ignore[method-assign]


def generator_key(g: torch.Generator) -> int:
    """The generator below ``g``: torch hands a ``__torch_dispatch__`` a Python object of its own for a
    generator argument (``g is G`` fails for the caller's ``G``), over the same C++ generator."""
    return g._cdata


# NOTE [tensor hooks]
TRANSFORMS_FILE = _from("torch._functorch.eager_transforms", "__file__")


def hooks_since(t: torch.Tensor, first: int) -> list[tuple[int, Any, int]]:
    """``(kind, dict, id)`` of the hooks on ``t`` whose handles were made from id ``first`` on: kind 0 its tensor hooks,
    1 its post-accumulate-grad hooks."""
    return [(kind, hooks, k) for kind, hooks in enumerate((t._backward_hooks, t._post_accumulate_grad_hooks)) for k in hooks or ()
            if k >= first]


def drop_hooks_since(t: torch.Tensor, first: int) -> None:
    """Remove the hooks on ``t`` (and the post-accumulate-grad ones) whose handles were made from id ``first`` on."""
    for _, hooks, k in hooks_since(t, first):
        del hooks[k]
