"""A loaded NxD Inference model behind the Runner protocol (backends/base.py).

NxDI's `forward(input_ids, attention_mask, position_ids, seq_ids, ...)` picks the context
encoding model when input_ids has more than one position and the token generation model
otherwise, padding to its buckets itself. seq_ids name the KV cache slots (continuous
batching). How outputs are shaped is taken from NxDI's source and its public examples; it is
NOT confirmed on a Neuron host (see the `neuron` marked tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from neuronctl.backends.neuron import SlotFill, last_logits

if TYPE_CHECKING:
    from neuronctl.spec import BuildSpec

PAD_ID = 0


class NxdiRunner:
    def __init__(self, model: Any, spec: BuildSpec, vocab_size: int) -> None:
        assert isinstance(spec.context_buckets, list) and isinstance(spec.token_gen_buckets, list)
        self.model = model
        self.batch_size = spec.batch_size
        self.seq_len = spec.seq_len
        self.max_context_length = spec.effective_max_context_length()
        self.context_buckets: Sequence[int] = list(spec.context_buckets)
        self.token_gen_buckets: Sequence[int] = list(spec.token_gen_buckets)
        self.vocab_size = vocab_size
        # With on-device sampling the model returns token ids, not logits.
        self.on_device_sampling = spec.on_device_sampling is not None
        self.fill = SlotFill(self.batch_size, self.seq_len)

    def prefill(self, slot: int, token_ids: Sequence[int]) -> torch.Tensor:
        n = len(token_ids)
        out = self.model.forward(
            input_ids=torch.tensor([list(token_ids)], dtype=torch.int64),
            attention_mask=torch.ones(1, n, dtype=torch.int64),
            position_ids=torch.arange(n, dtype=torch.int64).unsqueeze(0),
            seq_ids=torch.tensor([slot], dtype=torch.int64),
        )
        self.fill.prefilled(slot, n)
        return last_logits(_output(out), 1, self.vocab_size, self.on_device_sampling)[0]

    def decode(self, token_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        # Idle slots (position -1) still take part: the compiled token generation batch is
        # fixed (NxDI pads a smaller batch by repeating its first row into the other slots).
        # Each writes a pad token at its own next free position, never into a live sequence.
        pos = self.fill.positions(positions)
        ids = [t if p >= 0 else PAD_ID for t, p in zip(token_ids, positions, strict=True)]
        width = max(pos) + 1
        mask = (torch.arange(width).unsqueeze(0) <= torch.tensor(pos).unsqueeze(1)).long()
        out = self.model.forward(
            input_ids=torch.tensor(ids, dtype=torch.int64).unsqueeze(1),
            attention_mask=mask,
            position_ids=torch.tensor(pos, dtype=torch.int64).unsqueeze(1),
            seq_ids=torch.arange(self.batch_size, dtype=torch.int64),
        )
        return last_logits(_output(out), self.batch_size, self.vocab_size, self.on_device_sampling)


def _output(out: Any) -> Any:
    """NxDI's forward returns a CausalLMOutputWithPast (its .logits) or a tuple led by them."""
    value = getattr(out, "logits", None)
    if value is None and isinstance(out, tuple | list):
        value = out[0]
    return value
