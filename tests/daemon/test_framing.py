"""Every message the daemon builds stays within MAX_REPLY_BYTES, and what is split joins
back into the very bytes it was: events, log records, results pages, job lists."""

from __future__ import annotations

import msgspec

from kvmux.client import protocol as p
from kvmux.client._client import Job, _join
from kvmux.daemon.access import OPERATOR
from kvmux.daemon.config import JobsConfig
from kvmux.daemon.framing import event_messages, log_messages
from kvmux.daemon.scheduler import ItemState, JobState
from kvmux.daemon.scheduler._jobs import JobTable


def big_result(index: int, tokens: int = 1900, top: int = 20) -> p.ItemResult:
    """A result like a 1,900-token completion with 20 logprobs alternatives a token."""
    steps = [
        p.TokenLogprob(
            t % 259, f"tok{t}", -0.5, [p.TopLogprob(k, f"alt{k}", -1.0 - k) for k in range(top)]
        )
        for t in range(tokens)
    ]
    return p.ItemResult(
        index=index,
        custom_id=f"big-{index}",
        status="ok",
        text="x" * tokens,
        token_ids=[t % 259 for t in range(tokens)],
        logprobs=steps,
    )


def small_result(index: int) -> p.ItemResult:
    return p.ItemResult(index=index, custom_id=f"small-{index}", status="ok", text="hi")


def test_a_step_that_fits_one_message_is_one_message_as_before() -> None:
    events: list[p.Event] = [
        p.TokenDelta(job_id="j", index=i, token_ids=[1, 2], text="ab") for i in range(10)
    ]
    (only,) = event_messages(events)
    assert only == p.encode(p.Events(events=events))


def test_events_with_a_large_result_split_and_join_back_to_the_same_bytes() -> None:
    results = [big_result(0), small_result(1), big_result(2)]
    assert len(p.encode(results[0])) > 2 * p.MAX_REPLY_BYTES
    events: list[p.Event] = [
        p.TokenDelta(job_id="j", index=0, token_ids=[1], text="a"),
        *(p.ItemFinished(job_id="j", result=r) for r in results),
        p.JobFinished(job_id="j", total=3, ok=3, failed=0),
    ]
    messages = event_messages(events)
    assert max(len(m) for m in messages) <= p.MAX_REPLY_BYTES
    job = Job(client=None, job_id="j", total=3)  # type: ignore[arg-type]  # no requests made
    kinds = []
    for data in messages:
        reply = p.decode_reply(data)
        assert isinstance(reply, p.Events)
        for event in reply.events:
            kinds.append(type(event).__name__)
            job._push(event)
    assert "ItemFinishedPart" in kinds
    assert job.results_by_index == dict(enumerate(results))
    for index, result in enumerate(results):
        assert p.encode(job.results_by_index[index]) == p.encode(result)


def test_a_lost_part_loses_the_event_not_a_wrong_result() -> None:
    result = big_result(0)
    data = p.encode(result)
    parts: dict[int, bytearray] = {}
    third = p.PART_BYTES
    assert _join(parts, 0, 0, len(data), data[:third]) is None
    # The second part was dropped (a full buffer); the third must not be glued on.
    assert _join(parts, 0, 2 * third, len(data), data[2 * third :]) is None
    assert parts == {}


def test_log_records_pack_into_bounded_messages_and_a_huge_one_is_cut() -> None:
    records = [{"event": "e", "level": "info", "n": i, "blob": "y" * 2000} for i in range(400)]
    records.append({"event": "huge", "level": "error", "job_id": "j", "blob": "z" * 400_000})
    messages = log_messages(records, dropped=3)
    assert len(messages) > 1
    got = []
    for data in messages:
        assert len(data) <= p.MAX_REPLY_BYTES
        reply = p.decode_reply(data)
        assert isinstance(reply, p.LogEvents) and reply.dropped == 3
        got.extend(reply.records)
    assert got[:400] == records[:400]
    assert got[400]["event"] == "huge" and got[400]["job_id"] == "j"
    assert got[400]["truncated_bytes"] > p.MAX_REPLY_BYTES


def _job(results: list[p.ItemResult | None]) -> JobState:
    job = JobState(job_id="j", clients=[], detached=False, name="", owner="o")
    for index, result in enumerate(results):
        state = ItemState(job, index, f"c{index}", phase="done" if result else "queued")
        state.result = result
        job.items.append(state)
    return job


def _walk(job: JobState, start: int = 0) -> tuple[int, dict[int, bytes]]:
    """Page through ``job`` as a client does: the largest reply, and each result's bytes."""
    largest = 0
    joined: dict[int, bytes] = {}
    at: int | None = start
    offset = 0
    while at is not None:
        page = job.results_page(at, offset)
        largest = max(largest, len(p.encode(page)))
        for r in page.results:
            joined[r.index] = p.encode(r)
        if page.part is not None:
            joined[page.part.index] = joined.get(page.part.index, b"") + page.part.data
        at, offset = page.next, page.next_offset
    return largest, joined


def test_results_pages_stay_within_a_message_and_large_results_come_in_parts() -> None:
    results: list[p.ItemResult | None] = [
        small_result(0),
        big_result(1),
        None,  # not finished yet
        small_result(3),
        big_result(4, tokens=600),
        *(small_result(i) for i in range(5, 3000)),
    ]
    job = _job(results)
    largest, joined = _walk(job)
    assert largest <= p.MAX_REPLY_BYTES
    assert joined == {r.index: p.encode(r) for r in results if r is not None}


def test_a_part_asked_for_at_a_wrong_offset_is_a_bad_request() -> None:
    from kvmux.client.errors import BadRequest

    job = _job([small_result(0), big_result(1), None])
    # Past the result's end, an unfinished item, an item the job does not have.
    for start, offset in ((1, 10**9), (2, 1), (7, 1)):
        try:
            job.results_page(start, offset)
        except BadRequest as exc:
            assert "offset" in exc.details
        else:
            raise AssertionError(f"start={start} offset={offset} was answered")


def test_the_job_list_pages_within_a_message() -> None:
    table = JobTable(JobsConfig())
    for i in range(3000):
        job = JobState(job_id=f"{i:012x}", clients=[], detached=False, name="n" * 200, owner="o")
        table.live[job.job_id] = job
    seen: list[str] = []
    at: int | None = 0
    while at is not None:
        infos, at = table.list_jobs(OPERATOR, at)
        assert len(msgspec.msgpack.encode(infos)) <= p.PART_BYTES
        seen.extend(i.job_id for i in infos)
    assert seen == [f"{i:012x}" for i in range(3000)]
