"""Hessian-vector products through rematerialised layers.

``hvp(f, x, v) = jvp(grad(f), x, v)`` (forward-over-reverse) is the cheap way
to get curvature information: Newton-CG, Lanczos estimates of the top Hessian
eigenvalue, sharpness measures, influence functions.  It differentiates a
gradient, so every layer's activations are needed twice over; with
``remat_fn.remat`` they are recomputed instead of kept, under ``jvp`` of
``grad`` -- where ``torch.utils.checkpoint`` cannot run at all.

The script checks the HVP against ``torch.func.hessian`` on a small problem,
then estimates the top Hessian eigenvalue of an MLP's loss by power iteration.

Run: python examples/hvp.py [--small]
"""

import argparse
import os

import torch
from torch.func import functional_call, grad, hessian, jvp

import remat_fn


class MLP(torch.nn.Module):
    def __init__(self, d, depth):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(depth))
        self.head = torch.nn.Linear(d, 1)
        self.use_remat = True

    def forward(self, x):
        for layer in self.layers:
            f = lambda h, layer=layer: h + torch.tanh(layer(h))  # noqa: E731
            x = remat_fn.remat(f)(x) if self.use_remat else f(x)
        return self.head(x)


def hvp(f, params, v):
    """Hessian of ``f`` at ``params`` times ``v`` (both dicts of tensors)."""
    return jvp(grad(f), (params,), (v,))[1]


def main(small: bool = False):
    d, depth, n, iters = (8, 2, 16, 5) if small else (64, 6, 512, 30)
    torch.manual_seed(0)
    net = MLP(d, depth)
    params = {k: v.detach() for k, v in net.named_parameters()}
    x, y = torch.randn(n, d), torch.randn(n, 1)

    def loss(p):
        return (functional_call(net, p, (x,)) - y).pow(2).mean()

    # 1. exactness on one parameter: compare with the full Hessian of the head weight
    key = "head.weight"
    v = {k: torch.zeros_like(t) for k, t in params.items()}
    v[key] = torch.randn_like(params[key])
    hv = hvp(loss, params, v)[key]
    only = lambda w: loss({**params, key: w})  # noqa: E731
    H = hessian(only)(params[key]).reshape(params[key].numel(), -1)
    torch.testing.assert_close(hv.flatten(), H @ v[key].flatten(), rtol=1e-4, atol=1e-6)
    net.use_remat = False
    torch.testing.assert_close(hvp(loss, params, v)[key], hv, rtol=1e-5, atol=1e-7)
    net.use_remat = True
    print(f"HVP through remat matches torch.func.hessian ({H.shape[0]}x{H.shape[1]}) and the plain model: OK")

    # 2. top eigenvalue of the full Hessian by power iteration
    v = {k: torch.randn_like(t) for k, t in params.items()}
    lam = 0.0
    for _ in range(iters):
        norm = torch.sqrt(sum(t.pow(2).sum() for t in v.values()))
        v = {k: t / norm for k, t in v.items()}
        hv = hvp(loss, params, v)
        lam = sum((hv[k] * v[k]).sum() for k in v).item()
        v = hv
    print(f"top Hessian eigenvalue of the loss (power iteration, {iters} HVPs): {lam:.4f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny sizes (smoke test)")
    main(ap.parse_args().small or os.environ.get("REMAT_FN_EXAMPLES_SMALL") == "1")
