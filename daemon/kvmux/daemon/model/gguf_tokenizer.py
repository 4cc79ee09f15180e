"""A GGUF file's vocabulary rebuilt as a ``tokenizers`` tokenizer (tokenizer.json), with its
special tokens and the tokenizer_config.json transformers would write beside it.

Two kinds of vocabulary, each read as llama.cpp's llama-vocab.cpp reads it:

- byte-level BPE (``tokenizer.ggml.model = "gpt2"``): the vocabulary and merges exactly,
  split as llama.cpp splits for the file's pre-tokenizer;
- SentencePiece (``"llama"``: Llama 2, TinyLlama, Mistral's first models, Gemma): the pieces
  with merges ranked by the file's scores, byte-fallback tokens (``<0x0A>``) for text no
  piece covers, and a space put before each stretch of text when the file says so
  (``tokenizer.ggml.add_space_prefix``, on unless it is false; Gemma's files set it false).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kvmux.daemon.model.gguf_file import GGUFFile

__all__ = ["GGUFTokenizer", "read_gguf_tokenizer", "read_tokenizer", "tokenizer_config"]

# llama.cpp's token types (gguf.TokenType): UNKNOWN and CONTROL tokens are special,
# USER_DEFINED ones are matched whole but are ordinary text.
_UNKNOWN: Final = 2
_CONTROL: Final = 3
_USER_DEFINED: Final = 4

_GPT2_REGEX: Final = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_REGEX: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split regex, digits split one by one first, BPE ignore_merges),
# as llama.cpp's llama-vocab.cpp splits for each (and the models' own tokenizer.json).
_PRE_TOKENIZERS: Final[dict[str, tuple[str, bool, bool]]] = {
    "gpt2": (_GPT2_REGEX, False, False),
    "smollm": (_GPT2_REGEX, True, False),
    "starcoder": (_GPT2_REGEX, True, False),
    "llama-bpe": (_LLAMA3_REGEX, False, True),
    "llama3": (_LLAMA3_REGEX, False, True),
    "qwen2": (_QWEN2_REGEX, False, False),
}
_KINDS: Final = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}
# What llama.cpp assumes of a SentencePiece file that leaves these keys out.
_SPM_DEFAULT_IDS: Final = {"bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0}
# SentencePiece's spelling of a space.
_SPACE: Final = "\u2581"


@dataclass(frozen=True)
class GGUFTokenizer:
    """The file's tokenizer as ``tokenizers`` builds it, and its special tokens."""

    tokenizer: Any
    tokens: list[str]
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None
    unk_token_id: int | None
    add_bos_token: bool
    chat_template: str | None


def read_tokenizer(path: Path) -> GGUFTokenizer:
    """The tokenizer a GGUF file describes (byte-level BPE or SentencePiece)."""
    return read_gguf_tokenizer(GGUFFile(Path(path)))


def read_gguf_tokenizer(f: GGUFFile) -> GGUFTokenizer:
    from tokenizers import AddedToken, processors

    kind = f.get("tokenizer.ggml.model")
    if kind not in _KINDS:
        known = " and ".join(f"{name} ({k!r})" for k, name in _KINDS.items())
        raise f.fail(f"tokenizer model {kind!r} is not supported; kvmux imports {known}")
    tokens = [str(t) for t in f.get("tokenizer.ggml.tokens")]
    types = list(f.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        dup = next(t for t, n in Counter(tokens).items() if n > 1)
        raise f.fail(f"vocabulary lists token {dup!r} more than once")
    spm = kind == "llama"

    def token_id(key: str) -> int | None:
        value = f.get(f"tokenizer.ggml.{key}", _SPM_DEFAULT_IDS.get(key) if spm else None)
        if value is None:
            return None
        if not isinstance(value, int) or not 0 <= value < len(tokens):
            raise f.fail(f"tokenizer.ggml.{key} is {value!r}, not a token id")
        return value

    unk = token_id("unknown_token_id")
    tok = _sentencepiece(f, tokens, vocab, unk) if spm else _byte_level_bpe(f, vocab)
    # Already in the vocabulary, so they keep their ids; added, they are matched
    # whole in text before anything else (llama.cpp's tokenizer_st_partition).
    tok.add_tokens(
        [
            AddedToken(t, special=k in (_UNKNOWN, _CONTROL), normalized=False)
            for t, k in zip(tokens, types, strict=False)
            if k in (_UNKNOWN, _CONTROL, _USER_DEFINED)
        ]
    )
    if tok.get_vocab(with_added_tokens=True) != vocab:
        raise f.fail("the tokenizers library does not reproduce the file's vocabulary")

    eos = token_id("eos_token_id")
    if eos is None:
        raise f.fail("metadata key 'tokenizer.ggml.eos_token_id' is missing")
    eos_ids = [eos]
    # Llama 3's end of turn is its own token; a chat stops on either.
    for key in ("eot_token_id", "eom_token_id"):
        extra = token_id(key)
        if extra is not None and extra not in eos_ids:
            eos_ids.append(extra)
    bos = token_id("bos_token_id")
    # llama.cpp adds BOS to a SentencePiece vocabulary's text unless the file says not to.
    add_bos = bool(f.get("tokenizer.ggml.add_bos_token", spm))
    if add_bos and bos is not None:
        # llama.cpp prepends BOS to such a file's text; transformers' and genai's
        # tokenizers do it in the post-processor, as Llama 3's tokenizer.json says.
        b = tokens[bos]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{b} $A", pair=f"{b} $A {b} $B", special_tokens=[(b, bos)]
        )
    template = f.get("tokenizer.chat_template", None)
    return GGUFTokenizer(
        tokenizer=tok,
        tokens=tokens,
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        pad_token_id=token_id("padding_token_id"),
        unk_token_id=unk,
        add_bos_token=add_bos,
        chat_template=str(template) if template is not None else None,
    )


