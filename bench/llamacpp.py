"""llama.cpp as bench/peers.py runs it: llama-cpp-python's C API, no torch imported.

    python bench/llamacpp.py MODEL.gguf '[ids]' [MODE]   # cold start: load, prompt, 1 token

MODES, the first being what llama.cpp's users get by default (`llama_model_default_params`:
weights in the CPU's "extra" buffer types, i.e. repacked for AMX or the AVX2/NEON repack
kernels wherever the CPU and the weight type have one):

- `default`: as above; a prompt is one llama_decode (batched prompt processing);
- `decode-only`: the same weights, every llama_decode one token (prompts token by token;
  one sequence only): the fallback where the default crashes on multi-token batches but
  decodes one token fine (GCC 12 builds of the AMX path on a Xeon with AMX);
- `no-repack`: `use_extra_bufts = false`, plain ggml buffers (what `--repack off` gives).
"""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Any

MODES = ("default", "decode-only", "no-repack")
_LOG_CALLBACK: Any = None


class LlamaCpp:
    """One llama.cpp context with a sequence per slot, driven token by token like the bench's
    other systems (one llama_decode per step, as llama-batched-bench does)."""

    def __init__(self, gguf_path: str, n_seq: int, threads: int | None, n_ctx: int,
                 mode: str = "default") -> None:
        import llama_cpp as lc

        if mode not in MODES:
            raise ValueError(f"llama.cpp mode {mode!r} is not one of {MODES}")
        if mode == "decode-only" and n_seq != 1:
            raise ValueError("decode-only runs one sequence (a step of n is n tokens)")
        global _LOG_CALLBACK
        if _LOG_CALLBACK is None:  # keep llama.cpp's load log off the bench output
            _LOG_CALLBACK = lc.llama_log_callback(lambda level, text, data: None)
            lc.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
        lc.llama_backend_init()
        self.lc, self.mode = lc, mode
        model_params = lc.llama_model_default_params()
        if mode == "no-repack":
            model_params.use_extra_bufts = False
        self.model = lc.llama_model_load_from_file(gguf_path.encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        params = lc.llama_context_default_params()
        params.n_ctx = n_ctx * n_seq
        params.n_batch = params.n_ubatch = n_ctx * n_seq
        params.n_seq_max = n_seq
        if threads:
            params.n_threads = params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(n_ctx * n_seq, 0, 1)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """(token, position, sequence, wants logits) items: one llama_decode, or one per item
        in decode-only mode."""
        groups = [[item] for item in items] if self.mode == "decode-only" else [items]
        for group in groups:
            batch = self.batch
            batch.n_tokens = len(group)
            for i, (token, pos, seq, logits) in enumerate(group):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, logits
            if self.lc.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")

    def _argmax(self, i: int) -> int:
        import numpy as np

        row = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i),
                                    shape=(self.n_vocab,))
        return int(row.argmax())

    def prefill(self, ids: list[list[int]]) -> list[int]:
        """Every prompt in one llama_decode (llama.cpp's batched prompt processing); the
        greedy next token of each."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        items = [(t, p, s, p == len(seq) - 1) for s, seq in enumerate(ids)
                 for p, t in enumerate(seq)]
        self._decode(items)
        if self.mode == "decode-only":  # one sequence: the last call's one row
            return [self._argmax(-1)]
        return [self._argmax(i) for i, item in enumerate(items) if item[3]]

    def step(self, tokens: list[int], position: int) -> list[int]:
        """One decode step: token s of sequence s at `position`; the greedy next tokens."""
        self._decode([(t, position, s, True) for s, t in enumerate(tokens)])
        if self.mode == "decode-only":
            return [self._argmax(-1)]
        return [self._argmax(s) for s in range(len(tokens))]


def cold_start(gguf_path: str, ids: list[int], mode: str) -> int:
    """Load, encode the prompt, return the first token: what a cold `llama-cli` does."""
    llm = LlamaCpp(gguf_path, 1, None, max(256, len(ids) + 1), mode)
    return llm.prefill([ids])[0]


if __name__ == "__main__":
    print(cold_start(sys.argv[1], json.loads(sys.argv[2]),
                     sys.argv[3] if len(sys.argv) > 3 else "default"))
