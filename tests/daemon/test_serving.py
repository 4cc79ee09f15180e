"""A real daemon serving real clients: results equal in-process decoding, events are coalesced."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import structlog
import zmq
import zmq.asyncio

from kvmux.client import (
    BadRequest,
    Client,
    Item,
    ItemResult,
    NotFound,
    Overloaded,
    VersionMismatch,
)
from kvmux.client import protocol as p
from kvmux.daemon.engine import Engine
from kvmux.kv import failpoints

from .conftest import connected, make_config, running
from .helpers import decode_alone, ok_tokens, token_prompt

pytestmark = pytest.mark.anyio


def sixteen_items() -> list[Item]:
    """Greedy and seeded-sampling items of different lengths, text and token prompts."""
    items = []
    for i in range(16):
        sampled = i % 2 == 1
        items.append(
            Item(
                custom_id=f"item-{i}",
                prompt=f"Item {i}: the quick brown fox {'jumps ' * (i % 5)}" if i % 3 else None,
                prompt_tokens=None if i % 3 else token_prompt(5 + 3 * i, seed=i),
                max_new_tokens=12 + 5 * i,
                temperature=0.9 if sampled else 0.0,
                top_k=40 if sampled else None,
                top_p=0.95 if sampled else None,
                seed=1000 + i if sampled else None,
                ignore_eos=i % 4 == 0,
            )
        )
    return items


async def test_sixteen_items_from_three_clients_equal_decoding_alone(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    items = sixteen_items()
    shares = [items[0:6], items[6:11], items[11:16]]
    results: dict[str, ItemResult] = {}
    streamed: dict[str, list[int]] = {}
    started: set[str] = set()

    async with running(make_config(tiny_model, sock_dir)) as daemon:

        async def one_client(share: list[Item]) -> None:
            async with connected(daemon) as client:
                job = await client.submit(share)
                by_index = {i: it.custom_id for i, it in enumerate(share)}
                async for ev in job.events():
                    match ev:
                        case p.ItemStarted(index=i):
                            started.add(by_index[i])
                        case p.TokenDelta(index=i, token_ids=ids):
                            streamed.setdefault(by_index[i], []).extend(ids)
                        case p.ItemFinished(result=r):
                            results[r.custom_id] = r
                        case p.JobFinished(total=total, ok=ok, failed=failed):
                            assert (total, ok, failed) == (len(share), len(share), 0)

        async with anyio.create_task_group() as tg:
            for share in shares:
                tg.start_soon(one_client, share)

        async with connected(daemon) as client:
            status = await client.status()

    assert status.kv_bytes_in_use == 0
    assert status.sessions_active == status.sessions_queued == 0
    assert status.growth.growths > 0 and not status.growth.failures
    got = ok_tokens(list(results.values()))
    assert set(got) == set(started) == {it.custom_id for it in items}
    for item in items:
        assert got[item.custom_id] == decode_alone(reference, item), item.custom_id
        assert streamed.get(item.custom_id, []) == got[item.custom_id]
        usage = results[item.custom_id].usage
        assert usage is not None and usage.completion_tokens == len(got[item.custom_id])


async def test_one_message_per_step_per_client(tiny_model: Path, sock_dir: Path) -> None:
    """Token deltas of one client's items arrive together: one Events message per step."""
    n_items, n_tokens = 6, 30
    async with running(make_config(tiny_model, sock_dir)) as daemon:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(daemon.endpoint)
        try:
            items = [
                Item(
                    custom_id=str(i),
                    prompt_tokens=token_prompt(4, i),
                    max_new_tokens=n_tokens,
                    ignore_eos=True,
                    temperature=0.0,
                )
                for i in range(n_items)
            ]
            await sock.send(p.encode(p.Submit(id=1, items=items)))
            messages, deltas = 0, 0
            with anyio.fail_after(30):
                while True:
                    reply = p.decode_reply(await sock.recv())
                    if not isinstance(reply, p.Events):
                        assert isinstance(reply, p.Accepted)
                        continue
                    messages += 1
                    step_items = [ev.index for ev in reply.events if isinstance(ev, p.TokenDelta)]
                    assert len(step_items) == len(set(step_items)), "two deltas of one item"
                    deltas += sum(
                        len(ev.token_ids) for ev in reply.events if isinstance(ev, p.TokenDelta)
                    )
                    if any(isinstance(ev, p.JobFinished) for ev in reply.events):
                        break
        finally:
            sock.close(linger=0)
            ctx.term()
    assert deltas == n_items * n_tokens
    # Six items decode side by side: far fewer messages than tokens.
    assert messages < deltas / 3


