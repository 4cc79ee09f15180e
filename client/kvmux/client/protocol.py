"""The wire protocol between kvmuxd and its clients: msgspec Structs, msgpack on the wire.

A client talks to the daemon's ROUTER socket from a DEALER socket, one
msgpack message per ZeroMQ message. Requests carry a client-chosen ``id``
that the daemon echoes in its reply; job progress arrives as :class:`Events`,
at most one message per scheduler step per client, each holding every
event of that step for that client (token deltas coalesced, never one
message per token).

Everything the daemon accepts forbids unknown fields and bounds its sizes (on
top of the daemon's own ``max_message_bytes`` and ``max_job_items``), so a
malformed or absurd request is refused whole with a typed error before it
reaches a session. This module imports neither onnxruntime nor anything of the daemon.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

PROTOCOL_VERSION = 4

DEFAULT_MAX_NEW_TOKENS = 128
"""New tokens an item decodes when it says nothing (``max_new_tokens`` None)."""

# Every message the daemon sends is at most this many bytes: a client that
# never reads pins a known number of bytes, whatever it asked for. A result
# larger than that travels in parts (:class:`ResultPart`, :class:`ItemFinishedPart`)
# that the client joins back into the very bytes of the result.
MAX_REPLY_BYTES = 256 * 1024
# What a part of a result carries, leaving room for the message around it.
PART_BYTES = MAX_REPLY_BYTES - 1024

RequestId = Annotated[int, Meta(ge=0, le=2**63 - 1)]
JobId = Annotated[str, Meta(min_length=1, max_length=64)]
TokenId = Annotated[int, Meta(ge=0, lt=2**31)]
PositiveInt = Annotated[int, Meta(ge=1, lt=2**31)]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]


# -- what a client sends -------------------------------------------------------
class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One message of a chat conversation, as OpenAI's chat completions take it.

    ``content`` is text (a client flattens OpenAI's list of text parts into one
    string before sending); ``name`` is passed to the template as given."""

    role: Annotated[str, Meta(min_length=1, max_length=64)]
    content: Annotated[str, Meta(max_length=8 * 1024 * 1024)] = ""
    name: Annotated[str, Meta(max_length=256)] | None = None


class StructuredOutputs(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True
):
    """vLLM's ``structured_outputs``: the output must match one of these (exactly one given).

    ``json``: a JSON schema (an object, or its JSON text); ``json_object``: any
    JSON object; ``regex``: a regular expression; ``choice``: one of these
    strings; ``grammar``: a Lark or GBNF grammar. JSON comes out compact unless
    ``disable_any_whitespace`` is false (vLLM's default, which lets a model put
    any whitespace between tokens). The daemon compiles it before the item is
    queued: an invalid one fails that item alone, ``bad_request``."""

    json: dict[str, Any] | Annotated[str, Meta(max_length=1 << 20)] | None = None
    regex: Annotated[str, Meta(max_length=1 << 20)] | None = None
    choice: (
        Annotated[
            list[Annotated[str, Meta(max_length=1 << 16)]], Meta(min_length=1, max_length=4096)
        ]
        | None
    ) = None
    grammar: Annotated[str, Meta(max_length=1 << 20)] | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None


#: How an item's tool calls were asked for (OpenAI's ``tool_choice``): ``auto`` and
#: ``required`` finish with ``tool_calls``, a ``named`` function with ``stop``.
ToolMode = Literal["auto", "required", "named"]


