"""Admission: a wire item becomes an :class:`~kvmux.daemon.engine.Admission` or the
error it fails with, before it takes a place in the queue. Everything a client
can get wrong is refused here, so a bad item fails alone and never reaches a
session; tokenizing runs on a side thread so a long prompt holds up neither the
event loop nor the model."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import anyio.to_thread
import msgspec

from kvmux.client.errors import BadRequest, Overloaded
from kvmux.client.protocol import ErrorInfo, Item, ItemResult, Rejected, StructuredOutputs
from kvmux.kv import failpoints

from ..config import SchedulerConfig, owner_queue_share
from ..engine import Admission, Engine, SamplingParams
from ..engine.structured import StructuredSpec
from ._jobs import JobState, JobTable
from ._queue import FairQueue

failpoints.register("scheduler.admit")

# A message of at most this many items carrying only token ids (no text, no
# chat) is checked on the event loop: ~25 us an item, under the ~1 ms that
# the hop to a side thread and back costs on a small VM.
_INLINE_ITEMS = 16
_INLINE_TOKENS = 4096


class Admitter:
    """Checks wire items against the engine and this daemon's limits."""

    def __init__(self, engine: Engine, cfg: SchedulerConfig) -> None:
        self.engine = engine
        self.cfg = cfg
        self._tokenizer = anyio.CapacityLimiter(1)

    async def check(
        self, items: list[Item], owner: str, queue: FairQueue, retry_after: float
    ) -> list[Admission | Exception]:
        """Admission checks of ``items``, within the queue's bounds:
        ``overloaded`` (with the ``retry_after`` hint) when they do not fit now."""
        n = len(items)
        free = self.cfg.max_queued_items - queue.queued - queue.reserved
        if n > free:
            raise Overloaded(
                f"queue full: {queue.queued} items queued of {self.cfg.max_queued_items} "
                f"(scheduler.max_queued_items); these {n} items do not fit. Retry later.",
                {
                    "items": n,
                    "queued": queue.queued,
                    "max_queued_items": self.cfg.max_queued_items,
                    "retry_after": retry_after,
                },
            )
        share = owner_queue_share(self.cfg)
        mine = queue.by_owner[owner]
        if mine + n > share:
            raise Overloaded(
                f"your queue share is full: {mine} of your items are queued and one owner may "
                f"queue {share} (scheduler.max_queued_per_owner); these {n} items do not "
                "fit. Retry when some have started.",
                {
                    "items": n,
                    "queued_by_you": mine,
                    "max_queued_per_owner": share,
                    "retry_after": retry_after,
                },
            )
        if not items:
            return []
        queue.reserve(owner, n)
        try:
            return await self.admit_items(items)
        finally:
            queue.unreserve(owner, n)

    async def admit_items(self, items: list[Item]) -> list[Admission | Exception]:
        """Each item's admission, or the error it fails with.

        Tokenizing is neither the event loop's nor the model thread's work: a
        long prompt on a side thread (the tokenizer lets go of the GIL) holds up
        no step and no other client. A few items of token ids are checked here.
        """
        if _cheap(items) and not failpoints.active("scheduler.admit"):
            return self._admit_all(items)
        return await anyio.to_thread.run_sync(self._admit_all, items, limiter=self._tokenizer)

    def _admit_all(self, items: list[Item]) -> list[Admission | Exception]:
        failpoints.hit("scheduler.admit")  # tests slow it to hold a submit's check open
        return [self._admit(item) for item in items]

    def _admit(self, item: Item) -> Admission | Exception:
        try:
            given = [x for x in (item.prompt, item.prompt_tokens, item.messages) if x is not None]
            if len(given) != 1:
                raise BadRequest(
                    "exactly one of `prompt`, `prompt_tokens` and `messages` must be given"
                )
            limit = self.cfg.max_new_tokens
            if item.max_new_tokens is not None and item.max_new_tokens > limit:
                raise BadRequest(
                    f"max_new_tokens {item.max_new_tokens} is over this daemon's limit {limit} "
                    "(scheduler.max_new_tokens)",
                    {"max_new_tokens": item.max_new_tokens, "limit": limit},
                )
            params = item_params(item)
            # Rendered here, on the tokenizer's side thread: the event loop never runs Jinja.
            prompt = item_prompt(self.engine, item)
            if isinstance(prompt, str):
                self._check_prompt_bytes(prompt, item.max_context)
            admission = self.engine.admit(prompt, params, max_context=item.max_context)
            cap = self.cfg.max_prompt_tokens
            if cap and len(admission.prompt_ids) > cap:
                raise BadRequest(
                    f"prompt has {len(admission.prompt_ids)} tokens; this daemon takes at most "
                    f"{cap} (scheduler.max_prompt_tokens)",
                    {"prompt_tokens": len(admission.prompt_ids), "max_prompt_tokens": cap},
                )
            return admission
        except Exception as exc:  # noqa: BLE001 - the item fails alone, typed
            return exc

    def _check_prompt_bytes(self, prompt: str, max_context: int | None) -> None:
        """Refuse a text prompt that cannot fit before spending time tokenizing it.

        A token stands for at most ``text_bytes_per_token`` bytes of text, so a
        prompt of B bytes has at least B / that many tokens: over the tightest of
        scheduler.max_prompt_tokens, the item's hard maximum and the protocol's
        bound, it is refused unread."""
        per_token = self.engine.tokenizer.text_bytes_per_token
        size = len(prompt.encode("utf-8", errors="surrogatepass"))
        at_least = -(-size // per_token)
        self.engine.refuse_over_hard_max(self.engine.hard_max_for(max_context), at_least)
        cap = self.cfg.max_prompt_tokens or (1 << 20)
        if at_least > cap:
            raise BadRequest(
                f"prompt is {size} bytes, so at least {at_least} tokens; this daemon takes at "
                f"most {cap} (scheduler.max_prompt_tokens). Shorten the prompt.",
                {
                    "prompt_bytes": size,
                    "prompt_tokens_at_least": at_least,
                    "max_prompt_tokens": cap,
                },
            )


def _cheap(items: list[Item]) -> bool:
    if len(items) > _INLINE_ITEMS:
        return False
    tokens = 0
    for item in items:
        if item.prompt_tokens is None or item.prompt is not None or item.messages is not None:
            return False
        if item.structured_outputs is not None:  # compiling a grammar may take a while
            return False
        tokens += len(item.prompt_tokens)
    return tokens <= _INLINE_TOKENS


def check_message(cfg: SchedulerConfig, items: int, rejected: int, total: int) -> None:
    """One message's bounds: ``scheduler.max_job_items`` per message,
    ``scheduler.max_job_total`` per job."""
    n = items + rejected
    cap = cfg.max_job_items
    if n > cap:
        raise BadRequest(
            f"this message carries {n} items and rejected lines; this daemon takes at most "
            f"{cap} per message (scheduler.max_job_items): send them in several (an open "
            "job takes more with each addition)",
            {"items": n, "max_job_items": cap},
        )
    if total + n > cfg.max_job_total:
        raise BadRequest(
            f"the job would hold {total + n} items; this daemon takes at most "
            f"{cfg.max_job_total} per job (scheduler.max_job_total)",
            {"items": total + n, "max_job_total": cfg.max_job_total},
        )


def check_open_share(jobs: JobTable, owner: str) -> None:
    """An owner holds at most ``jobs.max_open_per_owner`` open jobs: an open job
    needs no item, so nothing else bounds how many a client could create."""
    cap = jobs.cfg.max_open_per_owner
    held = sum(1 for j in jobs.live.values() if j.open and j.owner == owner)
    if held >= cap:
        raise Overloaded(
            f"you hold {held} open jobs, the most one owner may (jobs.max_open_per_owner); "
            "close one (its last addition), cancel it, or wait until one finishes",
            {"open_jobs": held, "max_open_per_owner": cap},
        )


def check_open(job: JobState) -> None:
    if not job.open:
        raise BadRequest(
            f"job {job.job_id} takes no more items: it was closed (by a last addition, a "
            "cancel, or after jobs.open_timeout with nobody attached)",
            {"job_id": job.job_id},
        )


def rejected_results(start: int, rejected: Sequence[Rejected]) -> dict[int, ItemResult]:
    """Lines the client could not parse, as the job's error results from ``start`` on."""
    out = {}
    for index, r in enumerate(rejected, start):
        where = f"line {r.line}: " if r.line is not None else ""
        out[index] = ItemResult(
            index=index,
            custom_id=r.custom_id,
            status="error",
            error=ErrorInfo("bad_request", where + r.reason, {"line": r.line, "reason": r.reason}),
            line=r.line,
        )
    return out


def journaled(
    items: list[Item], checks: list[Admission | Exception], rejected: Sequence[Rejected]
) -> list[Item]:
    """The rows a submit or an addition writes to the journal."""
    wire = [with_seed(item, check) for item, check in zip(items, checks, strict=True)]
    # A rejected line has no item: its row keeps what identifies it.
    wire.extend(Item(custom_id=r.custom_id, line=r.line) for r in rejected)
    return wire


def item_params(item: Item) -> SamplingParams:
    """What a wire item asks the sampler for (``None``: the model's default)."""
    return SamplingParams(
        max_new_tokens=item.max_new_tokens,
        temperature=item.temperature,
        top_k=item.top_k,
        top_p=item.top_p,
        seed=item.seed,
        stop=tuple(item.stop),
        ignore_eos=item.ignore_eos,
        min_new_tokens=item.min_new_tokens,
        min_p=item.min_p,
        repetition_penalty=item.repetition_penalty,
        presence_penalty=item.presence_penalty,
        frequency_penalty=item.frequency_penalty,
        stop_token_ids=tuple(item.stop_token_ids),
        logprobs=item.logprobs,
        skip_special_tokens=item.skip_special_tokens,
        structured=structured_spec(item.structured_outputs),
    )


def structured_spec(wire: StructuredOutputs | None) -> StructuredSpec | None:
    """An item's ``structured_outputs`` as the engine's spec (refused if malformed)."""
    if wire is None:
        return None
    return StructuredSpec.from_wire(
        json=wire.json,
        regex=wire.regex,
        choice=wire.choice,
        grammar=wire.grammar,
        json_object=wire.json_object,
        disable_any_whitespace=wire.disable_any_whitespace,
    )


def item_prompt(engine: Engine, item: Item) -> str | list[int]:
    """A wire item's prompt for the engine: its text, its token ids, or its chat
    messages rendered with the model's template."""
    if item.messages is not None:
        return engine.render_chat([msgspec.structs.asdict(m) for m in item.messages])
    if item.prompt is not None:
        return item.prompt
    return list(item.prompt_tokens or [])


def with_seed(item: Item, check: Admission | Exception) -> Item:
    """The item as journaled: a sampled item gets the seed the daemon chose for it."""
    if isinstance(check, Admission) and item.seed is None and not check.sampling.greedy:
        return msgspec.structs.replace(item, seed=check.sampling.seed)
    return item
