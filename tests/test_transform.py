"""The public surface of remat: decorator forms, pytrees, statics, modules."""

from __future__ import annotations

import collections
import functools

import pytest
import torch
from torch.func import grad, vmap

import remat_fn
from remat_fn import remat

from ._util import assert_tree_close

Point = collections.namedtuple("Point", "x y")


def f_doc(x):
    """Docstring of f_doc."""
    return x.sin()


def test_decorator_forms_and_metadata():
    a = remat(f_doc)
    b = remat()(f_doc)
    c = remat(preserve_rng_state=False)(f_doc)

    @remat
    def d(x):
        return x.sin()

    @remat(static_argnums=1)
    def e(x, n):
        return x.sin() * n

    x = torch.randn(3)
    for g in (a, b, c):
        assert g.__name__ == "f_doc" and g.__doc__ == "Docstring of f_doc."
        assert g.__wrapped__ is f_doc
        assert torch.equal(g(x), f_doc(x))
    assert torch.equal(d(x), x.sin())
    assert torch.equal(e(x, 3), x.sin() * 3)
    assert remat_fn.checkpoint is remat


def test_pytree_inputs_and_outputs_mixed_leaves():
    def f(tree, scale, *, extra):
        p = tree["p"]
        return {
            "sum": (p.x * p.y).sin() * scale + extra[0],
            "list": [tree["w"].cos(), None, "tag", 3],
            "int": torch.arange(3),
            "pt": Point(p.x.exp(), p.y),
        }

    rf = remat(f)
    tree = {"p": Point(torch.randn(4), torch.randn(4)), "w": torch.randn(2)}
    extra = (torch.randn(4),)
    assert_tree_close(rf(tree, 2.0, extra=extra), f(tree, 2.0, extra=extra), exact=True)

    def loss(fn):
        def loss_(tree, extra):
            out = fn(tree, 2.0, extra=extra)
            return out["sum"].sum() + out["list"][0].sum() + out["pt"].x.sum()
        return loss_

    assert_tree_close(grad(loss(rf), argnums=(0, 1))(tree, extra), grad(loss(f), argnums=(0, 1))(tree, extra))
    # eager
    leaves = [tree["p"].x, tree["p"].y, tree["w"], extra[0]]

    def eager(fn):
        xs = [t.clone().requires_grad_() for t in leaves]
        t2 = {"p": Point(xs[0], xs[1]), "w": xs[2]}
        loss(fn)(t2, (xs[3],)).backward()
        return [x.grad for x in xs]

    assert_tree_close(eager(rf), eager(f))


def test_integer_and_non_tensor_outputs_under_grad():
    def f(x):
        return x.sin().sum(), torch.argmax(x), "label", None

    rf = remat(f)
    x = torch.randn(5)
    def loss(fn):
        def loss_(x):
            s, i, label, none = fn(x)
            assert label == "label" and none is None
            return s, i
        return loss_

    g1, aux1 = grad(loss(f), has_aux=True)(x)
    g2, aux2 = grad(loss(rf), has_aux=True)(x)
    assert aux2.dtype == torch.int64
    assert_tree_close((g1, aux1), (g2, aux2))


def test_output_that_is_an_input():
    def f(x, y):
        return x, y * 2

    rf = remat(f)
    x, y = torch.randn(3), torch.randn(3)
    assert_tree_close(grad(lambda x, y: sum(o.sum() for o in rf(x, y)), argnums=(0, 1))(x, y),
                      (torch.ones(3), torch.full((3,), 2.0)))
    xr = x.clone().requires_grad_()
    out = rf(xr, y)
    out[0].sum().backward()
    assert torch.equal(xr.grad, torch.ones(3))


def test_static_argnums_and_argnames():
    def f(x, n, *, mode):
        for _ in range(n):
            x = x.sin() if mode == "sin" else x.cos()
        return x

    rf = remat(f, static_argnums=(1,), static_argnames=("mode",))
    x = torch.randn(3)
    for mode in ("sin", "cos"):
        assert_tree_close(grad(lambda x: rf(x, 3, mode=mode).sum())(x),
                          grad(lambda x: f(x, 3, mode=mode).sum())(x))
    # negative index
    rf2 = remat(f, static_argnums=-1)
    assert_tree_close(grad(lambda x: rf2(x, 2, mode="sin").sum())(x), grad(lambda x: f(x, 2, mode="sin").sum())(x))


def test_static_argnums_errors_name_the_fix():
    rf = remat(lambda x, n: x * n, static_argnums=(3,))
    with pytest.raises(ValueError, match="static_argnums"):
        grad(lambda x: rf(x, 2).sum())(torch.randn(2))
    with pytest.raises(ValueError, match="static_argnums"):
        rf(torch.randn(2, requires_grad=True), 2)
    with pytest.raises(ValueError, match="not a parameter"):
        remat(lambda x: x, static_argnames=("nope",))
    with pytest.raises(TypeError, match="static_argnums"):
        remat(lambda x: x, static_argnums="0")
    with pytest.raises(TypeError, match="callable"):
        remat(3)


