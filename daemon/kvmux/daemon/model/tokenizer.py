"""The model's tokenizer (``tokenizer.json``) and a streaming detokenizer."""

from __future__ import annotations

import codecs
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from kvmux.daemon.model.errors import ModelFormatError

__all__ = ["IncrementalDecoder", "Tokenizer"]

_REPLACEMENT: Final = "\ufffd"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer uses)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


# The ByteLevel decoder's inverse: printable character -> byte.
_CHAR_TO_BYTE: Final = {c: b for b, c in bytes_to_unicode().items()}


def _is_byte_level(decoder: Any) -> bool:
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    if decoder.get("type") == "Sequence":
        kinds = [d.get("type") for d in decoder.get("decoders", []) if isinstance(d, dict)]
        return kinds == ["ByteLevel"]
    return False


class Tokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from ``tokenizer.json``."""

    def __init__(self, path: Path, *, bos_token_id: int | None = None) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:
            raise ModelFormatError(
                path.parent,
                f"{path.name} could not be loaded ({exc}), expected a "
                "Hugging Face tokenizers JSON file",
            ) from exc
        self.path = path
        self.bos_token_id = bos_token_id
        spec = json.loads(self._tok.to_str())
        self.byte_level: bool = _is_byte_level(spec.get("decoder"))
        self._special_ids: frozenset[int] = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        )
        self._token_texts: dict[int, str] = {}
        # Filled as tokens are generated: a token's bytes are looked up per row per
        # decode step, and rebuilding them char by char cost more than the lookup.
        self._token_bytes: dict[int, bytes] = {}

    @classmethod
    def from_folder(cls, folder: Path, *, bos_token_id: int | None = None) -> Tokenizer:
        return cls(Path(folder) / "tokenizer.json", bos_token_id=bos_token_id)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of ``text``; with ``add_bos``, exactly one leading BOS.

        Uses the tokenizer's own post-processor when it adds the BOS (Llama-style
        tokenizer.json files do), else prepends ``bos_token_id``.
        """
        # encode_batch releases the GIL while it runs (encode does not): a long
        # prompt tokenized on a side thread then stalls neither the event loop
        # nor the model thread.
        (encoding,) = self._tok.encode_batch([text], add_special_tokens=add_bos)
        ids: list[int] = list(encoding.ids)
        if add_bos:
            if self.bos_token_id is None:
                raise ValueError(f"{self.path}: add_bos requested but no bos_token_id is known")
            if not ids or ids[0] != self.bos_token_id:
                ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    @functools.cached_property
    def text_bytes_per_token(self) -> int:
        """The most bytes of input text one token can stand for, so a text of B bytes
        has at least B / this many tokens: a byte limit then refuses an oversized
        prompt before it is tokenized.

        A byte-level tokenizer without a normalizer maps text bytes to tokens
        one to one, so its longest token's bytes are exact; otherwise (say NFKC,
        or SentencePiece's "▁" for a space) a normalizer may shrink the text
        first, and a factor 4 leaves room for that."""
        longest = 1
        for token_id in range(self.vocab_size):
            raw = self.token_bytes(token_id)
            if raw is None:
                piece = self._tok.id_to_token(token_id)
                raw = str(piece).encode("utf-8") if piece is not None else b""
            longest = max(longest, len(raw))
        exact = self.byte_level and self._tok.normalizer is None
        return longest if exact else 4 * longest

    def token_text(self, token_id: int) -> str:
        """One token's text on its own, special tokens included (what logprobs show);
        a piece of a multi-byte character shows as U+FFFD, as in vLLM's logprobs."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def token_bytes(self, token_id: int, *, skip_special: bool = True) -> bytes | None:
        """The raw bytes of one token of a byte-level tokenizer (None: not byte-level);
        a special token is empty unless ``skip_special`` is False (then its content)."""
        if not self.byte_level:
            return None
        if token_id in self._special_ids:
            return b"" if skip_special else str(self._tok.id_to_token(token_id)).encode("utf-8")
        data = self._token_bytes.get(token_id)
        if data is not None:
            return data
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary ({self.vocab_size})")
        try:
            data = bytes(_CHAR_TO_BYTE[c] for c in piece)
        except KeyError:
            # A non-special added token with ordinary text content.
            data = str(piece).encode("utf-8")
        self._token_bytes[token_id] = data
        return data

    def incremental_decoder(self, *, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)


class IncrementalDecoder:
    """Turns a stream of token ids into text, one token at a time.

    ``push(id)`` returns only newly completed text. A UTF-8 character whose bytes
    are split across tokens is held back until complete, so an incomplete trailing
    sequence never shows as U+FFFD; ``flush()`` returns what is left, with U+FFFD
    only for bytes that never formed a valid character. Special tokens produce no
    text unless ``skip_special_tokens`` is False. Concatenating every ``push`` and
    the ``flush`` equals ``Tokenizer.decode`` of all ids (with the same flag).
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # The tokenizer's cache of ordinary tokens' bytes (special ones are never in it),
        # read directly: push runs once per generated token.
        self._known = tokenizer._token_bytes
        # Bytes of a character not complete yet: what codecs' incremental UTF-8
        # decoder keeps, without its Python-level wrapper per call.
        self._held = b""
        # Fallback for tokenizers that are not byte-level: decode a sliding window
        # and emit the growth once it no longer ends in a partial character.
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        data = self._known.get(token_id)
        if data is None:
            data = self._tok.token_bytes(token_id, skip_special=self._skip)
        if data is not None:
            if self._held:
                data = self._held + data
            text, used = codecs.utf_8_decode(data, "replace", False)
            self._held = data[used:]
            return text
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            self._prefix = self._read
            self._read = len(self._ids)
            return after[len(before) :]
        return ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push_many(self, token_ids: Sequence[int]) -> str:
        """``push`` of each id in turn, joined; one UTF-8 decode for them all when every
        one is an ordinary token of a byte-level tokenizer (the daemon's loop decodes
        a chunk of each session's tokens at once)."""
        known = self._known
        try:
            data = b"".join([known[t] for t in token_ids])
        except KeyError:
            # A special token or one not seen yet: its bytes from the tokenizer (which
            # caches an ordinary one's), still one decode. Chunks with a special token
            # are common (199 of 256 `tiny` sessions emit one); decoded one token at a
            # time they took ~19% of kvmuxd's loop thread (py-spy, N = 16).
            pieces = [
                known.get(t) or self._tok.token_bytes(t, skip_special=self._skip) for t in token_ids
            ]
            if None in pieces:  # not byte-level: one at a time
                return "".join([self.push(t) for t in token_ids])
            data = b"".join(pieces)  # type: ignore[arg-type]
        if self._held:
            data = self._held + data
        text, used = codecs.utf_8_decode(data, "replace", False)
        self._held = data[used:]
        return text

    def flush(self) -> str:
        """Text still held back (an incomplete sequence becomes U+FFFD); resets the state."""
        if self._tok.byte_level:
            text, _ = codecs.utf_8_decode(self._held, "replace", True)
            self._held = b""
            return text
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._ids.clear()
        self._prefix = self._read = 0
        return after[len(before) :]
