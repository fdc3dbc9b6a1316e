"""Quickstart: rematerialise the blocks of an MLP and take gradients with torch.func.

Run: python examples/quickstart.py
"""

import torch
from torch.func import functional_call, grad, vmap

import remat_fn
from remat_fn.memory import LiveBytes, MiB


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self, d=128, depth=6, use_remat=True):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(depth))
        self.use_remat = use_remat

    def forward(self, x):
        for b in self.blocks:
            x = remat_fn.remat(b)(x) if self.use_remat else b(x)
        return x.pow(2).mean()


def main():
    torch.manual_seed(0)
    net = Net()
    params = {k: v.detach() for k, v in net.named_parameters()}
    x = torch.randn(512, 128)
    loss = lambda p, x: functional_call(net, p, (x,))
    for use in (False, True):
        net.use_remat = use
        with LiveBytes() as m:
            g = grad(loss)(params, x)
        with LiveBytes() as mv:
            vmap(grad(loss), in_dims=(None, 0))(params, x.reshape(8, 64, 128))
        print(f"remat={use!s:5}  grad peak {m.peak / MiB:6.1f} MiB   "
              f"per-sample vmap(grad) peak {mv.peak / MiB:6.1f} MiB   "
              f"|g| = {sum(v.norm() ** 2 for v in g.values()).sqrt():.6f}")


if __name__ == "__main__":
    main()
