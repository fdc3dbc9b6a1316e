import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _no_leaked_state():
    """Every test must leave no saved-tensor hook, mode or grad-mode change behind."""
    grad_mode = torch.is_grad_enabled()
    yield
    assert torch.is_grad_enabled() == grad_mode, "grad mode leaked"
    assert torch._C._functorch.peek_interpreter_stack() is None, "functorch level leaked"
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    assert not _get_current_dispatch_mode_stack(), "dispatch mode leaked"
    assert not torch._C._is_torch_function_mode_enabled() or not torch.overrides._get_current_function_mode_stack(), "function mode leaked"
    # no default saved-tensor hooks left pushed: pushing and popping must succeed
    # and the top must be ours
    torch._C._autograd._push_saved_tensors_default_hooks(lambda t: t, lambda t: t)
    torch._C._autograd._pop_saved_tensors_default_hooks()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None, "saved-tensor hooks leaked"


@pytest.fixture
def offloaders(monkeypatch):
    """Every ``Offloader`` made during the test (one per region call), to count transfers."""
    from remat_fn._offload import Offloader

    made = []
    orig = Offloader.__init__

    def init(self):
        orig(self)
        made.append(self)

    monkeypatch.setattr(Offloader, "__init__", init)
    return made
