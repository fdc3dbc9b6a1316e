"""Drop-in replacements for ``torch.utils.checkpoint``, built on :func:`remat_fn.remat`.

``checkpoint`` and ``checkpoint_sequential`` take torch's arguments and behave
like ``torch.utils.checkpoint`` with ``use_reentrant=False``, except that they
also work under ``torch.func`` transforms (``grad``, ``vjp``, ``jacrev``,
``hessian``, ``vmap(grad)``, ``functional_call``), where torch's own
checkpoint fails.  Swap them in wherever a checkpoint function is accepted
(``checkpoint_wrapper(module, checkpoint_fn=remat_fn.compat.checkpoint)``).
Hugging Face ``transformers`` models are switched with
:func:`enable_hf_remat` (and back with :func:`disable_hf_remat`)::

    remat_fn.compat.enable_hf_remat(model, policy=remat_fn.policies.dots_saveable)

Differences from torch, all deliberate:

* ``use_reentrant`` is accepted and ignored, with no warning: there is a
  single implementation, and none of the limitations of torch's reentrant
  variant (no ``torch.autograd.grad``, no keyword arguments, no nested
  structures) is reproduced.
* ``context_fn``: ``functools.partial(create_selective_checkpoint_contexts,
  policy_or_ops)`` is recognised (the policy is read from the returned
  ``_CachingTorchDispatchMode``) and becomes ``remat(policy=...)``, so
  selective checkpointing also works under ``torch.func``.  Any other
  ``context_fn`` is honoured as torch does: the forward runs under its first
  context manager and every recomputation under its second.
* ``determinism_check``: ``"default"`` and ``"none"`` are accepted (anything
  else raises ``ValueError`` as in torch).  remat_fn always checks the number,
  shapes, dtypes and devices of recomputed tensors: the check is free, and a
  recomputation that differs could only produce wrong gradients.
* ``early_stop`` (or ``torch.utils.checkpoint.set_checkpoint_early_stop``):
  ``True`` (the default) stops a recomputation once the last needed tensor is
  rebuilt; ``False`` runs it whole and raises
  :class:`remat_fn.RecomputeMismatchError` if it saved more, fewer or
  different tensors than the forward.  Under ``torch.func`` the region is
  always recomputed whole and checked op by op.
* ``debug=True`` (or ``torch.utils.checkpoint.set_checkpoint_debug_enabled``,
  or :func:`remat_fn.set_debug_enabled`) records op traces with user source
  lines, runs recomputations whole, and raises
  :class:`remat_fn.RecomputeMismatchError`, showing both traces, when the
  recomputation runs a different op sequence.
* Under ``torch.compile`` both functions call ``torch.utils.checkpoint``
  itself, so the compiler sees the usual ``tag_activation_checkpoint`` region
  (inside a transform traced by the compiler, e.g. ``torch.compile(grad(f))``,
  the function is traced plainly, as ``remat`` does).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import torch
import torch.utils.checkpoint as _tc

from ._debug import early_stop as _early_stop
from ._functorch import transforms_active
from ._structured import sequential_segments
from ._torch_internals import CachingTorchDispatchMode, checkpoint_flag
from ._transform import call_once
from .policies import normalize_policy

__all__ = ["checkpoint", "checkpoint_sequential", "enable_hf_remat", "disable_hf_remat"]

_DETERMINISM_CHECKS = ("default", "none")


def _is_noop(context_fn) -> bool:
    return context_fn is None or context_fn is _tc.noop_context_fn


class _Contexts:
    """The two context managers of one checkpoint call and which one is next."""

    __slots__ = ("context_fn", "forward", "recompute", "forward_done")

    def __init__(self, context_fn, forward, recompute):
        self.context_fn = context_fn
        self.forward = forward
        self.recompute = recompute
        self.forward_done = False


def _run_in_contexts(state: _Contexts, function, *args, **kwargs):
    # The first completed call is the forward; every later call recomputes.
    if state.forward_done:
        with state.recompute:
            return function(*args, **kwargs)
    try:
        with state.forward:
            out = function(*args, **kwargs)
    except BaseException:
        # The forward may be retried (e.g. to thread a newly found captured
        # tensor): give it fresh context managers.
        state.forward, state.recompute = state.context_fn()
        raise
    state.forward_done = True
    return out


def _policy_of(context_fn):
    """Return (policy, contexts or None) for a ``context_fn``."""
    if _is_noop(context_fn):
        return None, None
    contexts = context_fn()
    try:
        fwd, rec = contexts
    except (TypeError, ValueError):
        raise TypeError(
            "context_fn must return a tuple of two context managers (forward, recompute), "
            f"got {contexts!r}"
        ) from None
    if isinstance(fwd, CachingTorchDispatchMode):
        # functools.partial(create_selective_checkpoint_contexts, policy_fn_or_ops)
        return fwd.policy_fn, None
    return None, _Contexts(context_fn, fwd, rec)


def checkpoint(
    function,
    *args,
    use_reentrant: bool | None = None,
    context_fn=None,
    preserve_rng_state: bool = True,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    **kwargs,
):
    """Checkpoint ``function(*args, **kwargs)``: same arguments and results as
    ``torch.utils.checkpoint.checkpoint``, also under ``torch.func`` transforms.

    Inputs and outputs may be any nesting of tensors and other values;
    ``kwargs`` are passed to ``function``.  See the module docstring for how
    each of torch's options is honoured.

    >>> import torch
    >>> from remat_fn.compat import checkpoint
    >>> w = torch.randn(3, 3)
    >>> f = lambda x, scale=1.0: torch.tanh(x @ w) * scale
    >>> x = torch.randn(2, 3)
    >>> g = torch.func.grad(lambda x: checkpoint(f, x, scale=2.0).sum())(x)
    >>> torch.allclose(g, torch.func.grad(lambda x: f(x, scale=2.0).sum())(x))
    True
    """
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(
            f"determinism_check should be one of {list(_DETERMINISM_CHECKS)}, "
            f"but got {determinism_check}"
        )
    if not callable(function):
        raise TypeError(f"checkpoint expects a callable, got {type(function).__name__}")
    if torch.compiler.is_compiling():
        if transforms_active():
            return function(*args, **kwargs)  # see remat_fn/_path_compile.py
        # (torch's operator as Dynamo traces it: a context_fn given at all must be a selective-checkpoint
        # partial there, torch's own no-op included, so none is passed for it)
        extra = {} if _is_noop(context_fn) else {"context_fn": context_fn}
        return _tc.checkpoint(
            function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state,
            determinism_check=determinism_check, debug=debug, early_stop=early_stop, **extra, **kwargs,
        )
    global_debug = checkpoint_flag("_checkpoint_debug_enabled")
    if global_debug is not None:
        debug = global_debug
    if not torch.is_grad_enabled() and not transforms_active():
        # As torch: without grad mode nothing is saved and context_fn is not used.
        return function(*args, **kwargs)
    policy, contexts = _policy_of(context_fn)
    if contexts is not None:
        function = functools.partial(_run_in_contexts, contexts, function)
    global_early_stop = checkpoint_flag("_enable_checkpoint_early_stop")
    if global_early_stop is not None:
        early_stop = global_early_stop
    if early_stop and contexts is None:
        # (a generic context_fn's recompute context wraps a re-run of the function,
        # as in torch: such calls re-run it, whole and checked)
        return call_once(function, args, kwargs, policy=policy, preserve_rng_state=preserve_rng_state,
                         debug=bool(debug))
    with _early_stop(False):
        return call_once(function, args, kwargs, policy=policy, preserve_rng_state=preserve_rng_state,
                         debug=bool(debug))


def checkpoint_sequential(functions, segments, input, use_reentrant: bool | None = None, **kwargs):
    """``torch.utils.checkpoint.checkpoint_sequential`` on remat_fn.

    ``functions`` is an ``nn.Sequential`` or a list of callables; they are
    split into ``segments`` chunks of ``len(functions) // segments`` (the last
    takes the rest) and all chunks but the last are checkpointed.  Accepted
    keyword: ``preserve_rng_state``; ``use_reentrant`` is ignored.
    """
    preserve = kwargs.pop("preserve_rng_state", True)
    if kwargs:
        raise ValueError("Unexpected keyword arguments: " + ",".join(arg for arg in kwargs))
    if torch.compiler.is_compiling():
        return _tc.checkpoint_sequential(
            functions, segments, input, use_reentrant=False, preserve_rng_state=preserve
        )
    return sequential_segments(functions, segments, input, policy=None, preserve_rng_state=preserve)



# ---------------------------------------------------------------------------
# Hugging Face transformers
# ---------------------------------------------------------------------------

_SETTER = "_set_gradient_checkpointing"  # transformers' one switch, which every public one calls


class _HFRemat:
    """The checkpoint function :func:`enable_hf_remat` gives a model's layers:
    transformers calls it as ``fn(layer_forward, *args)``."""

    __slots__ = ("policy", "preserve_rng_state", "debug")

    def __init__(self, policy, preserve_rng_state: bool, debug: bool):
        self.policy = policy
        self.preserve_rng_state = preserve_rng_state
        self.debug = debug

    def __call__(self, function, *args, **kwargs):
        debug = checkpoint_flag("_checkpoint_debug_enabled")
        debug = self.debug if debug is None else debug
        if checkpoint_flag("_enable_checkpoint_early_stop") is False:
            with _early_stop(False):
                return call_once(function, args, kwargs, policy=self.policy,
                                 preserve_rng_state=self.preserve_rng_state, debug=bool(debug))
        return call_once(function, args, kwargs, policy=self.policy,
                         preserve_rng_state=self.preserve_rng_state, debug=bool(debug))

    def __repr__(self) -> str:
        return f"remat_fn.compat.enable_hf_remat(policy={self.policy!r})"


class _KeepRemat:
    """Set on the model as ``_set_gradient_checkpointing`` by :func:`enable_hf_remat`:
    transformers' own switch (``gradient_checkpointing_enable``,
    ``activation_checkpointing_enable``, the Trainer's ``gradient_checkpointing=True``
    at ``train()``) keeps remat_fn's function, its ``every_n_layers`` honoured, until
    :func:`disable_hf_remat`.  (transformers supports wrappers set on the instance.)"""

    def __init__(self, model, fn: _HFRemat):
        self.model = model
        self.fn = fn

    def __call__(self, enable: bool = True, gradient_checkpointing_func=None, **kwargs):
        setter = getattr(type(self.model), _SETTER)
        if not enable:
            if gradient_checkpointing_func is not None:
                kwargs["gradient_checkpointing_func"] = gradient_checkpointing_func
            return setter(self.model, enable=False, **kwargs)
        _warn_replaced(gradient_checkpointing_func)
        return setter(self.model, enable=True, gradient_checkpointing_func=self.fn, **kwargs)


def _warn_replaced(fn) -> None:
    """transformers' switch passed a checkpoint function: torch's, with arguments that
    change nothing here, is replaced silently; anything else with a warning."""
    if fn is None or isinstance(fn, _HFRemat):
        return
    if fn is _tc.checkpoint or (isinstance(fn, functools.partial) and fn.func is _tc.checkpoint
                                and not fn.args and set(fn.keywords) <= {"use_reentrant"}):
        return
    warnings.warn(
        f"remat_fn.compat.enable_hf_remat is on: the checkpoint function {fn!r} that transformers was "
        "given (gradient_checkpointing_kwargs, offload=True, or a function of your own) is replaced by "
        "remat_fn's. Fix: pass what it should do to enable_hf_remat (policy=..., e.g. "
        "remat_fn.policies.offload_inputs() for offloading), or call "
        "remat_fn.compat.disable_hf_remat(model) first to use transformers' own.",
        stacklevel=4,
    )


def _hf_model(model):
    """The transformers ``PreTrainedModel`` in ``model`` (itself, or the first submodule
    that is one: a PEFT wrapper's base model), checked for what the switch needs."""
    found = None
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    for m in modules:
        if callable(getattr(type(m), _SETTER, None)) and hasattr(type(m), "supports_gradient_checkpointing"):
            found = m
            break
    if found is None:
        raise TypeError(
            f"enable_hf_remat expects a Hugging Face transformers model (a PreTrainedModel), got "
            f"{type(model).__name__}. Fix: for other models use "
            "remat_fn.nn.apply_remat(model, check_fn, policy=...)."
        )
    if not found.supports_gradient_checkpointing:
        raise ValueError(
            f"{type(found).__name__} does not support gradient checkpointing in transformers (its layers "
            "take no checkpoint function). Fix: remat_fn.nn.apply_remat(model, lambda m: isinstance(m, "
            "<its block class>), policy=...) rematerialises its blocks in place."
        )
    if "value" in inspect.signature(getattr(type(found), _SETTER)).parameters:
        raise TypeError(
            f"{type(found).__name__} uses transformers' checkpointing format from before 4.35, whose layers "
            "call torch.utils.checkpoint themselves. Fix: upgrade transformers, or use "
            "remat_fn.nn.apply_remat(model, check_fn, policy=...)."
        )
    return found


def enable_hf_remat(model, policy: Any = None, *, every_n_layers: int | None = None,
                    preserve_rng_state: bool = True, debug: bool = False):
    """Rematerialise the layers of a Hugging Face ``transformers`` model with remat_fn.

    The public form of ``model._set_gradient_checkpointing(True,
    gradient_checkpointing_func=remat_fn.compat.checkpoint)``, with a ``policy``
    (any :func:`remat_fn.remat` policy: ``dots_saveable``, ``memory_budget(0.5)``,
    ``offload_inputs()``, ...).  Every layer transformers checkpoints calls
    remat_fn, so the model trains as before in eager mode and also under
    ``torch.func`` (``functional_call`` + ``grad``, ``vmap(grad)``), where torch's
    checkpoint raises.  As with transformers' own switch, layers are
    rematerialised in training mode (``model.train()``).

    * It may follow transformers' own ``gradient_checkpointing_enable()`` (or
      ``activation_checkpointing_enable()``): it replaces the function those gave
      the layers.  The hook they install on the input embeddings
      (``enable_input_require_grads``, which makes the embeddings' output
      require grad for torch's reentrant checkpoint and fails under
      ``torch.func`` with functorch's ``requires_grad_()`` error) is removed:
      remat_fn gives the parameters inside each layer their gradients without it.
    * It may precede them: until :func:`disable_hf_remat`, transformers' switch
      (``gradient_checkpointing_enable()``, the ``Trainer``'s
      ``gradient_checkpointing=True``, which calls it in ``train()``) keeps
      remat_fn's function; their ``every_n_layers`` is honoured, any other
      checkpoint function they pass is replaced with a warning.  If that switch
      puts the embedding hook back (transformers 5 does), eager training is
      unaffected; call ``enable_hf_remat`` again before ``torch.func`` use.

    ``every_n_layers``: rematerialise every n-th layer (transformers 5); ``None``
    keeps the layers transformers' own switch chose if it is on, else all.
    ``preserve_rng_state`` and ``debug`` are :func:`remat_fn.remat`'s.  Works on a
    module that wraps the model (a PEFT model, say): the first transformers model
    inside it is switched.  Returns ``model``.  (``tests/test_hf.py`` runs this on
    GPT-2, Llama and BERT.)  For example::

        model = transformers.GPT2LMHeadModel(config).train()
        model.gradient_checkpointing_enable()       # transformers' own (optional)
        remat_fn.compat.enable_hf_remat(model, policy=remat_fn.policies.dots_saveable)
        params = {k: v.detach() for k, v in model.named_parameters()}
        loss = lambda p: torch.func.functional_call(model, p, (ids,), {"labels": ids}).loss
        g = torch.func.grad(loss)(params)           # torch's checkpoint raises here
        remat_fn.compat.disable_hf_remat(model)     # no checkpointing again
    """
    hf = _hf_model(model)
    if every_n_layers is not None and (isinstance(every_n_layers, bool) or not isinstance(every_n_layers, int)
                                       or every_n_layers < 1):
        raise ValueError(f"every_n_layers must be a positive int or None, got {every_n_layers!r}")
    setter = getattr(type(hf), _SETTER)
    kwargs = {}
    if every_n_layers not in (None, 1):
        if "every_n_layers" not in inspect.signature(setter).parameters:
            raise TypeError(
                f"every_n_layers={every_n_layers}: this transformers version checkpoints every layer. "
                "Fix: upgrade transformers (5.x), or pass every_n_layers=None."
            )
        kwargs["every_n_layers"] = every_n_layers
    normalize_policy(policy)  # (an invalid policy fails here, not at the first step)
    fn = _HFRemat(policy, preserve_rng_state, debug)
    flagged = [m for m in hf.modules() if hasattr(m, "gradient_checkpointing")]
    if every_n_layers is None and any(m.gradient_checkpointing for m in flagged):
        for m in flagged:  # the layers transformers' own switch chose
            m._gradient_checkpointing_func = fn
    else:
        setter(hf, enable=True, gradient_checkpointing_func=fn, **kwargs)
    setattr(hf, _SETTER, _KeepRemat(hf, fn))
    for m in hf.modules():  # transformers' enable_input_require_grads hooks
        if getattr(m, "_require_grads_hooks", None) or getattr(m, "_require_grads_hook", None) is not None:
            m.disable_input_require_grads()
    return model


def disable_hf_remat(model):
    """Undo :func:`enable_hf_remat`: no checkpointing at all (transformers'
    ``gradient_checkpointing_disable()``), and transformers' own switch gives the
    layers torch's checkpoint again.  Returns ``model``."""
    hf = _hf_model(model)
    if isinstance(hf.__dict__.get(_SETTER), _KeepRemat):
        del hf.__dict__[_SETTER]
    getattr(type(hf), _SETTER)(hf, enable=False)
    return model
