"""Incremental detokenization with stop strings, O(1) work per token.

A request's text grows one token at a time: a `TokenDecoder` turns each new id into the text
it adds (tokenizers' `DecodeStream` for a tokenizer.json, `WindowDecoder` over any
`decode(ids)` otherwise), and `TextStream` decides what of it is final. Nothing emitted is
ever taken back: text that could still grow into a stop string is held until it cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# Per request: a new id in, the text it adds out ("" while a character is incomplete).
# A decoder may also have `flush() -> str`: at the end, the text of ids it still holds
# (an incomplete character comes out as U+FFFD, as a whole-output decode would give it).
TokenDecoder = Callable[[int], str]
# Makes a fresh TokenDecoder for each request.
NewDecoder = Callable[[], TokenDecoder]


class WindowDecoder:
    """Incremental text from a plain `decode(ids)`, decoding only a short window of ids.

    Decoding the last few ids both with and without the new one and taking the difference
    keeps the merges and leading spaces a tokenizer applies across neighbours (sentencepiece's
    "▁"), while the work per token stays constant. A trailing U+FFFD is a partial UTF-8
    character: wait for the next id."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0  # window start: ids before it are final
        self.read = 0  # ids before it have been turned into text

    def __call__(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.decode(self.ids[self.prefix : self.read])
        now = self.decode(self.ids[self.prefix :])
        if now.endswith("\ufffd") or len(now) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before) :]

    def flush(self) -> str:
        before = self.decode(self.ids[self.prefix : self.read])
        rest = self.decode(self.ids[self.prefix :])[len(before) :]
        self.prefix = self.read = len(self.ids)
        return rest


class TextStream:
    def __init__(
        self, decoder: TokenDecoder, stop: Sequence[str] = (), keep_stop: bool = False
    ) -> None:
        self.decoder = decoder
        self.stop = tuple(stop)
        self.keep_stop = keep_stop  # the stop string stays in the text (include_stop_str...)
        self._final: list[str] = []  # emitted pieces
        self._pending = ""  # decoded but held back (it may start a stop string)
        self.stopped = False

    @property
    def text(self) -> str:
        """The text so far (the stop string excluded once found)."""
        return "".join(self._final) + self._pending

    def update(self, token_id: int, check_stop: bool = True) -> tuple[str, bool]:
        """Add one token; return (new text safe to emit, whether a stop string ended it).
        Without `check_stop` (within min_tokens, as vLLM) stop strings are not looked for."""
        pending = self._pending + self.decoder(token_id)
        if not check_stop:
            self._pending = ""
            return self._emit(pending), False
        # Emitted text never ends in a stop string's prefix, so a stop string can only begin
        # in the held-back text: searching `pending` alone is enough.
        cut = self._stop_at(pending)
        if cut is not None:
            self._pending, self.stopped = "", True
            return self._emit(pending[:cut]), True
        end = self._safe_end(pending)
        self._pending = pending[end:]
        return self._emit(pending[:end]), False

    def flush(self) -> str:
        """The rest of the text, at the end of the output (never past a stop string)."""
        if self.stopped:
            return ""
        held = getattr(self.decoder, "flush", None)
        rest, self._pending = self._pending + (held() if held else ""), ""
        cut = self._stop_at(rest)
        if cut is not None:
            rest, self.stopped = rest[:cut], True
        return self._emit(rest)

    def _emit(self, piece: str) -> str:
        if piece:
            self._final.append(piece)
        return piece

    def _stop_at(self, text: str) -> int | None:
        """Where the text ends at the first stop string: before it, or with keep_stop after
        it (the earliest-starting one wins, as vLLM's check_stop_strings takes them)."""
        hits = [(i, len(s)) for s in self.stop if (i := text.find(s)) >= 0]
        if not hits:
            return None
        start, length = min(hits)
        return start + length if self.keep_stop else start

    def _safe_end(self, text: str) -> int:
        end = len(text)
        hold = 0
        for s in self.stop:
            # Longest suffix of the text that is a proper prefix of this stop string.
            for n in range(min(len(s) - 1, end), hold, -1):
                if text[end - n : end] == s[:n]:
                    hold = n
                    break
        return end - hold
