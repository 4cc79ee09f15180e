"""Structured outputs: the grammar a constrained item's tokens must follow, on llguidance.

An item asks for one of vLLM's ``structured_outputs`` kinds (:class:`StructuredSpec`):
a JSON schema (``json``), any JSON object (``json_object``), a regular expression,
a choice of strings, or a grammar (Lark, or llama.cpp's GBNF). The engine's
:class:`GrammarCompiler` builds llguidance's tokenizer from the model's
``tokenizer.json`` once, compiles each spec once (an LRU keyed by the spec: a
batch of 10,000 lines sharing a schema compiles it once, and a bad schema is
refused once), and gives every constrained session its own :class:`Matcher`, a
copy of the compiled one.

A step of constrained rows: :func:`fill_bitmasks` writes each row's allowed tokens
into one ``int32 [rows, words]`` bitmask (llguidance lets go of the GIL and uses
its own threads, so it can run beside the model's run), :func:`apply_bitmask`
sets the other tokens' logits to -inf on those rows only (NumPy, or CuPy for
logits on the device: one function, ``xp`` names the array module), the row's
token is drawn from what is left, and :meth:`Matcher.advance` moves its matcher on.
When the grammar is complete only the end token is allowed (:meth:`Matcher.is_stopped`).
:class:`MaskFiller` makes the fills on a thread of its own, beside the run.

Compilation is bounded (:data:`LIMITS`: llguidance's fuel and size limits) and
runs where admission runs, off the event loop. An invalid schema, regex or
grammar is a :class:`~.errors.BadPrompt` naming what is wrong.
"""

from __future__ import annotations

import collections
import queue
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from .errors import BadPrompt

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[Kind, ...] = ("json", "json_object", "regex", "choice", "grammar")

#: The largest source (a schema's JSON text, a regex, a grammar, the choices) kvmux
#: compiles: llguidance's time grows faster than linearly with a grammar's size
#: (a 160 KiB Lark grammar ~1 s, 1 MiB ~30 s, past its limits), and a 10-field
#: extraction schema is ~2 KiB.
MAX_SOURCE_BYTES = 64 * 1024

#: Compiled grammars kept (each a few hundred KiB at most for a large schema).
CACHE_SIZE = 256


def _limits() -> llguidance.LLParserLimits:
    """llguidance's resource limits for grammars that clients send.

    Its defaults allow 250,000 lexer states (1-2 kB each: up to ~500 MB for one
    hostile grammar); kvmux allows a fifth of that. Fuel bounds time: the initial
    lexer build ~20 ms, a step's mask ~15 ms, whatever the grammar. Errors do not
    echo the grammar's internals back (``verbose_errors``)."""
    import llguidance

    return llguidance.LLParserLimits(
        max_lexer_states=50_000,
        max_grammar_size=200_000,
        initial_lexer_fuel=1_000_000,
        step_lexer_fuel=200_000,
        step_max_items=50_000,
        verbose_errors=False,
    )


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """What an item's output must match: vLLM's ``structured_outputs`` kind and its source.

    ``source`` is the schema's JSON text (``json``), a JSON array of the strings
    (``choice``), the pattern (``regex``), the grammar text (``grammar``), or
    empty (``json_object``). Hashable: it keys the compiled-grammar cache."""

    kind: Kind
    source: str = ""
    #: JSON with any whitespace between its tokens (vLLM's default; its
    #: ``disable_any_whitespace: false``). kvmux's default is compact JSON, as
    #: OpenAI's structured outputs answer: a model cannot wander off into whitespace.
    any_whitespace: bool = False

    @classmethod
    def from_wire(
        cls,
        *,
        json: Any = None,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
        grammar: str | None = None,
        json_object: bool | None = None,
        disable_any_whitespace: bool | None = None,
    ) -> StructuredSpec | None:
        """vLLM's ``structured_outputs`` fields as a spec (None: nothing asked);
        more than one kind is a :class:`BadPrompt`, as vLLM refuses it."""
        given = [
            name
            for name, value in (
                ("json", json),
                ("regex", regex),
                ("choice", choice),
                ("grammar", grammar),
                ("json_object", json_object or None),
            )
            if value is not None
        ]
        if not given:
            return None
        if len(given) > 1:
            raise BadPrompt(
                f"structured_outputs takes one kind of constraint; got {', '.join(given)}",
                {"structured_outputs": given},
            )
        any_whitespace = disable_any_whitespace is False
        if json is not None:
            if isinstance(json, str):
                try:
                    json = msgspec.json.decode(json)
                except msgspec.DecodeError as exc:
                    raise BadPrompt(
                        f"structured_outputs.json is not valid JSON: {exc}",
                        {"structured_outputs": "json"},
                    ) from exc
            if not isinstance(json, dict):
                raise BadPrompt(
                    "structured_outputs.json must be a JSON schema object",
                    {"structured_outputs": "json"},
                )
            return cls("json", msgspec.json.encode(json).decode(), any_whitespace)
        if regex is not None:
            return cls("regex", regex)
        if choice is not None:
            if not choice:
                raise BadPrompt(
                    "structured_outputs.choice must hold at least one string",
                    {"structured_outputs": "choice"},
                )
            return cls("choice", msgspec.json.encode(list(choice)).decode())
        if grammar is not None:
            return cls("grammar", grammar)
        return cls("json_object", "", any_whitespace)

    def __post_init__(self) -> None:
        size = len(self.source.encode("utf-8", errors="surrogatepass"))
        if size > MAX_SOURCE_BYTES:
            raise BadPrompt(
                f"structured_outputs.{self.kind} is {size} bytes; kvmux compiles at most "
                f"{MAX_SOURCE_BYTES} (a grammar's compile time grows faster than its size)",
                {"structured_outputs": self.kind, "bytes": size, "limit": MAX_SOURCE_BYTES},
            )

    def grammar_text(self) -> str:
        """The llguidance grammar this spec stands for (not yet validated)."""
        import llguidance

        options: JsonCompileOptions = {"whitespace_flexible": self.any_whitespace}
        match self.kind:
            case "json":
                return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=options)
            case "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema(
                    '{"type": "object"}', defaults=options
                )
            case "choice":
                # A literal of each string (its JSON escape is Lark's string syntax).
                choices: list[str] = msgspec.json.decode(self.source)
                lark = "start: " + " | ".join(msgspec.json.encode(c).decode() for c in choices)
                return llguidance.LLMatcher.grammar_from_lark(lark)
            case "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.source)
            case "grammar":
                # Lark, or GBNF (llama.cpp's), as vLLM's llguidance backend takes it.
                return llguidance.grammar_from("grammar", self.source)
        raise AssertionError(self.kind)

    def describe(self) -> str:
        """A short name for errors and logs."""
        text = self.source if len(self.source) <= 80 else self.source[:77] + "..."
        return f"structured_outputs.{self.kind}" + (f" {text!r}" if text else "")


