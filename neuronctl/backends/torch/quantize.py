"""int8 weight-only artifacts: the rounding, and the checkpoint as the shards should hold it.

`QuantizedCheckpoint` presents a checkpoint whose projections and LM head are int8 with a
`<name>_scale` tensor (one per output channel) after each, so the ordinary streaming sharder
writes them: a scale is named after its weight's module, so it is split exactly where its
rows are (column-parallel q/k/v/gate/up, vocab-parallel head) and replicated where the
weight is split along its input (o/down). Tensors are quantized one at a time as the sharder
asks for them; memory stays flat.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from neuronctl.backends.torch.config import args_from_config
from neuronctl.backends.torch.layout import quantized_names, scale_name
from neuronctl.checkpoints.safetensors_format import TensorInfo

if TYPE_CHECKING:
    from neuronctl.checkpoints import Checkpoint
    from neuronctl.spec import BuildSpec


def quantize(weight: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8: (q [out, in] int8, scale [out]) with weight ~= q * scale[:, None].

    The scale is rounded to bf16 first (linear.int8_linear's kernel reads bf16 scales, and any
    storage dtype holds it exactly), then the weight divided by it; values the rounding
    pushes past 127 are clipped.
    """
    w = weight.float()
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax().expand(w.shape[0])
    scale = (amax / 127.0).clamp(min=1e-12).to(torch.bfloat16).float()
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(torch.bfloat16).contiguous()


@dataclass
class QuantizedCheckpoint:
    """The parts of Checkpoint that sharding reads, with int8 weights and their scales."""

    inner: Checkpoint
    quantized: frozenset[str]  # weight names stored as int8
    per_channel: bool
    _last: tuple[str, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @classmethod
    def wrap(cls, checkpoint: Checkpoint, spec: BuildSpec) -> Checkpoint:
        args = args_from_config(checkpoint.config)
        view = cls(checkpoint, frozenset(quantized_names(args)),
                   spec.quantization_type == "per_channel_symmetric")
        return cast("Checkpoint", view)  # duck-typed: sharding uses only what is below

    @property
    def config(self) -> dict[str, Any]:
        return self.inner.config

    @property
    def ref(self) -> str:
        return self.inner.ref

    def tensor_names(self) -> list[str]:
        names = []
        for name in self.inner.tensor_names():
            names.append(name)
            if name in self.quantized:
                names.append(scale_name(name))
        return names

    def tensor_info(self, name: str) -> TensorInfo:
        base = self._weight_of(name)
        if base is None:
            return self.inner.tensor_info(name)
        shape = tuple(self.inner.tensor_info(base).shape)
        if name == base:
            return TensorInfo(torch.int8, shape)
        return TensorInfo(torch.bfloat16, shape[:1])

    def tensor(self, name: str) -> torch.Tensor:
        base = self._weight_of(name)
        if base is None:
            return self.inner.tensor(name)
        if self._last is None or self._last[0] != base:
            q, scale = quantize(self.inner.tensor(base), self.per_channel)
            self._last = (base, q, scale)
        return self._last[1] if name == base else self._last[2]

    def _weight_of(self, name: str) -> str | None:
        """The quantized weight `name` is, or is the scale of; None for other tensors."""
        if name in self.quantized:
            return name
        base = name.removesuffix("_scale")
        return base if base != name and base in self.quantized else None
