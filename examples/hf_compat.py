"""Hugging Face ``transformers`` gradient checkpointing with remat_fn: ``enable_hf_remat``.

One call switches a model's checkpointing to remat_fn, with any policy, before
or after transformers' own ``gradient_checkpointing_enable()``::

    remat_fn.compat.enable_hf_remat(model, policy=remat_fn.policies.dots_saveable)

Eager training behaves as before; in addition the model now trains and
differentiates under ``torch.func`` (``functional_call`` + ``grad``), where
torch's checkpoint raises (and where the input-embedding hook transformers'
switch installs fails: ``enable_hf_remat`` removes it).  A tiny GPT-2 is built
from a config: no download.

Run: python examples/hf_compat.py [--small]    (needs: pip install transformers)
"""

import argparse
import copy
import os
import warnings

import torch
from torch.func import functional_call, grad

import remat_fn
from remat_fn.compat import enable_hf_remat
from remat_fn.memory import LiveBytes, MiB


def hf_switch(model):
    """transformers' own switch (renamed activation_checkpointing_enable in transformers 5)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()


def main(small: bool = False):
    try:
        import transformers
    except ImportError:
        print("transformers is not installed (pip install 'remat-fn[hf]'); nothing to do")
        return
    transformers.logging.set_verbosity_error()
    layers, d, seq = (2, 32, 16) if small else (6, 256, 256)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=d, n_head=4, vocab_size=128, n_positions=seq,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0, use_cache=False)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 128, (4, seq))
    params = {k: v.detach() for k, v in base.named_parameters()}

    def plain(model):
        pass

    def remat_full(model):
        hf_switch(model)  # transformers' own switch first (as a Trainer would), then ours
        enable_hf_remat(model)

    def remat_dots(model):
        enable_hf_remat(model, policy=remat_fn.policies.dots_saveable)

    for setup, name in ((plain, "no checkpointing"),
                        (hf_switch, "transformers' switch"),
                        (remat_full, "enable_hf_remat"),
                        (remat_dots, "enable_hf_remat(dots)")):
        model = copy.deepcopy(base)
        setup(model)
        with LiveBytes() as m:
            out = model(ids, labels=ids)
            after = m.live
            out.loss.backward()
        eager = f"eager: loss {out.loss.item():.4f}, live after forward {after / MiB:5.1f} MiB"

        def loss(p):
            return functional_call(model, p, (ids,), {"labels": ids}).loss

        try:
            with LiveBytes() as m:
                g = grad(loss)(params)
            norm = torch.sqrt(sum(v.pow(2).sum() for v in g.values()))
            func = f"torch.func.grad: peak {m.peak / MiB:5.1f} MiB, |g| {norm:.4f}"
        except RuntimeError as e:
            func = "torch.func.grad fails (" + str(e).splitlines()[0][:60] + "...)"
        print(f"{name:22s} {eager}; {func}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny sizes (smoke test)")
    main(ap.parse_args().small or os.environ.get("REMAT_FN_EXAMPLES_SMALL") == "1")