class Matcher:
    """One session's place in its grammar: which tokens may come next, and where it ends."""

    __slots__ = ("_ends", "_ll", "_row", "spec")

    def __init__(
        self, ll: llguidance.LLMatcher, spec: StructuredSpec, words: int, ends: frozenset[int]
    ) -> None:
        self._ll = ll
        self.spec = spec
        self._row = np.empty((1, words), dtype=np.int32)
        self._ends = ends

    @property
    def ll(self) -> llguidance.LLMatcher:
        return self._ll

    def fill_bitmask(self, bitmask: npt.NDArray[np.int32]) -> None:
        """Write the allowed next tokens into ``bitmask`` (one C-contiguous int32 row
        of ``words``; bit ``t % 32`` of word ``t // 32`` set: token ``t`` is allowed)."""
        if bitmask.dtype != np.int32 or not bitmask.flags["C_CONTIGUOUS"]:
            raise ValueError("a bitmask row is C-contiguous int32")
        self._ll.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
        self._check()

    def masked(self, logits: npt.NDArray[np.floating]) -> npt.NDArray[np.floating]:
        """A copy of one row of logits with the tokens the grammar forbids at -inf."""
        self.fill_bitmask(self._row[0])
        out = np.array(logits, dtype=logits.dtype, copy=True).reshape(1, -1)
        apply_bitmask(out, self._row)
        row: npt.NDArray[np.floating] = out[0]
        return row

    def is_end(self, token: int) -> bool:
        """Whether ``token`` is an end token (the grammar allowed it: it was drawn)."""
        return token in self._ends

    def advance(self, token: int) -> bool:
        """Move on by ``token``; whether the grammar is complete now (:meth:`is_stopped`),
        in the same call. A token the grammar refuses is a :class:`BadPrompt` (the mask
        keeps it from happening; a grammar over its step limits does)."""
        ll = self._ll
        if not ll.consume_token(token):
            raise self._failed(f"token {token} does not match the grammar")
        return ll.is_stopped()

    def replay(self, tokens: Sequence[int]) -> None:
        """Accept the tokens an item already had (a resumed item picks up where it was)."""
        if tokens and not self._ll.consume_tokens(list(tokens)):
            raise self._failed("the item's tokens do not match the grammar")

    def is_stopped(self) -> bool:
        """The grammar is complete: nothing but the end token may follow."""
        return self._ll.is_stopped()

    def is_accepting(self) -> bool:
        """What was accepted so far is a complete match (the end token is allowed)."""
        return self._ll.is_accepting()

    def _check(self) -> None:
        if self._ll.is_error():
            raise self._failed("failed while decoding")

    def _failed(self, what: str) -> BadPrompt:
        cause = _clean(self._ll.get_error())
        return BadPrompt(
            f"{self.spec.describe()}: {what}" + (f" ({cause})" if cause else ""),
            {"structured_outputs": self.spec.kind, "cause": cause},
        )


