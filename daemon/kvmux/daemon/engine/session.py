"""One decode session: the sequence state of one item, decoded on a growing KV cache."""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvmux.kv import (
    CapacityExceeded,
    GrowthFailed,
    GrowthResult,
    HardMax,
    Holder,
    KvCache,
    PrefixCache,
    PromptKey,
    RowKvCache,
    capacity_bucket,
    ensure_capacity,
    ensure_capacity_many,
    failpoints,
)

from .sampling import ResolvedSampling, Sampler, StepLogprobs, step_logprobs
from .structured import Matcher
from .text import TextStream

if TYPE_CHECKING:
    from ..model.tokenizer import Tokenizer

failpoints.register("engine.accept")


@dataclass(slots=True)
class StepOutput:
    """What steps produced: new token ids (none while prefilling), text, and the end.

    The text of a session without stop strings is decoded when it is first read,
    not on the model thread: the daemon reads it on its event loop while the next
    run goes on. Read the outputs of one session in the order they were made; the
    first read decodes every token the session has produced so far, so a later
    output read first carries the earlier ones' text too.
    """

    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    _text: str = ""
    _source: DecodeSession | None = None  # holds tokens not yet decoded

    @property
    def text(self) -> str:
        if self._source is not None:
            self._text += self._source.drain_text()
            self._source = None
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._text = value


def grow_together(
    sessions: Sequence[DecodeSession],
) -> list[GrowthResult | CapacityExceeded | GrowthFailed]:
    """Grow each of ``sessions`` to fit its next step, those bound for one bucket together
    (:func:`kvmux.kv.ensure_capacity_many`); one outcome each, in order."""
    return ensure_capacity_many(
        [s.cache for s in sessions], [s.required_capacity() for s in sessions]
    )


def still_going(out: StepOutput | Exception) -> bool:
    """Whether a session whose step gave ``out`` has more steps to take."""
    return isinstance(out, StepOutput) and not out.finished


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One generated token's raw log-probability and its top alternatives, with their text."""

    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...]


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished session's result; ``logprobs`` (one per token id) when the item asked."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    seed: int
    logprobs: list[TokenLogprobs] | None = None
    #: Prompt tokens whose KV was copied from a cached prefix, not prefilled.
    cached_tokens: int = 0


