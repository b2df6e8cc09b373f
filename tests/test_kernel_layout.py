"""The kernel's weight layouts and op schemas as Python sees them: no library, no AVX2.

Graphs trace and export against the schemas and shape functions kernel.py defines, so these
run on any host, where the numerics tests (test_kernel.py) need the built library.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from neuronctl.backends.torch import kernel


def test_block_is_reversible_and_fits_only_unpadded_shapes() -> None:
    w = torch.arange(8 * 32).reshape(8, 32)
    assert kernel.block(w).shape == (2, 2, 4, 16)
    blocked = kernel.block(w)
    assert torch.equal(blocked.transpose(1, 2).reshape(8, 32), w)  # the inverse
    assert kernel.unblocked_shape(tuple(blocked.shape)) == (8, 32)
    assert kernel.fits((8, 32)) and not kernel.fits((6, 32)) and not kernel.fits((8, 40))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("blocked", [False, True])
def test_linear_takes_either_layout_in_a_traced_graph(dtype: torch.dtype, blocked: bool) -> None:
    # Shapes only (fake tensors): kernel.linear sends a 2-d weight to linear_rows and a 4-d
    # one to linear_blocked, and each op's shape function gives [..., N]. A plain weight
    # sent to linear_blocked's shape function would fail (it reads w.shape[2]).
    kernel.register_ops()
    w = torch.zeros(12, 48, dtype=dtype)
    w = kernel.block(w) if blocked else w
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.zeros(2, 3, 48))
        weight = mode.from_tensor(w)
        out = kernel.linear(x.bfloat16(), weight, mode.from_tensor(torch.zeros(12)))
    assert out.shape == (2, 3, 12) and out.dtype == torch.bfloat16


def test_export_records_the_op_for_the_weights_layout() -> None:
    kernel.register_ops()

    class Projection(torch.nn.Module):
        def __init__(self, weight: torch.Tensor) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(weight, requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return kernel.linear(x, self.weight)

    x = torch.zeros(1, 32)
    for weight, op in ((torch.zeros(8, 32), "linear_rows"),
                       (kernel.block(torch.zeros(8, 32)), "linear_blocked")):
        with FakeTensorMode(allow_non_fake_inputs=True):
            program = torch.export.export(Projection(weight), (x,))
        targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
        assert f"neuronctl.{op}.default" in targets