def _clean(error: str) -> str:
    """llguidance's message without its marker for the details it was told to leave out."""
    return error.replace("<non-verbose/>", "").strip()


@dataclass(frozen=True, slots=True)
class _Compiled:
    """A compiled spec: a matcher at its start, copied for each session; or its error."""

    template: llguidance.LLMatcher | None
    error: BadPrompt | None


class GrammarCompiler:
    """llguidance for one model: its tokenizer (built on first use), compiled grammars
    (cached), matchers, and the threads that fill many rows' masks at once."""

    def __init__(
        self,
        tokenizer_path: Path,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        cache_size: int = CACHE_SIZE,
    ) -> None:
        self.tokenizer_path = Path(tokenizer_path)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        #: int32 words of one row's bitmask.
        self.words = (vocab_size + 31) // 32
        self._cache: collections.OrderedDict[StructuredSpec, _Compiled] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._limits: llguidance.LLParserLimits | None = None
        #: Compilations done (cache misses), for tests and benchmarks.
        self.compiled = 0

    @classmethod
    def for_model(cls, spec: Any) -> GrammarCompiler:
        """The compiler of a loaded :class:`~kvmux.daemon.model.ModelSpec`."""
        return cls(spec.tokenizer_path, spec.vocab_size, spec.eos_token_ids)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            return self._ready()

    def _ready(self) -> llguidance.LLTokenizer:
        # Built on first use (about a second for a 150k vocabulary), under the lock.
        if self._tokenizer is None:
            try:
                import llguidance
            except ImportError as exc:
                raise BadPrompt(
                    "structured outputs need llguidance, which is not installed: install "
                    "kvmux with its daemon extra (`pip install 'kvmux[cpu]'`)"
                ) from exc
            self._limits = _limits()
            self._tokenizer = llguidance.LLTokenizer(
                self.tokenizer_path.read_text(encoding="utf-8"),
                n_vocab=self.vocab_size,
                eos_token=list(self.eos_token_ids),
            )
        return self._tokenizer

    def compile(self, spec: StructuredSpec) -> None:
        """Compile ``spec`` (once: later calls hit the cache); an invalid one is a
        :class:`BadPrompt` naming what is wrong."""
        compiled = self._compiled(spec)
        if compiled.error is not None:
            raise compiled.error

    def matcher(self, spec: StructuredSpec) -> Matcher:
        """A matcher at the start of ``spec``'s grammar, for one session."""
        compiled = self._compiled(spec)
        if compiled.error is not None:
            raise compiled.error
        assert compiled.template is not None
        return Matcher(
            compiled.template.deep_copy(), spec, self.words, frozenset(self.eos_token_ids)
        )

    def _compiled(self, spec: StructuredSpec) -> _Compiled:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
            tokenizer = self._ready()
        # Outside the lock: llguidance lets go of the GIL while it builds, and
        # two threads compiling one spec at worst both do it.
        compiled = self._build(spec, tokenizer)
        with self._lock:
            self.compiled += 1
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _build(self, spec: StructuredSpec, tokenizer: llguidance.LLTokenizer) -> _Compiled:
        import llguidance

        def refused(why: str) -> _Compiled:
            why = _clean(why)
            return _Compiled(
                None,
                BadPrompt(
                    f"invalid {spec.describe()}: {why}",
                    {"structured_outputs": spec.kind, "cause": why},
                ),
            )

        try:
            grammar = spec.grammar_text()
        except (ValueError, TypeError, msgspec.DecodeError) as exc:
            return refused(str(exc))
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, tokenizer, limits=self._limits
        )
        if is_error:
            return refused("; ".join(messages))
        # Building the matcher builds its lexer: where a too-large grammar runs out of fuel.
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=self._limits)
        if template.is_error():
            return refused(template.get_error())
        return _Compiled(template, None)

    def fill_bitmasks(
        self, matchers: Sequence[Matcher | None], bitmask: npt.NDArray[np.int32]
    ) -> None:
        """Fill row ``i`` of ``bitmask`` (C-contiguous int32 ``[rows, words]``) for
        ``matchers[i]``, in parallel on llguidance's threads, without the GIL; rows
        whose matcher is None are left as they are."""
        import llguidance.numpy as llnp

        if bitmask.ndim != 2 or bitmask.shape[1] != self.words:
            raise ValueError(f"bitmask must be [rows, {self.words}], got {bitmask.shape}")
        pairs = [(m.ll, i) for i, m in enumerate(matchers) if m is not None]
        if not pairs:
            return
        with self._lock:
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor()
            executor = self._executor
        llnp.fill_next_token_bitmask_par(executor, pairs, bitmask)
        for m in matchers:
            if m is not None:
                m._check()