class DecodeSession:
    """One item's sequence state: prompt, pending token, sampling, stop strings, the end.

    It owns no execution and knows no engine (as vLLM V1's request state: the
    runner owns the step and its device buffers): the engine asks it what to feed
    (:meth:`feed`), runs that through its model runner on the session's KV cache,
    and hands the logits back (:meth:`took`); one session alone steps by
    :meth:`Engine.step <kvmux.daemon.engine.Engine.step>`. Growth goes through
    :func:`kvmux.kv.ensure_capacity` on :attr:`cache`; the scheduler reads the
    session (:meth:`needs_growth`, :meth:`room`, :attr:`kv_bytes`, :attr:`capacity`,
    :attr:`valid_len`, :attr:`hard_max`), never its cache.
    """

    def __init__(
        self,
        prompt_ids: list[int],
        sampling: ResolvedSampling,
        cache: KvCache,
        *,
        tokenizer: Tokenizer,
        eos_token_ids: tuple[int, ...],
        prefill_chunk: int,
        grammar: Matcher | None = None,
        session_id: str = "",
    ) -> None:
        self.session_id = session_id
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.cache = cache
        self.tokenizer = tokenizer
        self.sampler = Sampler(sampling, prompt_ids, eos_token_ids)
        # A stop token id ends the item like EOS: neither is part of its tokens or text.
        self._ends = self.sampler.ends
        hard = cache.hard_max.value
        self._limit = sys.maxsize if hard is None else hard
        decoder = tokenizer.incremental_decoder(skip_special_tokens=sampling.skip_special_tokens)
        self.stream = TextStream(decoder, sampling.stop)
        # Without stop strings nothing about the end depends on the text, so it is
        # decoded where it is read (see StepOutput.text), under this lock: the model
        # thread appends tokens while the daemon's loop decodes earlier ones.
        self.defers_text = not sampling.stop
        self._undecoded: list[int] = []
        self._flush_pending = False  # finished, the decoder's rest not yet taken
        self._text_lock = threading.Lock()
        self.generated: list[int] = []
        self.logprobs: list[StepLogprobs] | None = [] if sampling.logprobs is not None else None
        self.finished = False
        self.finish_reason: str | None = None
        self._chunk = prefill_chunk
        self._prompt_pos = 0
        self.cached_tokens = 0
        self._pending: int | None = None
        self._max_new = sampling.max_new_tokens
        #: Set by :meth:`feed` when it feeds a decode step: the decode steps it can
        #: take from there without growing or reaching its length.
        self.ahead = 0
        #: Its grammar (structured outputs), a matcher of its own; None: free text.
        self.grammar = grammar
        #: Its next token is the logits' argmax and nothing else (greedy, no penalty,
        #: no min_tokens, no logprobs, no grammar): the engine may take it for a whole
        #: run at once.
        self.picks_argmax = (
            self.sampler.plain
            and sampling.greedy
            and sampling.logprobs is None
            and self.grammar is None
        )

    # -- what the scheduler asks -----------------------------------------
    @property
    def prefilling(self) -> bool:
        return self._prompt_pos < len(self.prompt_ids)

    def next_chunk_len(self) -> int:
        if self.prefilling:
            return min(len(self.prompt_ids) - self._prompt_pos, self._chunk)
        return 1

    def required_capacity(self) -> int:
        return self.cache.valid_len + self.next_chunk_len()

    def at_hard_max(self) -> bool:
        hard = self.cache.hard_max.value
        return hard is not None and self.required_capacity() > hard

    def needs_growth(self) -> bool:
        """Its next step does not fit its bucket, and growing is allowed (below the hard max)."""
        return self.required_capacity() > self.cache.capacity and not self.at_hard_max()

    def room(self) -> int:
        """Tokens its bucket still holds."""
        return self.cache.capacity - self.cache.valid_len

    @property
    def kv_bytes(self) -> int:
        return self.cache.nbytes

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    @property
    def valid_len(self) -> int:
        return self.cache.valid_len

    @property
    def hard_max(self) -> HardMax:
        return self.cache.hard_max

    @property
    def on_device(self) -> bool:
        """Nothing of a decode step needs its logits or text on the host: the engine
        takes its token from the argmax where the logits are."""
        return self.picks_argmax and self.defers_text

    @property
    def end_ids(self) -> frozenset[int]:
        """The ids that end it (its stop token ids; EOS unless it ignores EOS)."""
        return self._ends

    @property
    def pending(self) -> int:
        """The token its next decode step feeds."""
        assert self._pending is not None
        return self._pending

    def ensure_capacity(self) -> GrowthResult:
        return ensure_capacity(self.cache, self.required_capacity())

    def growth_bucket(self) -> int:
        """The bucket its next growth moves it to (sessions bound for one grow together)."""
        cache = self.cache
        return capacity_bucket(self.required_capacity(), cache.hard_max.value, cache.min_bucket)

    def fork_tokens(self, match: int) -> int:
        """How many tokens of a cached prefix of ``match`` tokens (whose KV a whole
        prompt's prefill would compute alike) this session starts on, so that every
        logit it computes is the one prefilling its whole prompt computes.

        onnxruntime computes a run of one token by another path than a chunk of
        several, rounding differently; how many tokens a chunk holds otherwise does
        not change a bit. So the prompt's last token is run alone exactly when this
        session's own chunking would run it alone, and the rest of the prompt in
        chunks of several: at most the prompt less one token, a multiple of the
        chunk where its last chunk is one token, else one token less where the
        copy would leave one token alone at the end."""
        n, chunk = len(self.prompt_ids), self._chunk
        tokens = min(match, n - 1)
        if chunk > 1:
            if (n - 1) % chunk == 0:
                if tokens != n - 1:
                    tokens = tokens // chunk * chunk
            elif (n - tokens - 1) % chunk == 0:
                tokens -= 1
        return max(tokens, 0)

    def exact_prefix(self) -> int:
        """Leading prompt tokens whose KV this session computes (or copied) as prefilling
        the whole prompt does: all, unless its last prompt token runs alone in a chunk
        of one (once it has started: on a copy or not)."""
        n, chunk, start = len(self.prompt_ids), self._chunk, self.cached_tokens
        return n - 1 if chunk > 1 and (n - start - 1) % chunk == 0 else n

    def start_from(
        self, prefix: PrefixCache, holder: Holder, key: PromptKey, tokens: int
    ) -> GrowthResult:
        """Allocate the first bucket holding a copy of ``holder``'s first ``tokens`` prompt
        tokens (a cached prefix of this prompt; see :meth:`fork_tokens`); prefill goes on
        from there. Raises as a first allocation does, and then the session is as it
        was: empty, its whole prompt to prefill."""
        if self.cache.capacity or self._prompt_pos or not isinstance(self.cache, RowKvCache):
            raise RuntimeError(f"session {self.session_id} has started; it cannot fork")
        if not 0 < tokens < len(self.prompt_ids):
            raise ValueError(f"cannot start on {tokens} of {len(self.prompt_ids)} prompt tokens")
        n = len(self.prompt_ids)
        required = tokens + min(n - tokens, self._chunk)
        if required == n:
            # The rest of the prompt fits one chunk: room for the first new token too,
            # or the first decode step would grow (copying the prefix again) at once.
            hard = self.cache.hard_max.value
            required = n + 1 if hard is None else min(n + 1, hard)
        result = prefix.fork(self.cache, holder, key, tokens, required)
        self._prompt_pos = self.cached_tokens = tokens
        return result

    # -- one step, as the engine drives it ------------------------------------
    def feed(self, into: StepOutput) -> list[int] | None:
        """What the next run feeds this session (a prompt chunk, or the last sampled
        token), growing its cache first when the step does not fit; or None when the
        context is full: then it has finished, with "length", into ``into`` (as vLLM
        does at max_model_len).

        Prompts over the hard maximum were refused at admission, so only decoding
        reaches the end here. One pass over the state: this runs per row per step.
        """
        if self.finished:
            raise RuntimeError(f"session {self.session_id} already finished")
        cache = self.cache
        pos = self._prompt_pos
        prefilling = pos < len(self.prompt_ids)
        if not prefilling:  # the common case, first: a decode step that fits its bucket
            need = cache.valid_len + 1
            room = min(cache.capacity, self._limit)
            if need <= room:
                assert self._pending is not None
                # Decode steps from here with no growth and no end by length.
                self.ahead = min(room - need + 1, self._max_new - len(self.generated))
                return [self._pending]
        n = min(len(self.prompt_ids) - pos, self._chunk) if prefilling else 1
        need = cache.valid_len + n
        if need > self._limit:
            if not prefilling:
                self._finish("length", into)
                return None
        elif need > cache.capacity:
            ensure_capacity(cache, need)
        if prefilling:
            return self.prompt_ids[pos : pos + n]
        assert self._pending is not None
        room = min(cache.capacity, self._limit)
        self.ahead = min(room - need + 1, self._max_new - len(self.generated))
        return [self._pending]

    def takes_token(self, n: int) -> bool:
        """Whether a run of the ``n`` tokens :meth:`feed` gave ends in a token for it to
        take: not a prompt chunk before its last."""
        return self._prompt_pos + n >= len(self.prompt_ids)

    def took(
        self,
        n: int,
        logits: np.ndarray[Any, Any],
        into: StepOutput,
        pick: int | None = None,
        *,
        masked: bool = False,
        drawn: int | None = None,
    ) -> None:
        """A run fed the ``n`` tokens of :meth:`feed`; ``logits`` are its last position's.
        What the step produced goes into ``into``. ``pick`` is the logits' argmax when
        the caller took it for a whole run at once; only a :attr:`picks_argmax`
        session uses it. ``masked``: its grammar's mask is applied to ``logits``
        already (the engine fills the masks of a step's rows beside its run).
        ``drawn``: the token its :attr:`sampler` drew from these ``logits`` (masked
        ones where it has a grammar) when the caller drew a step's rows together
        (:func:`~kvmux.daemon.engine.sampling.draw_many`); it is accepted here as a
        token drawn here would be."""
        if self._prompt_pos < len(self.prompt_ids):
            self._prompt_pos += n
            if self._prompt_pos < len(self.prompt_ids):
                return
        failpoints.hit("engine.accept", (self.session_id,))
        if pick is not None and self.picks_argmax:
            self._accept(pick, None, into)
            return
        if self.grammar is not None:
            self._took_constrained(self.grammar, logits, into, masked, drawn)
            return
        token = self.sampler(logits) if drawn is None else self.sampler.record(drawn)
        entry = None
        if self.sampling.logprobs is not None:
            entry = step_logprobs(logits, token, self.sampling.logprobs)
        self._accept(token, entry, into)

    def _took_constrained(
        self,
        grammar: Matcher,
        logits: np.ndarray[Any, Any],
        into: StepOutput,
        masked: bool,
        drawn: int | None,
    ) -> None:
        """A structured-output step (kept apart: the batched step takes it over): the
        token is drawn from the logits the grammar allows, moves the matcher on, and
        the item ends with "stop" where the grammar is complete (only the end token
        could follow, so it is not drawn)."""
        # After a token the matcher says whether it is complete (below), so only a
        # grammar that is complete before its first token is asked here.
        if not self.generated and grammar.is_stopped():
            self._finish("stop", into)
            return
        allowed = logits if masked else grammar.masked(logits)
        token = self.sampler(allowed) if drawn is None else self.sampler.record(drawn)
        entry = None
        if self.sampling.logprobs is not None:
            # Of the masked logits, as vLLM's; forbidden alternatives (-inf) left out.
            entry = step_logprobs(allowed, token, self.sampling.logprobs)
            entry = StepLogprobs(
                entry.token_id, entry.logprob, tuple(t for t in entry.top if t[1] > -np.inf)
            )
        if grammar.is_end(token):  # the grammar allowed its end here, and it was drawn
            self._finish("stop", into)
            return
        complete = grammar.advance(token)
        self._accept(token, entry, into)
        if complete and not self.finished:
            self._finish("stop", into)

    def _accept(self, token: int, logprobs: StepLogprobs | None, into: StepOutput) -> None:
        if token in self._ends:
            self._finish("stop", into)
            return
        self.generated.append(token)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        into.token_ids.append(token)
        if self.defers_text:
            with self._text_lock:
                self._undecoded.append(token)
            into._source = self
        else:
            into.text += self.stream.push(token)
        if self.stream.stopped:
            self._finish("stop", into)
        elif len(self.generated) >= self.sampling.max_new_tokens:
            self._finish("length", into)
        else:
            self._pending = token

    def accept_run(self, tokens: list[int], ended: bool, into: StepOutput) -> None:
        """Tokens the engine's array step chose for this :attr:`on_device` session, in
        order, already checked against its ends and its length: all of them are its
        own, then it finished with ``stop`` when ``ended`` (the token after them was an
        end, not kept) or ``length`` at its ``max_new_tokens``."""
        failpoints.hit("engine.accept", (self.session_id,))
        if tokens:
            self.generated += tokens
            into.token_ids += tokens
            with self._text_lock:
                self._undecoded += tokens
            into._source = self
            self._pending = tokens[-1]
        if ended:
            self._finish("stop", into)
        elif len(self.generated) >= self.sampling.max_new_tokens:
            self._finish("length", into)

    def drain_text(self) -> str:
        """The text of the tokens not yet decoded (see :class:`StepOutput`), and once it
        has finished, the decoder's rest."""
        with self._text_lock:
            tokens, self._undecoded = self._undecoded, []
            text = self.stream.push_many(tokens)
            if self._flush_pending:
                self._flush_pending = False
                text += self.stream.finish()
            return text

    def _finish(self, reason: str, into: StepOutput) -> None:
        self.finished = True
        self.finish_reason = reason
        if self.defers_text:
            with self._text_lock:
                self._flush_pending = True
            into._source = self
        else:
            into.text += self.stream.finish()
        into.finished, into.finish_reason = True, reason

    def completion(self) -> Completion:
        if not self.finished or self.finish_reason is None:
            raise RuntimeError(f"session {self.session_id} has not finished")
        if self.defers_text:
            self.drain_text()  # text its outputs' readers have not taken yet
        return Completion(
            text=self.stream.text,
            token_ids=list(self.generated),
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.generated),
            seed=self.sampling.seed,
            logprobs=self._texted_logprobs(),
            cached_tokens=self.cached_tokens,
        )

    def _texted_logprobs(self) -> list[TokenLogprobs] | None:
        if self.logprobs is None:
            return None
        text = self.tokenizer.token_text
        return [
            TokenLogprobs(
                e.token_id,
                text(e.token_id),
                e.logprob,
                tuple((i, text(i), lp) for i, lp in e.top),
            )
            for e in self.logprobs
        ]

    def release(self) -> None:
        """Give the KV buffers back (to the budget and the allocator)."""
        self.cache.release()

    def __repr__(self) -> str:
        return (
            f"DecodeSession({self.session_id!r}, prompt={len(self.prompt_ids)}, "
            f"generated={len(self.generated)}, capacity={self.cache.capacity})"
        )