@pytest.mark.parametrize("how", ["argnums", "argnames"])
def test_static_tensor_gets_gradients_like_a_closed_over_tensor(how):
    # a static argument is passed through as it is (never flattened); a tensor in it
    # that requires grad gets exact gradients, as a tensor the function closes over
    # does: in eager mode and under every torch.func transform, as the plain function
    def f(x, p, n):
        return (torch.tanh(x @ p["w"]) ** n).sum() + (p["w"] * x[0]).sum()

    if how == "argnums":
        rf = remat(f, static_argnums=(1, 2))

        def call(fn, x, w):
            return fn(x, {"w": w}, 2)
    else:
        rf = remat(f, static_argnames=("p", "n"))

        def call(fn, x, w):
            return fn(x, p={"w": w}, n=2)

    torch.manual_seed(0)
    x = torch.randn(4, 3, dtype=torch.float64)
    w = torch.randn(3, 3, dtype=torch.float64)
    one = torch.tensor(1.0, dtype=torch.float64)
    transforms = {
        "grad": lambda g: torch.func.grad(g, argnums=(0, 1))(x, w),
        "vjp": lambda g: torch.func.vjp(g, x, w)[1](one),
        "jacrev": lambda g: torch.func.jacrev(g, argnums=(0, 1))(x, w),
        "vmap(grad)": lambda g: vmap(grad(g, argnums=(0, 1)), in_dims=(0, None))(x[:, None], w),
        "hessian": lambda g: torch.func.hessian(g, argnums=1)(x, w),
        "jvp": lambda g: torch.func.jvp(lambda w: g(x, w), (w,), (torch.ones_like(w),)),
    }
    got = {name: t(lambda x, w: call(rf, x, w)) for name, t in transforms.items()}
    assert_tree_close(got, {name: t(lambda x, w: call(f, x, w)) for name, t in transforms.items()})
    # eager autograd, and the gradient of the gradient
    grads = []
    for fn in (rf, f):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        g = torch.autograd.grad(call(fn, xr, wr), (xr, wr), create_graph=True)
        grads.append((g, torch.autograd.grad(g[1].sum(), (xr, wr))))
    assert_tree_close(grads[0], grads[1])


