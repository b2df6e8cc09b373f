"""Incremental detokenization with stop strings.

Text is re-decoded from all output ids each step (outputs are short; this keeps multi-byte
characters and merges right). What is emitted never has to be taken back: a trailing partial
UTF-8 character and any suffix that could still grow into a stop string are held back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Detokenize = Callable[[Sequence[int]], str]


class TextStream:
    def __init__(self, detokenize: Detokenize, stop: Sequence[str] = ()) -> None:
        self.detokenize = detokenize
        self.stop = tuple(stop)
        self.text = ""  # the final text so far (stop string excluded once found)
        self.emitted = 0

    def update(self, token_ids: Sequence[int]) -> tuple[str, bool]:
        """Return (new text safe to emit, whether a stop string ended the output)."""
        text = self.detokenize(token_ids)
        cut = self._stop_at(text)
        if cut is not None:
            self.text = text[:cut]
            return self._emit(len(self.text)), True
        self.text = text
        return self._emit(self._safe_end(text)), False

    def flush(self) -> str:
        """The rest of the text, at the end of the output."""
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        end = max(end, self.emitted)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def _stop_at(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _safe_end(self, text: str) -> int:
        end = len(text.rstrip("\ufffd"))
        hold = 0
        for s in self.stop:
            # Longest suffix of the text that is a proper prefix of this stop string.
            for n in range(min(len(s) - 1, end), hold, -1):
                if text[end - n : end] == s[:n]:
                    hold = n
                    break
        return end - hold