async def test_bad_items_fail_alone_and_others_complete(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    good = Item(custom_id="good", prompt="fine prompt", max_new_tokens=20, temperature=0.0)
    items = [
        Item(custom_id="oov", prompt_tokens=[1, 2, 999_999]),
        good,
        Item(custom_id="too-long", prompt="x" * 400, max_context=64),
        Item(custom_id="too-many", prompt="hi", max_new_tokens=1_000_000),
        Item(custom_id="empty", prompt=""),
    ]
    async with running(make_config(tiny_model, sock_dir)) as daemon, connected(daemon) as client:
        job = await client.submit(items)
        results = {r.custom_id: r for r in await job.results()}
        status = await client.status()
    assert results["good"].status == "ok"
    assert results["good"].token_ids == decode_alone(reference, good)
    codes = {cid: (r.error.code if r.error else None) for cid, r in results.items()}
    assert codes == {
        "oov": "bad_request",
        "good": None,
        "too-long": "kv_capacity_exceeded",
        "too-many": "bad_request",
        "empty": "bad_request",
    }
    too_long = results["too-long"].error
    assert too_long is not None
    assert too_long.details["hard_max"] == 64
    assert too_long.details["requested_tokens"] == 400  # byte-level: one token per byte
    assert "item max_context" in too_long.details["hard_max_source"]
    assert status.kv_bytes_in_use == 0


async def test_client_checks_items_before_sending(tiny_model: Path, sock_dir: Path) -> None:
    async with running(make_config(tiny_model, sock_dir)) as daemon, connected(daemon) as client:
        with pytest.raises(BadRequest, match="item 1"):
            await client.submit([Item(prompt="a"), Item(prompt="b", top_p=2.0)])
        with pytest.raises(BadRequest, match="exactly one"):
            await client.submit([Item(prompt="a", prompt_tokens=[5])])
        assert (await client.status()).jobs_active == 0


async def test_full_queue_answers_overloaded_and_loses_nothing(
    tiny_model: Path, sock_dir: Path
) -> None:
    cfg = make_config(
        tiny_model,
        sock_dir,
        scheduler={
            "max_active_sessions": 1,
            "max_queued_items": 4,
            "max_queued_per_owner": 4,
            "max_job_items": 4,
        },
    )
    long = [
        Item(custom_id=str(i), prompt="slow", max_new_tokens=60, ignore_eos=True) for i in range(4)
    ]
    async with running(cfg) as daemon, connected(daemon) as client:
        first = await client.submit(long)
        with pytest.raises(Overloaded, match="queue full") as info:
            await client.submit(long[:2])
        assert info.value.details["max_queued_items"] == 4
        with pytest.raises(BadRequest, match="max_job_items"):
            await client.submit(long + long)
        results = await first.results()
    assert [r.status for r in results] == ["ok"] * 4
    assert all(len(r.token_ids) == 60 for r in results)


async def test_cancel_releases_sessions(tiny_model: Path, sock_dir: Path) -> None:
    cfg = make_config(tiny_model, sock_dir, scheduler={"max_active_sessions": 2})
    items = [
        Item(custom_id=str(i), prompt="go", max_new_tokens=1500, ignore_eos=True) for i in range(4)
    ]
    async with running(cfg) as daemon, connected(daemon) as client:
        job = await client.submit(items)
        async for ev in job.events():
            if isinstance(ev, p.TokenDelta):
                break
        await client.cancel(job.job_id)
        results = await job.results()
        status = await client.status()
        with pytest.raises(NotFound):
            await client.cancel("no-such-job")
    assert [r.error.code if r.error else None for r in results] == ["cancelled"] * 4
    assert status.kv_bytes_in_use == 0 and status.sessions_active == 0


async def test_wrong_protocol_version_is_refused(tiny_model: Path, sock_dir: Path) -> None:
    async with running(make_config(tiny_model, sock_dir)) as daemon:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(daemon.endpoint)
        try:
            await sock.send(p.encode(p.Hello(id=7, version=p.PROTOCOL_VERSION + 1)))
            with anyio.fail_after(5):
                reply = p.decode_reply(await sock.recv())
        finally:
            sock.close(linger=0)
            ctx.term()
    assert isinstance(reply, p.ErrorReply) and reply.id == 7
    assert reply.error.code == VersionMismatch.code


async def test_unreachable_daemon_is_named_quickly(sock_dir: Path) -> None:
    from kvmux.client import DaemonUnreachable

    missing = f"ipc://{sock_dir}/nobody.sock"
    with anyio.fail_after(5), pytest.raises(DaemonUnreachable, match=r"nobody\.sock"):
        await Client(missing, timeout=1.0).connect()
    # A socket file with nobody behind it (a crashed daemon's leftover) times out.
    (sock_dir / "stale.sock").touch()
    with anyio.fail_after(5), pytest.raises(DaemonUnreachable, match="no answer within"):
        await Client(f"ipc://{sock_dir}/stale.sock", timeout=0.5).connect()


@pytest.mark.parametrize(
    ("failpoint", "code"), [("engine.run", "run_failed"), ("engine.step", "internal")]
)
async def test_a_failing_session_fails_its_item_alone(
    tiny_model: Path, sock_dir: Path, reference: Engine, failpoint: str, code: str
) -> None:
    """A model run that fails is a typed ``run_failed``; an unexpected exception inside a
    session is ``internal`` — logged with its traceback, none sent to the client."""
    items = [
        Item(custom_id="first", prompt="fails", max_new_tokens=10),
        Item(custom_id="second", prompt="survives", max_new_tokens=25, temperature=0.0),
    ]
    # engine.step: item 0's step, the first of the turn. engine.run: the two first
    # prompts share a run; its failure splits it, and item 0's run fails alone.
    failpoints.arm(failpoint, 2 if failpoint == "engine.run" else 1)
    with structlog.testing.capture_logs() as logs:
        async with (
            running(make_config(tiny_model, sock_dir)) as daemon,
            connected(daemon) as client,
        ):
            results = await (await client.submit(items)).results()
            status = await client.status()
    first, second = results
    assert first.error is not None and first.error.code == code
    assert "Traceback" not in first.error.message
    assert second.token_ids == decode_alone(reference, items[1])
    assert status.kv_bytes_in_use == 0
    if code == "internal":
        (logged,) = [e for e in logs if e["event"] == "internal_error"]
        assert logged["session_id"].endswith("/0") and logged["exc_info"] is not None


async def test_finished_jobs_are_kept_within_their_bounds(tiny_model: Path, sock_dir: Path) -> None:
    """Results stay for re-attach, but the oldest go once the jobs' tokens pass the bound."""
    cfg = make_config(tiny_model, sock_dir, jobs={"max_retained_tokens": 100})
    item = Item(prompt="keep", max_new_tokens=40, ignore_eos=True)
    async with running(cfg) as daemon, connected(daemon) as client:
        jobs = []
        for _ in range(4):
            job = await client.submit([item])
            await job.results()
            jobs.append(job.job_id)
        status = await client.status()
        # 4 x 40 tokens: the oldest two went, the newest two (80 tokens) stay.
        with pytest.raises(NotFound, match="max_retained_tokens"):
            await client.attach(jobs[0])
        with pytest.raises(NotFound):
            await client.attach(jobs[1])
        for job_id in jobs[2:]:
            (result,) = await (await client.attach(job_id)).results()
            assert len(result.token_ids) == 40
    assert status.jobs_retained == 2


async def test_results_of_items_ending_together_go_out_before_their_releases(
    tiny_model: Path, sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Items that end at one step: their results are handed to the client before their
    sessions are released and their lines logged (the bookkeeping of 16 endings took
    ~1.7 ms the client waited for), and no one sees the difference: after the results,
    nothing is charged, and each item's line comes before its job's."""
    from kvmux.daemon.engine import DecodeSession
    from kvmux.daemon.scheduler._outbox import Outbox

    order: list[str] = []
    flush, release = Outbox.flush, DecodeSession.release

    def flushed(self: Outbox) -> None:
        ends = [
            ev.result.index
            for batch in self._events.values()
            for ev in batch
            if isinstance(ev, p.ItemFinished)
        ]
        order.extend(f"result {i}" for i in ends)
        flush(self)

    def released(self: DecodeSession) -> None:
        order.append(f"release {self.session_id.rsplit('/', 1)[1]}")
        release(self)

    monkeypatch.setattr(Outbox, "flush", flushed)
    monkeypatch.setattr(DecodeSession, "release", released)
    items = [
        Item(
            custom_id=str(i),
            prompt_tokens=token_prompt(8, i),
            max_new_tokens=20,
            ignore_eos=True,
            temperature=0.0,
        )
        for i in range(4)
    ]
    cfg = make_config(tiny_model, sock_dir, kv={"prefix_cache": False})
    with structlog.testing.capture_logs() as logs:
        async with running(cfg) as daemon, connected(daemon) as client:
            results = await (await client.submit(items)).results()
            status = await client.status()
    assert [r.status for r in results] == ["ok"] * 4
    assert status.kv_bytes_in_use == 0 and status.sessions_active == 0
    ended = [e for e in order if e.startswith("result")]
    assert sorted(ended) == [f"result {i}" for i in range(4)]
    # All four ended in one pass: every result out before the first release.
    assert order.index("release 0") > max(order.index(e) for e in ended)
    assert sorted(e for e in order if e.startswith("release")) == [f"release {i}" for i in range(4)]
    lines = [e["event"] for e in logs if e["event"] in ("session_finished", "job_finished")]
    assert lines == ["session_finished"] * 4 + ["job_finished"]
