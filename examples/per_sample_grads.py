"""Per-sample gradients with activation checkpointing: ``vmap(grad(...))`` over a remat'd model.

``torch.utils.checkpoint`` cannot run under ``torch.func.grad`` (saved tensor
hooks are refused there); ``remat_fn.remat`` can.  This script computes the
gradient of every example's loss separately -- the building block of DP-SGD
(clip each example's gradient, then average) -- with every block rematerialised,
checks it against a Python loop, and prints the peak live tensor bytes with and
without remat.

Run: python examples/per_sample_grads.py [--small]
"""

import argparse
import os

import torch
from torch.func import functional_call, grad, vmap

import remat_fn
from remat_fn.memory import LiveBytes, MiB


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln(x))))


class Net(torch.nn.Module):
    def __init__(self, d, depth, classes=10):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(depth))
        self.head = torch.nn.Linear(d, classes)
        self.use_remat = True

    def forward(self, x):  # x: (tokens, d) for one example
        for b in self.blocks:
            x = remat_fn.remat(b)(x) if self.use_remat else b(x)
        return self.head(x.mean(0))


def main(small: bool = False):
    d, depth, batch, tokens = (32, 2, 4, 8) if small else (128, 6, 32, 64)
    torch.manual_seed(0)
    net = Net(d, depth)
    params = {k: v.detach() for k, v in net.named_parameters()}
    x = torch.randn(batch, tokens, d)
    y = torch.randint(0, 10, (batch,))

    def loss(p, xi, yi):  # the loss of ONE example
        logits = functional_call(net, p, (xi,))
        return torch.nn.functional.cross_entropy(logits[None], yi[None])

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))
    for use in (False, True):
        net.use_remat = use
        with LiveBytes() as m:
            g = per_sample(params, x, y)
        print(f"remat={use!s:5}  per-sample grads: {len(g)} tensors with leading dim "
              f"{next(iter(g.values())).shape[0]}; peak live bytes {m.peak / MiB:.1f} MiB")

    # Check against a loop over examples, and clip-and-average as DP-SGD does.
    for i in range(min(batch, 3)):
        gi = grad(loss)(params, x[i], y[i])
        for k in params:
            torch.testing.assert_close(g[k][i], gi[k], rtol=1e-4, atol=1e-5)
    norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in g.values()))
    scale = (1.0 / norms).clamp(max=1.0)  # clip each example's gradient to norm 1
    clipped = {k: (v * scale.view(-1, *[1] * (v.ndim - 1))).mean(0) for k, v in g.items()}
    print(f"per-example gradient norms: {[round(n, 3) for n in norms[:4].tolist()]} ...; "
          f"clipped mean has {sum(v.numel() for v in clipped.values())} entries; matches a loop: OK")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny sizes (smoke test)")
    main(ap.parse_args().small or os.environ.get("REMAT_FN_EXAMPLES_SMALL") == "1")
