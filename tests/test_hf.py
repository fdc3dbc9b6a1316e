"""Hugging Face transformers with remat_fn.compat.checkpoint as the gradient-checkpointing
function: tiny GPT-2 and BERT built from configs (no downloads)."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from torch.func import functional_call, grad, vjp

import remat_fn.compat
from remat_fn.memory import LiveBytes

from ._util import assert_tree_close

transformers = pytest.importorskip("transformers")


def gpt2(dropout=0.0, n_layer=2, n_embd=32):
    cfg = transformers.GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=64, n_positions=32,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def bert(dropout=0.0):
    cfg = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=64, max_position_embeddings=32, hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(cfg)


class Counting:
    """remat_fn.compat.checkpoint, counting calls (to prove the model used it)."""

    def __init__(self, fn=remat_fn.compat.checkpoint):
        self.fn = fn
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def enable(model, fn):
    model._set_gradient_checkpointing(True, gradient_checkpointing_func=fn)
    return model


def _inputs(kind):
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (2, 12))
    if kind == "gpt2":
        return dict(input_ids=ids, labels=ids)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)


MODELS = {"gpt2": gpt2, "bert": bert}


def _eager_grads(model, inputs, seed):
    torch.manual_seed(seed)
    loss = model(**inputs).loss
    return loss.detach(), torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad],
                                              allow_unused=True)


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_eager_grads_equal_no_checkpointing(kind, dropout):
    # transformers only checkpoints in training mode; dropout=0.0 is the deterministic case
    ref = MODELS[kind](dropout).train()
    model = copy.deepcopy(ref)
    ck = Counting()
    enable(model, ck)
    inputs = _inputs(kind)
    l0, g0 = _eager_grads(ref, inputs, seed=5)
    l1, g1 = _eager_grads(model, inputs, seed=5)
    assert ck.calls == 2  # one per layer
    torch.testing.assert_close(l1, l0)
    assert_tree_close(g1, g0, rtol=1e-5, atol=1e-6)


def test_gradient_checkpointing_enable_kwargs():
    model = gpt2().train()
    # transformers 5 renamed gradient_checkpointing_enable (deprecated alias kept until v6)
    enable_fn = getattr(model, "activation_checkpointing_enable", None)
    if enable_fn is not None:
        enable_fn(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    # swap our function in afterwards (what the kwargs route cannot express)
    ck = Counting()
    enable(model, ck)
    model(**_inputs("gpt2")).loss.backward()
    assert ck.calls == 2


def _func_loss(model, params, inputs, seed):
    torch.manual_seed(seed)
    return functional_call(model, params, (), inputs).loss


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_functional_call_grad(kind, dropout):
    ref = MODELS[kind](dropout).train()
    model = copy.deepcopy(ref)
    ck = Counting()
    enable(model, ck)
    inputs = _inputs(kind)
    params = {k: v.detach() for k, v in ref.named_parameters()}
    g0 = grad(lambda p: _func_loss(ref, p, inputs, 9))(params)
    g1 = grad(lambda p: _func_loss(model, p, inputs, 9))(params)
    assert ck.calls == 2
    assert_tree_close(g1, g0, rtol=1e-5, atol=1e-6)


def test_torch_checkpoint_fails_under_func_grad():
    torch_ck = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    model = enable(gpt2().train(), torch_ck)
    params = {k: v.detach() for k, v in model.named_parameters()}
    with pytest.raises(RuntimeError, match="saved tensor hooks"):
        grad(lambda p: _func_loss(model, p, _inputs("gpt2"), 0))(params)


def test_gpt2_memory_under_vjp():
    ref = gpt2(n_layer=4, n_embd=64).train()
    model = enable(copy.deepcopy(ref), remat_fn.compat.checkpoint)
    params = {k: v.detach() for k, v in ref.named_parameters()}
    torch.manual_seed(2)
    ids = torch.randint(0, 64, (8, 32))
    kept, grads = {}, {}
    for name, m in [("plain", ref), ("remat", model)]:
        with LiveBytes() as meter:
            loss, fn = vjp(lambda p: functional_call(m, p, (), {"input_ids": ids, "labels": ids}).loss, params)
            kept[name] = meter.live
        grads[name] = fn(torch.ones_like(loss))[0]
        del loss, fn
    ratio = kept["remat"] / kept["plain"]
    print(f"GPT-2 (4 layers) under vjp: kept {kept['remat']} B with remat vs {kept['plain']} B, ratio {ratio:.3f}")
    assert ratio < 0.8
    assert_tree_close(grads["remat"], grads["plain"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpt2_training_step_under_cpu_autocast_equals_torch_checkpoint(dtype):
    """A mixed-precision training step (autocast forward, fp32 master weights, AdamW)
    with remat_fn.compat.checkpoint gives bitwise the gradients and updated weights of
    torch's own checkpoint."""
    import torch.utils.checkpoint as tc

    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    results = []
    for fn in (Counting(), Counting(functools.partial(tc.checkpoint, use_reentrant=False))):
        model = enable(gpt2(dropout=0.1), fn)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.manual_seed(7)  # the same dropout masks for both
        for _ in range(2):
            with torch.autocast("cpu", dtype=dtype):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert fn.calls > 0
        results.append([p.detach().clone() for p in model.parameters()])
    assert_tree_close(results[0], results[1], exact=True)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gpt2_step_holds_no_more_than_torch_checkpoint(dropout):
    """Live tensor bytes after the forward and at the backward's peak: remat_fn.compat's
    checkpoint per layer against torch's (the replay frees each value after its last use;
    attention that draws nothing holds nothing)."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    from remat_fn.memory import LiveBytes

    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    found = {}
    for name, fn in (("torch", torch_checkpoint), ("remat", remat_fn.compat.checkpoint)):
        model = enable(gpt2(dropout, n_layer=3, n_embd=64), functools.partial(fn, use_reentrant=False))
        model.train()
        with LiveBytes() as fwd:
            loss = model(input_ids=ids, labels=ids).loss
        after = fwd.live
        with LiveBytes() as bwd:
            loss.backward()
        found[name] = (after, bwd.peak)
    assert found["remat"][0] <= found["torch"][0] * 1.01, found
    assert found["remat"][1] <= found["torch"][1] * 1.01, found


# ---------------------------------------------------------------------------
# remat_fn.compat.enable_hf_remat: the public switch
# ---------------------------------------------------------------------------


def llama(dropout=0.0):
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attention_dropout=dropout,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


HF_MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert}


def _hf_switch(model, **kwargs):
    """transformers' own switch, as a user or the Trainer's gradient_checkpointing=True calls
    it (renamed activation_checkpointing_enable in transformers 5, the old name deprecated)."""
    fn = getattr(model, "activation_checkpointing_enable", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if fn is not None:
            fn(**kwargs)
        else:
            model.gradient_checkpointing_enable(**kwargs)


@pytest.fixture
def hf_calls(monkeypatch):
    """How many times a layer called enable_hf_remat's checkpoint function."""
    calls = []
    orig = remat_fn.compat._HFRemat.__call__

    def counting(self, function, *args, **kwargs):
        calls.append(self)
        return orig(self, function, *args, **kwargs)

    monkeypatch.setattr(remat_fn.compat._HFRemat, "__call__", counting)
    return calls