class MLP(torch.nn.Module):
    """A tiny MLP."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))

    def half(self, x):
        return self.forward(x) / 2


def test_modules_and_bound_methods():
    torch.manual_seed(0)
    m = MLP()
    x = torch.randn(3, 4)
    rm = remat(m)
    assert rm.__name__ == "MLP" and rm.__wrapped__ is m
    rh = remat(m.half)
    params = dict(m.named_parameters())
    for plain, wrapped in ((m, rm), (m.half, rh)):
        ref = grad(lambda p: torch.func.functional_call(m, p, (x,)).sum() if plain is m
                   else (torch.func.functional_call(m, p, (x,)) / 2).sum())(params)
        got = grad(lambda p: _swap_call(m, p, wrapped, x).sum())(params)
        assert_tree_close(got, ref)
    # eager
    m.zero_grad()
    rm(x).sum().backward()
    g1 = {k: v.grad.clone() for k, v in m.named_parameters()}
    m.zero_grad()
    m(x).sum().backward()
    assert_tree_close(g1, {k: v.grad for k, v in m.named_parameters()})


def _swap_call(m, p, wrapped, x):
    from torch.nn.utils.stateless import _reparametrize_module

    with _reparametrize_module(m, p):
        return wrapped(x)


def test_method_decorator_in_class():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        @remat
        def forward(self, x):
            return torch.relu(self.lin(x)) + x

    torch.manual_seed(0)
    blk = Block()
    x = torch.randn(2, 3)
    params = dict(blk.named_parameters())
    got = grad(lambda p: torch.func.functional_call(blk, p, (x,)).sum())(params)
    ref = grad(lambda p: (torch.relu(torch.nn.functional.linear(x, p["lin.weight"], p["lin.bias"])) + x).sum())(params)
    assert_tree_close(got, ref)


def test_no_grad_calls_function_directly():
    calls = []

    def f(x):
        calls.append(1)
        return x * 2

    with torch.no_grad():
        y = remat(f)(torch.randn(2, requires_grad=True))
    assert not y.requires_grad and len(calls) == 1


def test_partial_and_callable_object_closures_get_gradients():
    w = torch.randn(3)

    def f(x, w):
        return (x * w).sin().sum()

    class Obj:
        def __init__(self, w):
            self.w = w

        def __call__(self, x):
            return (x * self.w).sin().sum()

    x = torch.randn(3)
    ref = grad(lambda w: f(x, w))(w)
    assert_tree_close(grad(lambda w: remat(functools.partial(f, w=w))(x))(w), ref)
    assert_tree_close(grad(lambda w: remat(Obj(w))(x))(w), ref)


# -- the wrapper copies and pickles with what it wraps (issue 22) ---------------------


class Holder(torch.nn.Module):
    """A module holding ``remat(self.sub)`` as a plain attribute (not a submodule)."""

    def __init__(self, policy=None):
        super().__init__()
        self.sub = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        self.f = remat(self.sub, policy=policy)

    def forward(self, x):
        return self.f(x).sin().sum()

    @remat
    def method(self, x):
        """Docstring of method."""
        return self.sub(x) * 2


@remat
def decorated_top(x, n: int = 2):
    """Docstring of decorated_top."""
    return x.sin() * n


def _save_load(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
@pytest.mark.parametrize("policy", [None, remat_fn.policies.dots_saveable, [torch.ops.aten.addmm.default]])
def test_module_holding_remat_of_submodule_copies_and_loads_independently(how, policy):
    import copy

    torch.manual_seed(0)
    model = Holder(policy)
    twin = copy.deepcopy(model) if how == "deepcopy" else _save_load(model)
    # the copy's wrapper calls the copy's submodule, with the same options
    assert twin.f is not model.f and twin.f.__wrapped__ is twin.sub and twin.sub is not model.sub
    assert twin.f.remat_options == model.f.remat_options or policy is not None and isinstance(policy, list)
    x = torch.randn(3, 4)
    plain = copy.deepcopy(model.sub)  # a plain (never rematerialised) copy: the reference

    def grads(m, run):
        m.zero_grad()
        run(x).backward()
        return [p.grad.clone() for p in m.parameters()]

    ref = grads(plain, lambda x: plain(x).sin().sum())
    assert_tree_close(grads(twin.sub, twin), ref, exact=True)
    assert all(p.grad is None for p in model.parameters())  # the original was not touched
    # under torch.func as well (functional_call swaps the copy's parameters in)
    params = {k: v.detach() for k, v in twin.named_parameters()}
    got = grad(lambda p: torch.func.functional_call(twin, p, (x,)))(params)
    assert_tree_close(list(got.values()), ref)
    # independent of the original: changing the original's weights changes nothing in the copy
    before = twin(x).detach()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert torch.equal(twin(x), before) and not torch.equal(model(x), before)
    assert_tree_close(grads(twin.sub, twin), ref, exact=True)


def test_remat_method_binds_self_and_copies_with_the_instance():
    import copy
    import inspect
    import pickle

    torch.manual_seed(0)
    m = Holder()
    x = torch.randn(3, 4)
    assert isinstance(Holder.__dict__["method"], remat_fn._transform.RematFunction)
    assert Holder.method.__name__ == "method" and Holder.method.__doc__ == "Docstring of method."
    assert Holder.method.__qualname__ == "Holder.method"
    assert m.method.__self__ is m and list(inspect.signature(m.method).parameters) == ["x"]
    assert torch.equal(m.method(x), m.sub(x) * 2)
    for twin in (copy.deepcopy(m), _save_load(m), pickle.loads(pickle.dumps(m))):
        with torch.no_grad():
            twin.sub[0].weight.mul_(3)  # the copy's own weights are used
        assert torch.equal(twin.method(x), twin.sub(x) * 2)
        assert not torch.equal(twin.method(x), m.method(x))
    # module-level wrappers pickle by reference, as functions do
    assert pickle.loads(pickle.dumps(Holder.method)) is Holder.method
    assert pickle.loads(pickle.dumps(decorated_top)) is decorated_top
    assert copy.deepcopy(decorated_top) is decorated_top and copy.copy(decorated_top) is decorated_top
    # a wrapper of a module-level function under another name pickles its function by reference
    g = remat(f_doc, policy=remat_fn.policies.dots_saveable)
    g2 = pickle.loads(pickle.dumps(g))
    assert g2.__wrapped__ is f_doc and g2.remat_options == g.remat_options
    assert list(inspect.signature(decorated_top).parameters) == ["x", "n"]
    assert decorated_top.__name__ == "decorated_top" and decorated_top.__module__ == __name__


def test_closure_over_a_remat_wrapper_reaches_its_tensors():
    """A region whose function closes over another region's wrapper reaches the
    tensors that wrapper closes over (they receive gradients under torch.func)."""
    x = torch.randn(5)

    def loss(w, wrap):
        inner = wrap(lambda x: (x * w).sin())
        outer = wrap(lambda x: inner(x).cos())
        return outer(x).sum()

    w = torch.randn(5)
    ref = grad(lambda w: loss(w, lambda f: f))(w)
    assert_tree_close(grad(lambda w: loss(w, remat))(w), ref)
    wr = w.clone().requires_grad_()
    loss(wr, remat).backward()
    assert_tree_close(wr.grad, ref)
    # what the outer region reaches (checked for in-place changes, put back for recompute)
    from remat_fn._closures import reachable_tensors

    inner = remat(lambda x: x * w)
    assert id(w) in reachable_tensors(lambda x: inner(x).cos()).tensors
