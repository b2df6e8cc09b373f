"""A loaded torch artifact: the weights, the static KV cache and one callable per bucket."""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from neuronctl.backends.torch import modeling
from neuronctl.backends.torch.graphs import CONTEXT, DTYPES, TOKEN_GEN
from neuronctl.backends.torch.safeload import load_export_graph
from neuronctl.errors import CheckpointError, NotFoundError, UsageError

if TYPE_CHECKING:
    from neuronctl.spec import BuildSpec

NEURON_CONFIG = "neuron_config.json"
Graph = Callable[[list[torch.Tensor]], Any]


class TorchRunner:
    """Implements base.Runner. Not thread-safe: one engine drives it, one step at a time."""

    def __init__(
        self, path: Path, spec: BuildSpec, config: dict[str, Any], graphs: Sequence[str]
    ) -> None:
        assert isinstance(spec.context_buckets, list) and isinstance(spec.token_gen_buckets, list)
        self.path = path
        self.args = modeling.args_from_config(config)
        self.batch_size = spec.batch_size
        self.seq_len = spec.seq_len
        self.max_context_length = spec.effective_max_context_length()
        self.context_buckets = list(spec.context_buckets)
        self.token_gen_buckets = list(spec.token_gen_buckets)
        self.vocab_size = self.args.vocab_size
        self.dtype = DTYPES[str(spec.dtype)]
        self.compiler = str(spec.compiler)
        config_data = _neuron_config(path)
        # Inductor artifacts above the GEMV's batch range read oneDNN-prepacked weights
        # (modeling.packed_linear); the graph files are the same whatever the weights.
        self.packed = bool(config_data.get("packed_weights", False))
        self.weights = _load_weights(path / "weights", self.args, self.dtype, self.packed,
                                     self.batch_size)
        self.k_cache, self.v_cache = modeling.new_kv_cache(
            self.args, self.batch_size, self.seq_len, self.dtype
        )
        # Flat input prefix shared by every graph: weights, rope frequencies, caches. The
        # graphs mutate the caches in place, so this list never changes between steps.
        self._prefix = [
            *self.weights.values(),
            modeling.inv_freq(self.args),
            *self.k_cache,
            *self.v_cache,
        ]
        # The manifest lists the graphs (graphs/<kind>_<bucket>.pt2): no second map to trust.
        graph_files = {Path(rel).stem: rel for rel in graphs}
        self._context = {b: self._load_graph(path, graph_files, CONTEXT, b)
                         for b in self.context_buckets}
        self._token_gen = {b: self._load_graph(path, graph_files, TOKEN_GEN, b)
                           for b in self.token_gen_buckets}

    def prefill(self, slot: int, token_ids: Sequence[int]) -> torch.Tensor:
        n = len(token_ids)
        if not 0 <= slot < self.batch_size:
            raise UsageError(f"slot {slot} is outside 0..{self.batch_size - 1}")
        if n == 0:
            raise UsageError("cannot prefill an empty prompt")
        bucket = _pick(self.context_buckets, n, "context bucket", "prompt length")
        tokens = torch.zeros(1, bucket, dtype=torch.long)
        tokens[0, :n] = torch.as_tensor(token_ids, dtype=torch.long)
        inputs = [tokens, torch.tensor([n]), torch.tensor([slot])]
        return self._context[bucket](self._prefix + inputs)

    def decode(self, token_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        if len(token_ids) != self.batch_size or len(positions) != self.batch_size:
            raise UsageError(
                f"decode takes one token and one position per slot ({self.batch_size})"
            )
        top = max(positions)
        if top < 0:
            raise UsageError("decode needs at least one live slot (position >= 0)")
        bucket = _pick(self.token_gen_buckets, top + 1, "token-generation bucket", "position")
        inputs = [torch.as_tensor(token_ids, dtype=torch.long),
                  torch.as_tensor(positions, dtype=torch.long)]
        return self._token_gen[bucket](self._prefix + inputs)

    def reset(self) -> None:
        """Zero the KV cache (tests; a real engine simply overwrites slots)."""
        for t in (*self.k_cache, *self.v_cache):
            t.zero_()

    def _load_graph(self, path: Path, files: dict[str, str], kind: str, bucket: int) -> Graph:
        name = f"{kind}_{bucket}"
        rel = files.get(name)
        if rel is None or not (path / rel).is_file():
            raise NotFoundError(f"{path} has no graph {name}", "recompile the artifact")
        return load_graph(path / rel, self.compiler)


def load_graph(file: Path, compiler: str) -> Graph:
    """A callable taking the graph's flat input list and returning its output tensor."""
    if compiler == "inductor":
        package = torch._inductor.aoti_load_package(str(file))
        loader = package.loader  # calling the loader directly skips pytree work per step
        return lambda flat: loader.run(flat)[0]
    program = load_export_graph(file)  # refuses pickled payloads before torch reads it
    module = program.module()
    spec = program.call_spec.in_spec
    assert spec is not None

    def run(flat: list[torch.Tensor]) -> torch.Tensor:
        args, kwargs = torch.utils._pytree.tree_unflatten(flat, spec)
        return module(*args, **kwargs)

    return run


def _pick(buckets: Sequence[int], need: int, what: str, of: str) -> int:
    i = bisect.bisect_left(buckets, need)
    if i == len(buckets):
        raise UsageError(f"{of} {need} is beyond the largest {what} {buckets[-1]}")
    return buckets[i]


def _neuron_config(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((path / NEURON_CONFIG).read_text()))
    except FileNotFoundError:
        raise NotFoundError(f"{path} has no {NEURON_CONFIG}", "recompile the artifact") from None


def _load_weights(
    weights_dir: Path, args: modeling.ModelArgs, dtype: torch.dtype, packed: bool = False,
    batch_size: int = 1,
) -> dict[str, torch.Tensor]:
    from neuronctl.sharding import load_full_tensors

    full = load_full_tensors(weights_dir)
    missing = [n for n in modeling.weight_names(args) if n not in full]
    if missing:
        raise CheckpointError(f"{weights_dir} lacks {missing[0]}", "recompile the artifact")
    needed = {n: full.pop(n).to(dtype) for n in modeling.weight_names(args)}
    weights = modeling.graph_weights(needed, args, packed)
    if packed:
        if not modeling.can_pack(dtype):
            raise CheckpointError(
                "this artifact's graphs need oneDNN prepacked weights, which this torch or "
                "CPU cannot provide", "recompile the artifact on this host",
            )
        for name in modeling.packed_names(args):
            weights[name] = modeling.pack_weight(weights[name], batch_size)
    return weights