class MaskFiller:
    """Fills masks (:meth:`GrammarCompiler.fill_bitmasks`) on a thread of its own while
    the caller's model run goes on (llguidance lets go of the GIL). The hand-over is a
    queue put and a lock: a ThreadPoolExecutor's future took ~18 us to submit here, a
    share of a short step."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._fills: queue.SimpleQueue[Filling | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, matchers: Sequence[Matcher | None], bitmask: npt.NDArray[np.int32]) -> Filling:
        """Fill ``bitmask`` for ``matchers`` (as ``fill_bitmasks``); the caller leaves
        both alone until :meth:`Filling.error` has returned."""
        if self._thread is None:
            # The thread holds the queue and the compiler, not this filler: once the
            # filler (its engine) is gone, the None put then ends the thread.
            self._thread = threading.Thread(
                target=_fill, args=(self._fills, self.compiler), name="kvmux-masks", daemon=True
            )
            self._thread.start()
            weakref.finalize(self, self._fills.put, None)
        filling = Filling(matchers, bitmask)
        self._fills.put(filling)
        return filling


def _fill(fills: queue.SimpleQueue[Filling | None], compiler: GrammarCompiler) -> None:
    while (filling := fills.get()) is not None:
        try:
            compiler.fill_bitmasks(filling.matchers, filling.bitmask)
        except BaseException as exc:  # noqa: BLE001 - the caller's to see
            filling.failed = exc
        finally:
            filling.done.release()


class Filling:
    """One :meth:`MaskFiller.start`."""

    __slots__ = ("_waited", "bitmask", "done", "failed", "matchers")

    def __init__(self, matchers: Sequence[Matcher | None], bitmask: npt.NDArray[np.int32]) -> None:
        self.matchers = matchers
        self.bitmask = bitmask
        self.failed: BaseException | None = None
        self.done = threading.Lock()
        self.done.acquire()
        self._waited = False

    def error(self) -> BaseException | None:
        """Wait for the fill to end (at once when it has): what it raised, or None."""
        if not self._waited:
            self.done.acquire()
            self._waited = True
        return self.failed


def allocate_bitmask(rows: int, words: int, xp: ModuleType = np) -> Any:
    """A bitmask of ``rows`` rows allowing every token (every bit set)."""
    return xp.full((rows, words), -1, dtype=xp.int32)


# A float32's sign bit, and +inf's bits.
_SIGN = np.int32(-(2**31))
_INF = np.float32(np.inf).view(np.int32)


def apply_bitmask(logits: Any, bitmask: Any, rows: Any = None, xp: ModuleType = np) -> None:
    """Set, in place, the logits of the tokens ``bitmask`` forbids to -inf.

    ``logits`` is ``[batch, vocab]``; ``bitmask`` ``int32 [k, words]`` holds the
    masks of ``rows`` (``k`` row indices of ``logits``; None: every row, in
    order). Only those rows change. ``xp`` is the array module both live in:
    numpy, or cupy for logits on the device (the same tokens masked on either; on the
    host a NaN logit stays NaN)."""
    vocab = logits.shape[1]
    if xp is np:
        # Token t is bit t % 8 of byte t // 8 of the little-endian words: one unpacking,
        # half the host's time of the shifts below; past the mask's end count pads 0s.
        words = np.ascontiguousarray(bitmask, dtype="<i4").view(np.uint8)
        allowed = np.unpackbits(words, axis=1, count=vocab, bitorder="little")
        # Each bit becomes a cap, +inf (allowed) or -inf, by setting a float's sign
        # alone; the logits take the minimum. No branch: a boolean assignment costs
        # twice as much on a grammar's masks, whose bits alternate unpredictably.
        cap = allowed.astype(np.int32)
        cap -= 1
        cap &= _SIGN
        cap |= _INF
        if rows is None:
            np.minimum(logits, cap.view(np.float32), out=logits)
            return
        picked = logits[rows]
        np.minimum(picked, cap.view(np.float32), out=picked)
        logits[rows] = picked
        return
    shifts = xp.arange(32, dtype=xp.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, :vocab]
    if allowed.shape[1] < vocab:  # a mask narrower than the logits allows none past its end
        pad = xp.zeros((allowed.shape[0], vocab - allowed.shape[1]), dtype=allowed.dtype)
        allowed = xp.concatenate([allowed, pad], axis=1)
    forbidden = allowed == 0
    if rows is None:
        logits[forbidden] = -xp.inf
        return
    picked = logits[rows]
    picked[forbidden] = -xp.inf
    logits[rows] = picked
