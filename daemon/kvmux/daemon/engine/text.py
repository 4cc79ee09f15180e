"""Generated text as it streams: incremental detokenization plus stop strings."""

from __future__ import annotations

from ..model import IncrementalDecoder


class TextStream:
    """Turns sampled token ids into text deltas, stopping at the first stop string.

    Text that could still become the start of a stop string is held back until
    it cannot, so a client never sees text that is later cut off.
    """

    def __init__(self, decoder: IncrementalDecoder, stops: tuple[str, ...]) -> None:
        self._decoder = decoder
        self._stops = stops
        self._holdback = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self._emitted = 0
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one token; return the text now safe to show."""
        if self.stopped:
            return ""
        if not self._stops:  # nothing held back: the piece is the delta
            piece = self._decoder.push(token_id)
            self.text += piece
            self._emitted = len(self.text)
            return piece
        scan_from = max(len(self.text) - self._holdback, 0)
        self.text += self._decoder.push(token_id)
        hits = [i for s in self._stops if (i := self.text.find(s, scan_from)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
            return self._take(len(self.text))
        return self._take(max(len(self.text) - self._holdback, self._emitted))

    def push_many(self, token_ids: list[int]) -> str:
        """:meth:`push` of each token in turn, joined."""
        if self._stops or self.stopped:
            return "".join([self.push(t) for t in token_ids])
        piece = self._decoder.push_many(token_ids)
        self.text += piece
        self._emitted = len(self.text)
        return piece

    def finish(self) -> str:
        """The rest of the text, once generation has ended for any reason."""
        if not self.stopped:
            self.text += self._decoder.flush()
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        delta = self.text[self._emitted : upto]
        self._emitted = max(upto, self._emitted)
        return delta