def _adamw_steps(model, inputs, n=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(n):
        loss = model(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", list(HF_MODELS))
@pytest.mark.parametrize("policy", [None, remat_fn.policies.dots_saveable], ids=["full", "dots_saveable"])
def test_enable_hf_remat_after_transformers_switch(kind, policy, hf_calls):
    """After transformers' own gradient_checkpointing_enable(), whose input-embedding hook
    makes functional_call + grad fail: enable_hf_remat removes the hook and swaps its
    function in; AdamW steps and a torch.func gradient equal the model without
    checkpointing, bitwise (the torch.func gradient of Llama within 1e-6, see below)."""
    ref = HF_MODELS[kind]().train()
    model = copy.deepcopy(ref)
    inputs = _inputs("gpt2" if kind == "llama" else kind)
    params = {k: v.detach() for k, v in ref.named_parameters()}
    _hf_switch(model)
    assert model._require_grads_hooks  # transformers 5 hooks the input embeddings
    with pytest.raises(RuntimeError, match=r"requires_grad_\(\)"):
        grad(lambda p: _func_loss(model, p, inputs, 0))(params)
    assert remat_fn.compat.enable_hf_remat(model, policy=policy) is model
    assert not getattr(model, "_require_grads_hooks", None)
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    assert layers and all(isinstance(m._gradient_checkpointing_func, remat_fn.compat._HFRemat) for m in layers)

    g0 = grad(lambda p: _func_loss(ref, p, inputs, 0))(params)
    g1 = grad(lambda p: _func_loss(model, p, inputs, 0))(params)
    assert len(hf_calls) == 2  # one per layer
    # Llama's SiLU: torch.func.grad of plain code differs from eager autograd by an ulp
    # (functorch decomposes silu_backward); remat's backward computes eager's numbers
    assert_tree_close(g1, g0, exact=kind != "llama", rtol=1e-6, atol=1e-7)
    eager = dict(zip(params, torch.autograd.grad(_func_loss(ref, dict(ref.named_parameters()), inputs, 0),
                                                 list(ref.parameters()))))
    assert_tree_close(g1, eager, exact=True)

    want = _adamw_steps(ref, inputs)
    got = _adamw_steps(model, inputs)
    assert len(hf_calls) == 2 + 3 * 2
    assert_tree_close(got, want, exact=True)


def test_enable_hf_remat_survives_transformers_switch_after_it(hf_calls):
    """enable_hf_remat first, then transformers' switch (what the Trainer's
    gradient_checkpointing=True does in train()): the layers keep remat_fn's function,
    every_n_layers honoured; offload=True (a function remat_fn replaces) warns; after
    disable_hf_remat transformers' switch gives them torch's checkpoint again."""
    model = gpt2(n_layer=4).train()
    remat_fn.compat.enable_hf_remat(model)
    _hf_switch(model, every_n_layers=2)
    blocks = model.transformer.h
    assert [b.gradient_checkpointing for b in blocks] == [True, False, True, False]
    assert all(isinstance(b._gradient_checkpointing_func, remat_fn.compat._HFRemat) for b in blocks)
    model(**_inputs("gpt2")).loss.backward()
    assert len(hf_calls) == 2
    # enable_hf_remat again keeps the layers transformers' switch chose
    remat_fn.compat.enable_hf_remat(model, policy=remat_fn.policies.dots_saveable)
    assert [b.gradient_checkpointing for b in blocks] == [True, False, True, False]
    with pytest.warns(UserWarning, match="replaced by remat_fn's"):
        _hf_switch(model, offload=True)
    assert all(isinstance(b._gradient_checkpointing_func, remat_fn.compat._HFRemat) for b in blocks)

    assert remat_fn.compat.disable_hf_remat(model) is model
    assert not any(b.gradient_checkpointing for b in blocks)
    _hf_switch(model)
    assert all(b.gradient_checkpointing and b._gradient_checkpointing_func.func is torch.utils.checkpoint.checkpoint
               for b in blocks)


def test_enable_hf_remat_copies_and_refuses_what_it_cannot_switch():
    model = remat_fn.compat.enable_hf_remat(gpt2(n_layer=4).train(), every_n_layers=1)
    clone = copy.deepcopy(model)
    _hf_switch(clone, every_n_layers=2)  # the copy's switch sets the copy's layers only
    assert [b.gradient_checkpointing for b in clone.transformer.h] == [True, False, True, False]
    assert all(isinstance(b._gradient_checkpointing_func, remat_fn.compat._HFRemat) for b in clone.transformer.h)
    assert all(b.gradient_checkpointing for b in model.transformer.h)
    wrapper = torch.nn.ModuleDict({"model": gpt2().train()})  # (a PEFT model holds the model so)
    remat_fn.compat.enable_hf_remat(wrapper)
    assert all(isinstance(b._gradient_checkpointing_func, remat_fn.compat._HFRemat)
               for b in wrapper["model"].transformer.h)
    remat_fn.compat.disable_hf_remat(wrapper)
    assert not any(b.gradient_checkpointing for b in wrapper["model"].transformer.h)
    with pytest.raises(TypeError, match="apply_remat"):
        remat_fn.compat.enable_hf_remat(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="every_n_layers"):
        remat_fn.compat.enable_hf_remat(gpt2(), every_n_layers=0)
    with pytest.raises(remat_fn.PolicyError):
        remat_fn.compat.enable_hf_remat(gpt2(), policy="dots_saveable")
