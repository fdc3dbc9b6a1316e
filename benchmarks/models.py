"""Models shared by the benchmark sections.

- :class:`MLPStack`: a stack of pre-LN MLP blocks whose blocks are called
  through a ``wrap`` chosen per measurement (see :func:`harness.variants`).
- :func:`tiny_region`: the region the per-call overhead is measured on.
- :func:`gpt2`: Hugging Face GPT-2 from a config (needs ``transformers``).
- The demo's GPT (``harness.demo_module().GPT``) is the suite's small transformer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class MLPBlock(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(x))))


class MLPStack(nn.Module):
    """``depth`` MLP blocks and a mean-square loss; :meth:`wrap_blocks` chooses how
    each block is called (plain, ``torch.utils.checkpoint``, ``remat``...)."""

    def __init__(self, d: int, hidden: int, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(d, hidden) for _ in range(depth))
        self.calls: list[Callable] = list(self.blocks)

    def wrap_blocks(self, wrap: Callable[[nn.Module], Callable]) -> MLPStack:
        self.calls = [wrap(b) for b in self.blocks]
        return self

    def forward(self, x):
        for call in self.calls:
            x = call(x)
        return x.pow(2).mean()


def tiny_region(seed: int = 0):
    """Two 64x64 matmuls and a tanh, with its three 64x64 arguments."""
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(64, 64, generator=g) / 8, torch.randn(64, 64, generator=g) / 8
    x = torch.randn(64, 64, generator=g)

    def f(x, w1, w2):
        return torch.tanh(x @ w1) @ w2

    return f, (x, w1, w2)


def gpt2(n_layer: int = 6, n_embd: int = 256, n_head: int = 8, n_positions: int = 256, vocab: int = 512):
    """Hugging Face GPT-2 (LM head) built from a config, dropout off, in training mode."""
    import transformers

    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=n_positions,
                                  vocab_size=vocab, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.train()
    return model