def _byte_level_bpe(f: GGUFFile, vocab: dict[str, int]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = f.get("tokenizer.ggml.pre", "gpt2")
    if pre not in _PRE_TOKENIZERS:
        raise f.fail(
            f"pre-tokenizer {pre!r} is not supported; kvmux knows {', '.join(_PRE_TOKENIZERS)}"
        )
    regex, digits, ignore_merges = _PRE_TOKENIZERS[pre]
    merges: list[tuple[str, str]] = []
    for line in f.get("tokenizer.ggml.merges"):
        parts = str(line).split(" ")
        if len(parts) != 2:
            raise f.fail(f"merge {line!r} is not two tokens")
        merges.append((parts[0], parts[1]))

    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=ignore_merges)
    )
    splits: list[Any] = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if regex == _GPT2_REGEX:  # what ByteLevel's own regex splits
        splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        splits += [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    tok.pre_tokenizer = splits[0] if len(splits) == 1 else pre_tokenizers.Sequence(splits)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(f: GGUFFile, tokens: list[str], vocab: dict[str, int], unk: int | None) -> Any:
    """llama.cpp's SPM tokenizer (llm_tokenizer_spm) as a ``tokenizers`` BPE.

    llama.cpp escapes each stretch of text between special tokens (a space put first
    when the file asks for it, every space made "▁"), then joins neighbouring
    symbols, best-scoring joined piece first, for as long as the joined piece is in
    the vocabulary; what no piece covers becomes its bytes' ``<0xNN>`` tokens. That is
    SentencePiece's own BPE encoding, and a BPE whose merges are ranked by the joined
    piece's score does the same.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = f.get("tokenizer.ggml.scores", None)
    if scores is None:
        raise f.fail(
            "a SentencePiece vocabulary ('llama') needs tokenizer.ggml.scores, "
            "and the file has none"
        )
    if len(scores) != len(tokens):
        raise f.fail(f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    prefix = f.get("tokenizer.ggml.add_space_prefix", True)
    if not isinstance(prefix, bool):
        raise f.fail(f"tokenizer.ggml.add_space_prefix is {prefix!r}, expected true or false")
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges_by_score(tokens, scores, vocab),
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    # The normalizer runs on each stretch between added tokens, so the prefix goes
    # after every special token too, as llama.cpp puts it (and Llama 2's own
    # tokenizer.json); a Metaspace pre-tokenizer would put it only at the start.
    escape = [normalizers.Replace(" ", _SPACE)]
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend(_SPACE), *escape] if prefix else escape
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _merges_by_score(
    tokens: Sequence[str], scores: Sequence[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary, best-scoring piece first;
    ties ordered as transformers' ``generate_merges`` orders them (longer left part
    first, then longer right part, then the piece's id)."""
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for i, piece in enumerate(tokens):
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[i]), -k, k - len(piece), i, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def tokenizer_config(t: GGUFTokenizer, context_length: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "add_bos_token": t.add_bos_token,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    for key, token_id in (
        ("bos_token", t.bos_token_id),
        ("eos_token", t.eos_token_ids[0]),
        ("pad_token", t.pad_token_id),
        ("unk_token", t.unk_token_id),
    ):
        if token_id is not None:
            config[key] = t.tokens[token_id]
    return config
