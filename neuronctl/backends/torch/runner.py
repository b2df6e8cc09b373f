"""A loaded torch artifact: the weights, the static KV cache and one callable per bucket."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from neuronctl.backends.torch import internals, opchoice
from neuronctl.backends.torch.attention import inv_freq
from neuronctl.backends.torch.config import ModelArgs, args_from_config
from neuronctl.backends.torch.graphs import (
    CONTEXT,
    TOKEN_GEN,
    graph_name,
    prompt_counts,
)
from neuronctl.backends.torch.layout import new_kv_cache
from neuronctl.backends.torch.linear import can_pack, pack_weight, packed_names
from neuronctl.backends.torch.safeload import check_export_graph, load_export_graph
from neuronctl.errors import CheckpointError, NotFoundError, UsageError
from neuronctl.store.verified import VerifiedCopy, verified_copy

if TYPE_CHECKING:
    from neuronctl.spec import BuildSpec
    from neuronctl.store.manifest import FileEntry, OpChoice

Graph = Callable[[list[torch.Tensor]], Any]


class TorchRunner:
    """Implements base.Runner. Not thread-safe: one engine drives it, one step at a time."""

    def __init__(
        self, path: Path, spec: BuildSpec, config: dict[str, Any], graphs: Sequence[str],
        ops: OpChoice | None = None, versions: Mapping[str, str] | None = None, *,
        files: Mapping[str, FileEntry],
    ) -> None:
        assert isinstance(spec.context_buckets, list) and isinstance(spec.token_gen_buckets, list)
        self.path = path
        self.args = args_from_config(config)
        self.batch_size = spec.batch_size
        self.seq_len = spec.seq_len
        self.max_context_length = spec.effective_max_context_length()
        self.context_buckets = list(spec.context_buckets)
        self.token_gen_buckets = list(spec.token_gen_buckets)
        self.vocab_size = self.args.vocab_size
        self.dtype = opchoice.TORCH_DTYPES[str(spec.dtype)]
        self.compiler = str(spec.compiler)
        # The manifest's op choice says how the graphs read the weights: oneDNN-prepacked
        # (linear.packed_linear), blocked for neuronctl's kernel (kernel.block) or plain.
        layout, kernel_digest = _matmul_record(ops, versions or {})
        self.packed = layout == opchoice.PACKED
        self.blocked = layout == opchoice.BLOCKED
        if kernel_digest is not None:
            _load_kernel(kernel_digest, path, files)
        self.quantized = bool(spec.quantized)
        self.weights = _load_weights(path / "weights", self.args, self.dtype, self.packed,
                                     self.batch_size, self.quantized, self.blocked)
        self.k_cache, self.v_cache = new_kv_cache(
            self.args, self.batch_size, self.seq_len, self.dtype
        )
        # Flat input prefix shared by every graph: weights, rope frequencies, caches. The
        # graphs mutate the caches in place, so this list never changes between steps.
        self._prefix = [
            *self.weights.values(),
            inv_freq(self.args),
            *self.k_cache,
            *self.v_cache,
        ]
        # The manifest lists the graphs (graphs/<name>.pt2): no second map to trust. Each is
        # copied now, hashed against the manifest as it is read: a graph loads (lazily, on
        # first use) from that copy, never from its file again (store/verified.py).
        self._graph_files = {Path(rel).stem: rel for rel in graphs}
        self._copies = {Path(rel).stem: _copy_code(path, rel, files) for rel in graphs}
        if self.compiler == "export":  # every graph now, though each loads on first use
            for name, copy in self._copies.items():
                check_export_graph(copy.path, self._graph_files[name])
        # Prompts per context-encoding call this artifact has graphs for (prefill_batch).
        self.prompt_counts = [n for n in prompt_counts(self.batch_size)
                              if graph_name(CONTEXT, self.context_buckets[0], n)
                              in self._graph_files]
        for name in [graph_name(CONTEXT, b, n) for b in self.context_buckets
                     for n in self.prompt_counts]:
            self._check_graph(name)
        for name in [graph_name(TOKEN_GEN, b) for b in self.token_gen_buckets]:
            self._check_graph(name)
        # Loaded on first use: a process that serves short prompts never pays for the
        # others, and loading is most of a cold start for exported programs.
        self._graphs: dict[str, Graph] = {}

    def prefill(self, slot: int, token_ids: Sequence[int]) -> torch.Tensor:
        return self.prefill_batch([slot], [token_ids])[0]

    def prefill_batch(
        self, slots: Sequence[int], prompts: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Context-encode one prompt per slot in as few graph calls as the graphs allow.

        Prompts go in groups of batch_size, each group padded to its longest prompt's context
        bucket and to batch_size rows (padding rows repeat the group's first prompt and slot,
        so they write what it writes); a group under half of batch_size goes one prompt per
        call instead, where padding would more than double the work.
        Returns the last real position's logits, [len(slots), vocab] float32.
        """
        if len(slots) != len(prompts) or not slots:
            raise UsageError("prefill_batch takes one prompt per slot, and at least one")
        if len(set(slots)) != len(slots):
            raise UsageError("prefill_batch got the same slot twice")
        for slot, ids in zip(slots, prompts, strict=True):
            if not 0 <= slot < self.batch_size:
                raise UsageError(f"slot {slot} is outside 0..{self.batch_size - 1}")
            if not ids:
                raise UsageError("cannot prefill an empty prompt")
        step = self.prompt_counts[-1]
        out = []
        for i in range(0, len(slots), step):
            group_slots, group = slots[i:i + step], prompts[i:i + step]
            if 2 * len(group) >= step:  # padding at most doubles the rows
                out.append(self._encode_group(group_slots, group))
            else:
                out += [self._encode_group([s], [ids]) for s, ids in zip(group_slots, group,
                                                                        strict=True)]
        return out[0] if len(out) == 1 else torch.cat(out)

    def _encode_group(
        self, slots: Sequence[int], prompts: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        longest = max(len(ids) for ids in prompts)
        bucket = _pick(self.context_buckets, longest, "context bucket", "prompt length")
        count = _pick(self.prompt_counts, len(prompts), "prompt count", "prompt count")
        rows = list(range(len(prompts))) + [0] * (count - len(prompts))
        tokens = torch.zeros(count, bucket, dtype=torch.long)
        for row, i in enumerate(rows):
            tokens[row, :len(prompts[i])] = torch.as_tensor(prompts[i], dtype=torch.long)
        lengths = torch.tensor([len(prompts[i]) for i in rows])
        slot_ids = torch.tensor([slots[i] for i in rows])
        logits = self._graph(graph_name(CONTEXT, bucket, count))(
            self._prefix + [tokens, lengths, slot_ids])
        return logits[:len(prompts)]

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
        return self._graph(graph_name(TOKEN_GEN, bucket))(self._prefix + inputs)

    def reset(self) -> None:
        """Zero the KV cache (tests; a real engine simply overwrites slots)."""
        for t in (*self.k_cache, *self.v_cache):
            t.zero_()

    def _check_graph(self, name: str) -> None:
        if name not in self._copies:
            raise NotFoundError(f"{self.path} has no graph {name}", "recompile the artifact")

    def _graph(self, name: str) -> Graph:
        graph = self._graphs.get(name)
        if graph is None:
            copy = self._copies[name]
            graph = load_graph(copy.path, self.compiler, self._graph_files[name])
            self._graphs[name] = graph
            copy.close()  # loaded: the program no longer reads its file
        return graph


def _copy_code(path: Path, rel: str, files: Mapping[str, FileEntry]) -> VerifiedCopy:
    """A private copy of the artifact's code file `rel`, whose bytes are the manifest's."""
    entry = files.get(rel)
    if entry is None:
        raise CheckpointError(f"{path}: {rel} is not in its manifest", "recompile the artifact")
    try:
        return verified_copy(path / rel, entry.sha256, f"{path}/{rel}")
    except FileNotFoundError:
        raise NotFoundError(f"{path} lacks {rel}", "recompile the artifact") from None
    except OSError as exc:  # a link (O_NOFOLLOW), a permission: never loaded by another way
        raise CheckpointError(f"{path}/{rel} cannot be read: {exc.strerror}",
                              "recompile the artifact") from None


def load_graph(file: Path, compiler: str, name: str = "") -> Graph:
    """A callable taking the graph's flat input list and returning its output tensor.
    `file` is the verified copy (runner._copy_code); `name` what errors call it."""
    if compiler == "inductor":
        # torch's own package loader (internals.aoti_package_loader): it extracts the
        # package into a directory of its own (mkdtemp) and loads from there.
        run_package = internals.aoti_package_loader(file)
        return lambda flat: run_package(flat)[0]
    program = load_export_graph(file, name)  # refuses pickled payloads before torch reads it
    module = program.module()
    spec = program.call_spec.in_spec
    assert spec is not None

    def run(flat: list[torch.Tensor]) -> torch.Tensor:
        args, kwargs = internals.tree_unflatten(flat, spec)
        return module(*args, **kwargs)

    return run


def _pick(buckets: Sequence[int], need: int, what: str, of: str) -> int:
    i = bisect.bisect_left(buckets, need)
    if i == len(buckets):
        raise UsageError(f"{of} {need} is beyond the largest {what} {buckets[-1]}")
    return buckets[i]


def _matmul_record(ops: OpChoice | None, versions: Mapping[str, str]) -> tuple[str, str | None]:
    """(the weights' layout, the kernel digest its graphs were built with, or None where no
    graph calls the kernel), from the manifest's record: a torch manifest of this format
    always has one (validate refuses older formats before any load)."""
    if ops is None:
        raise CheckpointError("this artifact's manifest records no op choice",
                              "recompile the artifact with this neuronctl")
    if opchoice.KERNEL not in ops.paths:
        return ops.layout, None
    digest = versions.get("kernel")
    if not digest:
        raise CheckpointError(
            "this artifact's graphs call neuronctl's kernel, its manifest records no kernel "
            "version", "recompile the artifact",
        )
    return ops.layout, digest


def _load_kernel(built_with: str, path: Path, files: Mapping[str, FileEntry]) -> None:
    """Register the kernel the graphs call: the artifact's own copy. Serving never compiles:
    an artifact without its copy is refused (the copy is code the manifest lists and the
    load rule vouched for; a library built here on the serving path would be neither)."""
    from neuronctl.backends.torch import kernel

    if built_with != kernel.digest():
        raise CheckpointError(
            f"this artifact's graphs call neuronctl's CPU kernels as of source {built_with},"
            f" this neuronctl has {kernel.digest()}", "recompile the artifact",
        )
    # The name is derived, never read from a file: the digest was just checked.
    library = path / kernel.artifact_library()
    if not library.is_file():
        raise NotFoundError(
            f"{path} lacks {kernel.artifact_library()}, the kernel library its graphs call",
            "recompile the artifact (compile carries the library; serving never compiles it)",
        )
    if kernel.registered():
        return  # a process registers one library (kernel.load_from)
    copy = _copy_code(path, kernel.artifact_library(), files)
    kernel.load_from(copy.path)  # dlopen maps the copy's pages: the copy may go then
    copy.close()


def _load_weights(
    weights_dir: Path, args: ModelArgs, dtype: torch.dtype, packed: bool = False,
    batch_size: int = 1, quantized: bool = False, blocked: bool = False,
) -> dict[str, torch.Tensor]:
    """The graphs' weights, mapped in their final form (weights.py); the matrices that
    oneDNN-packed graphs take are packed one by one, each plain one's pages given back as
    it goes (a tied head's are the embedding's, which the graphs still read)."""
    from neuronctl.backends.torch.weights import load_graph_weights, release

    if packed and not can_pack(dtype):
        raise CheckpointError(
            "this artifact's graphs need oneDNN prepacked weights, which this torch or "
            "CPU cannot provide", "recompile the artifact on this host",
        )
    weights = load_graph_weights(weights_dir, args, dtype, quantized, packed, blocked)
    if packed:
        embedding = weights.get("model.embed_tokens.weight")
        for name in packed_names(args):
            plain, weights[name] = weights[name], pack_weight(weights[name], batch_size)
            if plain is not embedding:
                release(plain)
    return weights