class Item(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One prompt to decode: text, token ids or chat messages (exactly one), with its parameters.

    ``None`` means "the model's declared default" (genai_config ``search``).
    ``max_context`` caps this item's KV length below the daemon's ceiling.
    ``messages`` are rendered to a prompt with the model's chat template in the
    daemon, so every client gets the same prompt; its result is a chat result.
    ``line`` (the input line the item came from), ``choice`` and ``choices``
    (this is completion ``choice`` of the ``choices`` its line asked for:
    OpenAI's ``n`` times its prompt list) and ``n`` (choices ``k * n`` to
    ``k * n + n - 1`` share prompt ``k``, so usage counts it once) are echoed
    in the result untouched.
    Penalties follow vLLM's definitions;
    ``logprobs`` asks for the chosen token's log-probability and that many of
    the most likely alternatives at every step (0: the chosen token's only);
    ``structured_outputs`` constrains the output to a schema, regex, choice or
    grammar (vLLM's field). ``tool_mode`` marks an item asked for OpenAI tool
    calls (its grammar is in ``structured_outputs``; see ``kvmux.client.tools``):
    echoed in the result, whose text is then read for calls.
    """

    custom_id: Annotated[str, Meta(max_length=512)] = ""
    prompt: Annotated[str, Meta(max_length=8 * 1024 * 1024)] | None = None
    prompt_tokens: Annotated[list[TokenId], Meta(max_length=1 << 20)] | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=4096)] | None = None
    max_new_tokens: PositiveInt | None = None
    min_new_tokens: Annotated[int, Meta(ge=0, lt=2**31)] = 0
    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] | None = None
    top_k: Annotated[int, Meta(ge=0, lt=2**31)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=100.0)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stop: Annotated[
        list[Annotated[str, Meta(min_length=1, max_length=1024)]], Meta(max_length=16)
    ] = msgspec.field(default_factory=list)
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=256)] = msgspec.field(
        default_factory=list
    )
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    skip_special_tokens: bool = True
    max_context: PositiveInt | None = None
    ignore_eos: bool = False
    line: Annotated[int, Meta(ge=1, lt=2**53)] | None = None
    choice: Annotated[int, Meta(ge=0, lt=2**16)] = 0
    choices: Annotated[int, Meta(ge=1, le=2**16)] = 1
    n: Annotated[int, Meta(ge=1, le=2**16)] = 1
    structured_outputs: StructuredOutputs | None = None
    tool_mode: ToolMode | None = None


class Rejected(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An input line the client could not turn into an item.

    Sent with the items, so the job keeps it as an error result (code
    ``bad_request``): ``kvmux results`` of a detached job reports it too."""

    custom_id: Annotated[str, Meta(max_length=512)]
    reason: Annotated[str, Meta(max_length=4096)]
    line: Annotated[int, Meta(ge=1, lt=2**53)] | None = None


class _Request(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op"):
    id: RequestId


class Hello(_Request, tag="hello", frozen=True):
    """Opens a conversation; the daemon answers :class:`Welcome` or a version error."""

    version: int
    client: Annotated[str, Meta(max_length=128)] = ""


class Submit(_Request, tag="submit", frozen=True, omit_defaults=True):
    """A job: a batch of items. ``detach`` keeps it running if this client goes away.

    With ``more``, the job stays open: :class:`AddItems` appends further items
    (a file of any size streams in a bounded piece at a time) until one with
    ``last``. ``rejected`` lines become error results of the job, numbered
    after its items. ``format`` is how its results are written out (the input
    file's shape), kept with the job for whoever collects them later.

    ``stream`` false: this client takes no :class:`TokenDelta` events, only the
    starts and the results (OpenAI's ``stream: false``). While none of a job's
    clients takes them, the daemon builds none and decodes each item's text once,
    at its end."""

    items: Annotated[list[Item], Meta(max_length=1 << 16)]
    detach: bool = False
    name: Annotated[str, Meta(max_length=256)] = ""
    format: Literal["kvmux", "openai"] = "kvmux"
    rejected: Annotated[list[Rejected], Meta(max_length=1 << 16)] = msgspec.field(
        default_factory=list
    )
    more: bool = False
    # Defaults are left out on the wire (omit_defaults): a daemon that predates a
    # field still takes a request that does not use it.
    stream: bool = True


class AddItems(_Request, tag="add_items", frozen=True):
    """More items (and rejected lines) for an open job; answered :class:`Added`.

    ``overloaded`` means the caller's share of the queue is full: send the same
    request again later. ``last`` closes the job: it finishes when these are done."""

    job_id: JobId
    items: Annotated[list[Item], Meta(max_length=1 << 16)] = msgspec.field(default_factory=list)
    rejected: Annotated[list[Rejected], Meta(max_length=1 << 16)] = msgspec.field(
        default_factory=list
    )
    last: bool = False


class Cancel(_Request, tag="cancel", frozen=True):
    """Cancel a job: queued and active items finish with ``cancelled``."""

    job_id: JobId


class Attach(_Request, tag="attach", frozen=True, omit_defaults=True):
    """(Re-)attach to a job: its tally now, its live events from here on.

    Results that finished before come from :class:`Results`, a page at a time.
    Clients already attached keep receiving events; a job not detached is
    cancelled when the last client attached to it goes away. ``stream`` as in
    :class:`Submit`, for this client (attaching again changes it); text produced
    while no client took token updates comes with the next update."""

    job_id: JobId
    stream: bool = True


class Results(_Request, tag="results", frozen=True):
    """The job's finished results with item index >= ``start``, one bounded page.

    ``offset`` goes on with a result too large for one page: the next part of
    result ``start``'s encoding from that byte on (what the previous page's
    ``next_offset`` said)."""

    job_id: JobId
    start: Annotated[int, Meta(ge=0, lt=2**31)] = 0
    offset: Annotated[int, Meta(ge=0, lt=2**40)] = 0


class ListJobs(_Request, tag="jobs", frozen=True):
    """The caller's jobs, running and retained (every job for an operator), oldest
    first, one bounded page from the ``start``-th on."""

    start: Annotated[int, Meta(ge=0, lt=2**31)] = 0


class Detach(_Request, tag="detach", frozen=True):
    """Keep a job running (and its results retained) after this client disconnects."""

    job_id: JobId


class Status(_Request, tag="status", frozen=True):
    """Ask for the daemon's state, sessions, KV memory and growth counters."""


class SubscribeLogs(_Request, tag="subscribe_logs", frozen=True):
    """Stream the daemon's structured log events, filtered by level and job."""

    level: LogLevel = "info"
    job_id: JobId | None = None


class UnsubscribeLogs(_Request, tag="unsubscribe_logs", frozen=True):
    """Stop this client's log stream."""


class Heartbeat(_Request, tag="heartbeat", frozen=True):
    """Tells the daemon this client is alive; answered with :class:`Ack`."""


class Bye(_Request, tag="bye", frozen=True):
    """This client is leaving: its jobs that were not detached are cancelled now."""


Request = (
    Hello
    | Submit
    | AddItems
    | Cancel
    | Attach
    | Results
    | ListJobs
    | Detach
    | Status
    | SubscribeLogs
    | UnsubscribeLogs
    | Heartbeat
    | Bye
)


# -- what the daemon sends -------------------------------------------------------
class ErrorInfo(msgspec.Struct, frozen=True):
    """A typed error: a stable ``code``, a message for people, diagnostics in ``details``."""

    code: str
    message: str
    details: dict[str, Any] = msgspec.field(default_factory=dict)


class Usage(msgspec.Struct, frozen=True):
    """Token counts of one finished item; ``cached_tokens`` of its prompt tokens were
    copied from the prefix cache instead of prefilled (OpenAI's
    ``prompt_tokens_details.cached_tokens``)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One candidate token at a step: its id, its text and its log-probability."""

    token_id: int
    token: str
    logprob: float


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """The chosen token at a step, its log-probability and the most likely alternatives."""

    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob] = msgspec.field(default_factory=list)


class ItemResult(msgspec.Struct, frozen=True, omit_defaults=True):
    """One item's outcome: the completion, or the error that ended it.

    A cancelled or shut-down item keeps the ``text`` and ``token_ids`` it had
    produced (its ``error`` says why it stopped). ``chat`` marks the result of
    a ``messages`` item; ``line`` and ``choice`` are the item's own."""

    index: int
    custom_id: str
    status: Literal["ok", "error"]
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    seed: int | None = None
    error: ErrorInfo | None = None
    line: int | None = None
    choice: int = 0
    choices: int = 1
    n: int = 1
    chat: bool = False
    logprobs: list[TokenLogprob] | None = None
    tool_mode: ToolMode | None = None


class _Event(msgspec.Struct, frozen=True, tag_field="type"):
    job_id: str


class ItemStarted(_Event, tag="item_started", frozen=True):
    """An item got a decode session and began prefilling."""

    index: int
    custom_id: str
    session_id: str
    prompt_tokens: int


class TokenDelta(_Event, tag="tokens", frozen=True):
    """New tokens of one item since the last step, and the text they completed."""

    index: int
    token_ids: list[int]
    text: str


class ItemFinished(_Event, tag="item_finished", frozen=True):
    """An item ended: completed, failed, or cancelled (``result.error`` says)."""

    result: ItemResult


class ItemFinishedPart(_Event, tag="item_finished_part", frozen=True):
    """A part of an :class:`ItemFinished` whose result is larger than a message:
    ``data`` is the result's msgpack encoding from byte ``offset`` on, of ``size``
    in all; parts come in order, one message each. The client joins them and
    hands on one :class:`ItemFinished` (a part lost to a full buffer loses the
    event, not the result: :class:`Results` still has it)."""

    index: int
    offset: int
    size: int
    data: bytes


class JobFinished(_Event, tag="job_finished", frozen=True):
    """Every item of the job has a result."""

    total: int
    ok: int
    failed: int


Event = ItemStarted | TokenDelta | ItemFinished | ItemFinishedPart | JobFinished


class GrowthStats(msgspec.Struct, frozen=True):
    """The growth coordinator's counters."""

    growths: int
    bytes_copied: int
    lock_wait_seconds_total: float
    lock_wait_seconds_max: float
    failures: dict[str, int]
    parked_retries: int
    # Sessions whose KV was released so older ones could grow; decoded again later.
    preemptions: int = 0
    # Times the growth lock was taken: sessions growing into one bucket at one step
    # (and sessions opened at one turn) take it once together.
    lock_holds: int = 0


class PrefixCacheStats(msgspec.Struct, frozen=True):
    """The prefix cache: its settings, what it keeps now, and its tallies since start.

    ``hit_tokens`` of the ``prompt_tokens`` looked up were copied instead of
    prefilled; ``waits`` counts items that waited for another item's prefill of
    their prefix instead of repeating it."""

    scope: str
    block: int
    max_bytes: int
    entries: int
    bytes: int
    lookups: int
    prompt_tokens: int
    hits: int
    hit_tokens: int
    fork_failures: int
    waits: int
    kept: int
    evictions: int


class SessionInfo(msgspec.Struct, frozen=True):
    """One live decode session."""

    session_id: str
    job_id: str
    index: int
    state: str
    capacity: int
    valid_len: int
    kv_bytes: int


class DaemonStatus(msgspec.Struct, frozen=True):
    """What ``kvmux status`` shows.

    Counts are the daemon's; ``sessions`` lists only the caller's own (every
    session for an operator). ``caller`` is the owner the daemon sees.
    """

    state: Literal["loading", "ready", "draining"]
    version: str
    pid: int
    uptime_seconds: float
    model: str
    provider: str
    clients: int
    jobs_active: int
    jobs_retained: int
    sessions_active: int
    sessions_queued: int
    sessions_parked: int
    kv_bytes_in_use: int
    kv_peak_bytes: int
    kv_budget_bytes: int | None
    kv_bytes_per_token: int
    min_bucket: int
    device_free_bytes: int | None
    device_total_bytes: int | None
    memory_source: str
    growth: GrowthStats
    sessions: list[SessionInfo]
    caller: str = ""
    caller_is_operator: bool = False
    # What hostile or careless clients cost: malformed frames answered, dropped
    # unanswered, connections shut for garbage, replies dropped for clients
    # that do not read.
    frames_rejected: int = 0
    frames_dropped: int = 0
    clients_disconnected: int = 0
    replies_dropped: int = 0
    # Valid requests answered `overloaded` because their connection or owner had
    # spent its request budget (see [budget]).
    requests_refused: int = 0
    # The most bytes of replies one client that never reads can pin in the daemon:
    # libzmq's pipe of messages of at most MAX_REPLY_BYTES, plus the daemon's own
    # backlog (server.max_client_buffer_bytes).
    client_bound_bytes: int = 0
    # Sessions left out of ``sessions`` to keep the reply within MAX_REPLY_BYTES.
    sessions_omitted: int = 0
    # Where OpenAI's HTTP API answers ("" when http.listen is off).
    http_url: str = ""
    # None when kv.prefix_cache is off. Its bytes are charged to kv.memory_budget
    # beside kv_bytes_in_use (what sessions hold), and given back before any
    # session is refused memory.
    prefix_cache: PrefixCacheStats | None = None
    # Where the served model is on the daemon's disk (a built-in resolved to its
    # folder in the model cache), its weights' precision as the graph says, and
    # whether it has a chat template (``kvmux generate`` applies it when it does).
    # Empty while the model loads.
    model_folder: str = ""
    model_precision: str = ""
    chat_template: bool = False


class JobInfo(msgspec.Struct, frozen=True):
    """One job as ``kvmux jobs`` lists it."""

    job_id: str
    name: str
    owner: str
    state: Literal["running", "done"]
    total: int
    ok: int
    failed: int
    detached: bool
    age_seconds: float
    #: More items may still be added (``Submit.more`` until ``AddItems.last``).
    open: bool = False


class _Reply(msgspec.Struct, frozen=True, tag_field="kind"):
    pass


class Welcome(_Reply, tag="welcome", frozen=True):
    """The answer to :class:`Hello`: what this daemon is and the limits it enforces."""

    id: int
    version: int
    daemon_version: str
    model: str
    heartbeat_interval: float
    max_message_bytes: int
    max_job_items: int
    # Which run of the daemon answers: ZeroMQ reconnects to a restarted daemon
    # by itself, so heartbeat acks carry it too, and a client notices the change.
    instance: str = ""


class Accepted(_Reply, tag="accepted", frozen=True):
    """A job was admitted; its events follow on this connection."""

    id: int
    job_id: str
    total: int


class Added(_Reply, tag="added", frozen=True):
    """Items were added to an open job; ``total`` counts its items so far."""

    id: int
    job_id: str
    total: int


class Attached(_Reply, tag="attached", frozen=True):
    """Attached: the job's tally; finished results are fetched with :class:`Results`."""

    id: int
    job_id: str
    total: int
    done: bool
    ok: int
    failed: int
    format: Literal["kvmux", "openai"] = "kvmux"


class ResultPart(msgspec.Struct, frozen=True):
    """Part of one result too large for a page: its msgpack encoding from byte
    ``offset`` on, of ``size`` bytes in all."""

    index: int
    offset: int
    size: int
    data: bytes


class ResultsPage(_Reply, tag="results", frozen=True):
    """Finished results from ``start`` on, as many as fit one reply; ``next`` is
    where the following page starts (None: no finished result beyond this page).

    A result larger than a page comes alone, as ``part``s over several pages:
    the next one is asked for with ``start=next, offset=next_offset`` (the same
    index while parts remain)."""

    id: int
    job_id: str
    total: int
    done: bool
    results: list[ItemResult]
    next: int | None
    part: ResultPart | None = None
    next_offset: int = 0


class JobList(_Reply, tag="jobs", frozen=True):
    """The answer to :class:`ListJobs`, oldest first; ``next`` is where the following
    page starts (None: this was the last)."""

    id: int
    jobs: list[JobInfo]
    next: int | None = None


class Ack(_Reply, tag="ack", frozen=True):
    """A request that returns nothing else succeeded (a heartbeat's names the instance)."""

    id: int
    instance: str = ""


class StatusReply(_Reply, tag="status", frozen=True):
    """The answer to :class:`Status`."""

    id: int
    status: DaemonStatus


class ErrorReply(_Reply, tag="error", frozen=True):
    """A request failed; ``id`` is None when the frame was too broken to read one."""

    id: int | None
    error: ErrorInfo


class Events(_Reply, tag="events", frozen=True):
    """Every event of one scheduler step for one client."""

    events: list[Event]


class LogEvents(_Reply, tag="logs", frozen=True):
    """Log events for a subscriber; ``dropped`` counts events lost to a full buffer."""

    records: list[dict[str, Any]]
    dropped: int = 0


Reply = (
    Welcome
    | Accepted
    | Added
    | Attached
    | ResultsPage
    | JobList
    | Ack
    | StatusReply
    | ErrorReply
    | Events
    | LogEvents
)


class _Codec:
    """Cached encoders/decoders: one typed decoder per direction."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.requests = msgspec.msgpack.Decoder(Request)
        self.replies = msgspec.msgpack.Decoder(Reply)


codec = _Codec()


def encode(msg: msgspec.Struct) -> bytes:
    return codec.encoder.encode(msg)


def decode_request(data: bytes) -> Request:
    """Decode what a client sent; raises ``msgspec.DecodeError`` (incl. ValidationError)."""
    return codec.requests.decode(data)


def decode_reply(data: bytes) -> Reply:
    return codec.replies.decode(data)


def check_item(item: Item) -> Item:
    """Validate an item built in Python against the wire constraints (and exactly one prompt).

    msgspec checks constraints when decoding, not when a Struct is built, so the
    client runs this before sending; the daemon runs the same checks on decode.
    Raises ``ValueError`` naming the field.
    """
    checked = msgspec.convert(msgspec.to_builtins(item), Item)
    given = [
        name
        for name, value in (
            ("prompt", checked.prompt),
            ("prompt_tokens", checked.prompt_tokens),
            ("messages", checked.messages),
        )
        if value is not None
    ]
    if len(given) != 1:
        raise ValueError("exactly one of `prompt`, `prompt_tokens` and `messages` must be given")
    return checked
