"""remat under torch.compile: gradients match, and the policy decides what the compiled
backward recomputes (counted aten.mm nodes in the backward graph).

Every compile runs in a fresh subprocess: a failed compile of a checkpointed function
leaves saved-tensor hooks disabled for the rest of the process (see NOTES.md), and a
subprocess also keeps Dynamo caches out of the rest of the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

PRELUDE = textwrap.dedent(
    """
    import json, torch, remat_fn
    torch.set_num_threads(1)
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from functorch.compile import make_boxed_func

    def counting_backend(counts):
        def count(key):
            def compiler(gm, example_inputs):
                counts[key] = sum(n.target is torch.ops.aten.mm.default for n in gm.graph.nodes)
                return make_boxed_func(gm.forward)
            return compiler
        def backend(gm, example_inputs):
            return aot_module_simplified(gm, example_inputs, fw_compiler=count("fw"),
                                         bw_compiler=count("bw"),
                                         partition_fn=min_cut_rematerialization_partition)
        return backend

    torch.manual_seed(0)
    w1 = torch.randn(8, 8, requires_grad=True)
    w2 = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def block(x):
        return torch.relu(torch.relu(x @ w1) @ w2).sin()

    def save_mm(ctx, op, *args, **kwargs):
        return op is torch.ops.aten.mm.default

    ref = torch.autograd.grad(block(x).sum(), (x, w1, w2))
    def close(g):
        return all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(g, ref))
    """
)


def _run(body: str) -> dict:
    code = PRELUDE + textwrap.dedent(body)
    env = dict(os.environ, PYTHONWARNINGS="ignore", TORCHINDUCTOR_COMPILE_THREADS="1")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_compile_mm_counts_follow_policy_and_backends_match():
    res = _run(
        """
        out = {}
        for name, f in [("plain", block), ("remat", remat_fn.remat(block))]:
            c = {}
            torch._dynamo.reset()
            g = torch.compile(lambda x: f(x).sum(), backend=counting_backend(c), fullgraph=True)
            out[name] = dict(c, ok=close(torch.autograd.grad(g(x), (x, w1, w2))))
            out[name].update(c)
        # policy: save mm outputs (the policy that remat(policy=...) hands to torch's SAC)
        c = {}
        torch._dynamo.reset()
        rb = remat_fn.remat(block, policy=save_mm)
        g = torch.compile(lambda x: rb(x).sum(),
                          backend=counting_backend(c), fullgraph=True)
        out["save_mm"] = dict(ok=close(torch.autograd.grad(g(x), (x, w1, w2))), **c)
        for be in ["aot_eager", "inductor"]:
            torch._dynamo.reset()
            g = torch.compile(lambda x: remat_fn.remat(block)(x).sum(), backend=be)
            out[be] = close(torch.autograd.grad(g(x), (x, w1, w2)))
        print(json.dumps(out))
        """
    )
    print("compiled mm counts:", res)
    assert res["plain"] == {"fw": 2, "bw": 4, "ok": True}
    assert res["remat"] == {"fw": 2, "bw": 6, "ok": True}  # the 2 forward mm's are recomputed
    assert res["save_mm"] == {"fw": 2, "bw": 4, "ok": True}  # saved: nothing recomputed
    assert res["aot_eager"] and res["inductor"]


def test_compile_policy_through_remat_and_compat():
    res = _run(
        """
        import functools
        from torch.utils.checkpoint import create_selective_checkpoint_contexts
        from remat_fn.compat import checkpoint
        out = {}
        f = remat_fn.remat(block, policy=save_mm)
        c = {}
        torch._dynamo.reset()
        g = torch.compile(lambda x: f(x).sum(), backend=counting_backend(c))
        out["remat_policy"] = dict(ok=close(torch.autograd.grad(g(x), (x, w1, w2))), **c)
        c = {}
        torch._dynamo.reset()
        cf = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
        g = torch.compile(lambda x: checkpoint(block, x, use_reentrant=False, context_fn=cf).sum(),
                          backend=counting_backend(c))
        out["compat_sac"] = dict(ok=close(torch.autograd.grad(g(x), (x, w1, w2))), **c)
        print(json.dumps(out))
        """
    )
    print("compiled mm counts:", res)
    assert res["compat_sac"] == {"fw": 2, "bw": 4, "ok": True}
    assert res["remat_policy"] == {"fw": 2, "bw": 4, "ok": True}


def test_compile_compat_checkpoint_as_torch_is_called():
    # a hostile pass: compat.checkpoint under torch.compile raised Dynamo's "checkpoint not implemented
    # for ... context_fn" in every form but a selective-checkpoint partial (it handed torch's operator
    # torch's own no-op context_fn, which Dynamo refuses where given explicitly: torch's checkpoint
    # called so raises it too); kwargs, dict outputs and checkpoint_sequential likewise
    res = _run(
        """
        from remat_fn.compat import checkpoint, checkpoint_sequential
        from torch.utils.checkpoint import noop_context_fn
        out = {}
        forms = {"default": {}, "reentrant": {"use_reentrant": True}, "non_reentrant": {"use_reentrant": False},
                 "noop_context_fn": {"use_reentrant": False, "context_fn": noop_context_fn}}
        c = {}
        torch._dynamo.reset()
        g = torch.compile(lambda x: torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum(),
                          backend=counting_backend(c))
        out["torch"] = dict(ok=close(torch.autograd.grad(g(x), (x, w1, w2))), **c)
        for name, kw in forms.items():
            c = {}
            torch._dynamo.reset()
            g = torch.compile(lambda x: checkpoint(block, x, **kw).sum(), backend=counting_backend(c))
            out[name] = dict(ok=close(torch.autograd.grad(g(x), (x, w1, w2))), **c)
        torch._dynamo.reset()
        h = lambda x, scale: {"y": block(x) * scale, "n": 3}
        g = torch.compile(lambda x: checkpoint(h, x, scale=2.0, use_reentrant=False)["y"].sum() / 2, backend="aot_eager")
        out["kwargs_dict"] = close(torch.autograd.grad(g(x), (x, w1, w2)))
        torch._dynamo.reset()
        seq = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh())
        want = torch.autograd.grad(seq(x).sum(), [x, *seq.parameters()])
        g = torch.compile(lambda x: checkpoint_sequential(seq, 2, x, use_reentrant=False).sum(), backend="aot_eager")
        got = torch.autograd.grad(g(x), [x, *seq.parameters()])
        out["sequential"] = all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(got, want))
        print(json.dumps(out))
        """
    )
    print("compat.checkpoint under torch.compile:", res)
    assert res["torch"] == {"fw": 2, "bw": 6, "ok": True}  # (both mm again, then the four of their backward)
    for name in ("default", "reentrant", "non_reentrant", "noop_context_fn"):
        assert res[name] == res["torch"], (name, res[name])
    assert res["kwargs_dict"] and res["sequential"]


def test_compile_checkpoint_name_inside_a_region():
    # a hostile pass: checkpoint_name inside a region under torch.compile broke the graph inside torch's
    # checkpoint operator (its weak dictionary of names), and with an op-saving policy the eager fallback
    # raised "Tensor cached during selective activation checkpoint has been mutated"; under compile the
    # operator sees ops, not names: checkpoint_name is the identity there
    res = _run(
        """
        from remat_fn import checkpoint_name
        from remat_fn.policies import dots_saveable, save_only_these_names
        f = lambda x: torch.relu(checkpoint_name(x @ w1, "h") @ w2).sin()
        out = {}
        for name, pol in (("dots", dots_saveable), ("names", save_only_these_names("h")), ("none", None)):
            torch._dynamo.reset()
            g = torch.compile(lambda x: remat_fn.remat(f, policy=pol)(x).sum(), backend="aot_eager", fullgraph=True)
            want = torch.autograd.grad(f(x).sum(), (x, w1, w2))
            got = torch.autograd.grad(g(x), (x, w1, w2))
            out[name] = all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(got, want))
        print(json.dumps(out))
        """
    )
    assert res == {"dots": True, "names": True, "none": True}, res


def test_compile_fullgraph_over_remat_module_with_a_policy():
    # issue 31: torch.compile(model, fullgraph=True) over remat_module(..., policy=...)
    # broke the graph on a torch.compiler.disable'd helper; the policy still decides
    # what the compiled backward recomputes (one op alone means a list of one)
    res = _run(
        """
        import remat_fn.nn
        out = {}

        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w1 = torch.nn.Parameter(w1.detach().clone())
                self.w2 = torch.nn.Parameter(w2.detach().clone())

            def forward(self, x):
                return torch.relu(torch.relu(x @ self.w1) @ self.w2).sin()

        P = remat_fn.policies
        for name, pol in [("none", None), ("dots", P.dots_saveable), ("fn", save_mm),
                          ("list", [torch.ops.aten.mm.default]), ("one", torch.ops.aten.mm.default),
                          ("packet", torch.ops.aten.mm)]:
            m = remat_fn.nn.remat_module(Block(), policy=pol)
            c = {}
            torch._dynamo.reset()
            g = torch.compile(m, backend=counting_backend(c), fullgraph=True)
            out[name] = dict(ok=close(torch.autograd.grad(g(x).sum(), (x, m.w1, m.w2))), **c)
        print(json.dumps(out))
        """
    )
    print("compiled mm counts:", res)
    assert res.pop("none") == {"fw": 2, "bw": 6, "ok": True}  # the 2 forward mm's are recomputed
    for name, counts in res.items():
        assert counts == {"fw": 2, "bw": 4, "ok": True}, (name, res)  # saved: nothing recomputed


def test_compile_composes_with_torch_func():
    res = _run(
        """
        f = remat_fn.remat(block)
        xd = x.detach()
        ref_g = torch.func.grad(lambda x: block(x).sum())(xd)
        out = {}
        torch._dynamo.reset()
        out["compile(grad)"] = torch.allclose(
            torch.compile(torch.func.grad(lambda x: f(x).sum()), backend="aot_eager")(xd), ref_g, atol=1e-6)
        torch._dynamo.reset()
        out["grad(compile)"] = torch.allclose(
            torch.func.grad(torch.compile(lambda x: f(x).sum(), backend="aot_eager"))(xd), ref_g, atol=1e-6)
        # saved-tensor hooks still work afterwards (nothing failed and disabled them)
        y = x.detach().requires_grad_()
        out["eager_after"] = torch.allclose(torch.autograd.grad(f(y).sum(), y)[0], ref_g, atol=1e-6)
        print(json.dumps(out))
        """
    )
    assert res == {"compile(grad)": True, "grad(compile)": True, "eager_after": True}, res


def test_compiled_function_called_inside_an_eager_region():
    # torch runs compiled code eagerly under a (non-infra) dispatch mode, which the
    # region's recording is; the mode's own frames must never be traced by Dynamo
    # (torch's wrapper around __torch_dispatch__ switches it off: a faster dispatch
    # that skipped that wrapper made Dynamo compile the mode's frames, 3 of them)
    res = _run(
        """
        from torch._dynamo.utils import counters
        out = {}
        for be in ["eager", "aot_eager"]:
            for wrap in (False, True):
                torch._dynamo.reset()
                counters.clear()
                calls = [0]
                inner = torch.compile(lambda h: torch.relu(h @ w2), backend=be)

                def f(x):
                    calls[0] += 1
                    return inner(torch.relu(x @ w1)).sin()

                g = remat_fn.remat(f) if wrap else f
                ok = close(torch.autograd.grad(g(x).sum(), (x, w1, w2)))
                out[f"{be}-{wrap}"] = [ok, calls[0], counters["frames"]["total"]]
        print(json.dumps(out))
        """
    )
    for be in ("eager", "aot_eager"):
        assert res[f"{be}-False"] == [True, 1, 1], res  # plain: the lambda is compiled
        assert res[f"{be}-True"] == [True, 1, 0], res  # exact, the function ran once, nothing traced
