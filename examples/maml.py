"""MAML (model-agnostic meta-learning) with rematerialised inner-loop forwards.

The meta-gradient differentiates *through* the inner SGD steps: a gradient of
a gradient.  ``torch.utils.checkpoint`` cannot run inside ``torch.func.grad``
at all; ``remat_fn.remat`` works at every nesting level, here
``grad(outer_loss)`` around ``grad(inner_loss)`` around remat'd layers.  Tasks are sine-wave regressions
(amplitude and phase per task), the classic MAML toy problem.

Run: python examples/maml.py [--small]
"""

import argparse
import os

import torch
from torch.func import functional_call, grad, vmap

import remat_fn


class Net(torch.nn.Module):
    def __init__(self, hidden, depth):
        super().__init__()
        self.inp = torch.nn.Linear(1, hidden)
        self.hidden = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(depth))
        self.out = torch.nn.Linear(hidden, 1)
        self.use_remat = True

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for layer in self.hidden:
            f = lambda h, layer=layer: torch.tanh(layer(h))  # noqa: E731
            h = remat_fn.remat(f)(h) if self.use_remat else f(h)
        return self.out(h)


def sample_tasks(n_tasks, n_points, gen):
    amp = torch.rand(n_tasks, 1, 1, generator=gen) * 4.5 + 0.5
    phase = torch.rand(n_tasks, 1, 1, generator=gen) * torch.pi
    x = torch.rand(n_tasks, 2 * n_points, 1, generator=gen) * 10 - 5
    y = amp * torch.sin(x + phase)
    return x[:, :n_points], y[:, :n_points], x[:, n_points:], y[:, n_points:]


def main(small: bool = False):
    hidden, depth, tasks, points, steps = (16, 1, 4, 5, 20) if small else (40, 2, 16, 10, 400)
    inner_lr, outer_lr = 0.01, 1e-3
    torch.manual_seed(0)
    net = Net(hidden, depth)
    params = {k: v.detach() for k, v in net.named_parameters()}

    def mse(p, x, y):
        return (functional_call(net, p, (x,)) - y).pow(2).mean()

    def adapted_loss(p, xs, ys, xq, yq):  # one task: one inner SGD step, then the query loss
        g = grad(mse)(p, xs, ys)
        fast = {k: p[k] - inner_lr * g[k] for k in p}
        return mse(fast, xq, yq)

    def meta_loss(p, xs, ys, xq, yq):  # mean over tasks
        # torch.func's MAML recipe: vmap the per-task loss over the tasks
        return vmap(adapted_loss, in_dims=(None, 0, 0, 0, 0))(p, xs, ys, xq, yq).mean()

    meta_grad = grad(meta_loss)
    state = {k: torch.zeros_like(v) for k, v in params.items()}
    gen = torch.Generator().manual_seed(1)
    first = None
    for step in range(steps):
        batch = sample_tasks(tasks, points, gen)
        g = meta_grad(params, *batch)
        for k in params:  # Adam without bias correction would do too; plain momentum SGD here
            state[k] = 0.9 * state[k] + g[k]
            params[k] = params[k] - outer_lr * 10 * state[k]
        if step % max(1, steps // 5) == 0 or step == steps - 1:
            loss = meta_loss(params, *sample_tasks(32, points, torch.Generator().manual_seed(99))).item()
            first = loss if first is None else first
            print(f"meta step {step:4d}: query loss after one inner step {loss:.3f}")

    # second-order check: the meta-gradient through remat equals the one without it
    batch = sample_tasks(2, points, torch.Generator().manual_seed(5))
    g_remat = meta_grad(params, *batch)
    net.use_remat = False
    g_plain = meta_grad(params, *batch)
    for k in params:
        torch.testing.assert_close(g_remat[k], g_plain[k], rtol=1e-4, atol=1e-6)
    print(f"meta-gradient through remat equals the plain one (second order): OK; "
          f"query loss {first:.3f} -> {loss:.3f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny sizes (smoke test)")
    main(ap.parse_args().small or os.environ.get("REMAT_FN_EXAMPLES_SMALL") == "1")
