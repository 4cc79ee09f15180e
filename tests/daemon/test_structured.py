"""Structured outputs through a real kvmuxd: every kind over the wire, bad specs failing
alone before any session, unconstrained neighbours untouched, and a SIGKILL survived."""

from __future__ import annotations

import json
import re
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio
import jsonschema
import msgspec
import pytest

from bench.bench_daemon import kvmuxd
from kvmux.client import Client, Item, ItemResult, StructuredOutputs
from kvmux.client import protocol as p
from kvmux.daemon.engine import Engine

from .conftest import connected, make_config, running
from .helpers import decode_alone, token_prompt

pytestmark = pytest.mark.anyio

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}


def person(custom_id: str, i: int, **kw: object) -> Item:
    fields: dict[str, object] = {
        "custom_id": custom_id,
        "prompt_tokens": token_prompt(5 + i % 7, seed=i),
        "max_new_tokens": 160,
        "structured_outputs": StructuredOutputs(json=PERSON),
        **kw,
    }
    return Item(**fields)  # type: ignore[arg-type]


def check_person(result: ItemResult) -> None:
    assert result.status == "ok", result.error
    assert result.finish_reason == "stop", result
    jsonschema.validate(json.loads(result.text), PERSON)


async def test_every_kind_over_the_wire_matches_and_equals_the_engine_alone(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    kinds = [
        StructuredOutputs(json=PERSON),
        StructuredOutputs(json=json.dumps(PERSON)),
        StructuredOutputs(json_object=True),
        StructuredOutputs(regex=r"[a-z]{2,6}-[0-9]{3}"),
        StructuredOutputs(choice=["alpha", "beta", "gamma"]),
        StructuredOutputs(grammar='root ::= "v" [0-9] "." [0-9]'),
        StructuredOutputs(grammar='start: "k=" /[xyz]{3}/'),
    ]
    items = [
        Item(
            custom_id=f"{k}-{t}",
            prompt_tokens=token_prompt(6, seed=k * 10 + t),
            max_new_tokens=120,
            temperature=0.8 * t,
            seed=k,
            structured_outputs=so,
        )
        for k, so in enumerate(kinds)
        for t in (0, 1)
    ]
    async with running(make_config(tiny_model, sock_dir)) as daemon, connected(daemon) as client:
        results = await (await client.submit(items)).results()
    by_id = {r.custom_id: r for r in results}
    for item in items:
        r = by_id[item.custom_id]
        assert r.status == "ok", r.error
        assert r.token_ids == decode_alone(reference, item), item.custom_id
        so = item.structured_outputs
        assert so is not None
        if so.json is not None:
            check_person(r)
        elif r.finish_reason == "stop" and so.json_object:
            assert isinstance(json.loads(r.text), dict)
        elif so.regex is not None:
            assert re.fullmatch(so.regex, r.text)
        elif so.choice is not None:
            assert r.text in so.choice
        elif so.grammar is not None:
            assert re.fullmatch(r"v[0-9]\.[0-9]|k=[xyz]{3}", r.text), r.text


async def test_bad_specs_fail_alone_before_any_session_and_a_shared_schema_compiles_once(
    tiny_model: Path, sock_dir: Path
) -> None:
    bad = {
        "schema": StructuredOutputs(json={"type": "objekt"}),
        "regex": StructuredOutputs(regex="a(b"),
        "grammar": StructuredOutputs(grammar="start: nowhere"),
        "two": StructuredOutputs(regex="a", choice=["a"]),
        "notjson": StructuredOutputs(json="{nope"),
    }
    good = [person(f"ok{i}", i, temperature=0.7, seed=i) for i in range(40)]
    items = good[:20] + [
        Item(custom_id=k, prompt="x", max_new_tokens=8, structured_outputs=so)
        for k, so in bad.items()
    ] + good[20:]  # fmt: skip
    async with running(make_config(tiny_model, sock_dir)) as daemon, connected(daemon) as client:
        assert daemon.engine is not None
        compiled = daemon.engine.structured.compiled
        job = await client.submit(items)
        started: set[int] = set()
        async for event in job.events():
            if isinstance(event, p.ItemStarted):
                started.add(event.index)
        results = await job.results()
        compiled = daemon.engine.structured.compiled - compiled
    by_id = {r.custom_id: r for r in results}
    wrong = {
        "schema": "Invalid type: objekt",
        "regex": "unclosed group",
        "grammar": 'unknown name: "nowhere"',
        "two": "one kind of constraint",
        "notjson": "not valid JSON",
    }
    for key, why in wrong.items():
        r = by_id[key]
        assert r.status == "error" and r.error is not None
        assert r.error.code == "bad_request" and why in r.error.message, r.error
        assert r.index not in started and r.usage is None
    for item in good:
        check_person(by_id[item.custom_id])
    # One schema for 40 items, plus the three bad specs that reach the compiler.
    assert compiled == 4


async def test_unconstrained_items_keep_their_tokens_beside_constrained_ones(
    tiny_model: Path, sock_dir: Path
) -> None:
    plain = [
        Item(
            custom_id=f"p{i}",
            prompt_tokens=token_prompt(4 + i, seed=100 + i),
            max_new_tokens=60,
            temperature=0.0 if i % 2 else 0.9,
            seed=i,
            ignore_eos=True,
        )
        for i in range(8)
    ]
    constrained = [person(f"c{i}", i, temperature=0.9, seed=i) for i in range(8)]
    mixed = [x for pair in zip(plain, constrained, strict=True) for x in pair]
    cfg = make_config(tiny_model, sock_dir, kv={"min_bucket": 256})
    async with running(cfg) as daemon, connected(daemon) as client:
        alone = await (await client.submit(plain)).results()
        together = await (await client.submit(mixed)).results()
        assert daemon.engine is not None
        runner = daemon.engine.runner
        assert runner.rows_run > runner.runs  # rows shared runs
    want = {r.custom_id: r.token_ids for r in alone}
    got = {r.custom_id: r for r in together}
    for item in plain:
        assert got[item.custom_id].token_ids == want[item.custom_id]
    for item in constrained:
        check_person(got[item.custom_id])


async def test_n_logprobs_prefix_cache_and_cancel(tiny_model: Path, sock_dir: Path) -> None:
    shared = token_prompt(40, seed=7)
    first = person("a", 0, prompt_tokens=shared, temperature=0.9, seed=1, logprobs=2)
    again = person("b", 0, prompt_tokens=shared, temperature=0.9, seed=1, logprobs=2)
    choices = [
        person(f"n{j}", 0, prompt_tokens=shared, temperature=1.0, seed=5 + j, choice=j, choices=3)
        for j in range(3)
    ]
    endless = Item(
        custom_id="long",
        prompt="go",
        max_new_tokens=3000,
        structured_outputs=StructuredOutputs(regex="[a-z]{2900}"),
    )
    async with running(make_config(tiny_model, sock_dir)) as daemon, connected(daemon) as client:
        (a,) = await (await client.submit([first])).results()
        (b,) = await (await client.submit([again])).results()
        many = await (await client.submit(choices)).results()
        job = await client.submit([endless])
        async for event in job.events():
            if isinstance(event, p.TokenDelta):
                await client.cancel(job.job_id)
                break
        (cut,) = await job.results()
    check_person(a)
    assert b.token_ids == a.token_ids  # same seed, same grammar: the same answer
    assert a.logprobs is not None and len(a.logprobs) == len(a.token_ids)
    assert all(t.top and all(c.logprob > float("-inf") for c in t.top) for t in a.logprobs)
    for r in many:
        check_person(r)
    assert len({r.text for r in many}) > 1
    # Choices of one prompt share its prefill through the prefix cache.
    assert sum(r.usage.cached_tokens for r in many if r.usage is not None) > 0
    assert cut.error is not None and cut.error.code == "cancelled"
    assert re.fullmatch("[a-z]*", cut.text) and len(cut.token_ids) < 2900


@pytest.fixture
def state() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_sigkilled_constrained_items_resume_with_the_output_of_an_uninterrupted_run(
    tiny_model: Path, state: Path, reference: Engine
) -> None:
    """An item in progress at the kill decodes again from its journaled item (its seed
    resolved), its matcher rebuilt and fed the same tokens: the uninterrupted output."""
    endpoint = f"ipc://{state}/kvmuxd.sock"
    tables: dict[str, dict[str, object]] = {
        "kv": {"min_bucket": 8},
        "scheduler": {"max_active_sessions": 8},
        "jobs": {"journal": str(state / "jobs.sqlite3")},
        "shutdown": {"grace": 0.5},
    }
    items = [
        person(f"i{i}", i, temperature=0.0 if i % 3 == 0 else 0.9, seed=i if i % 3 == 1 else None)
        for i in range(60)
    ]
    with anyio.fail_after(240):
        async with kvmuxd(tiny_model, threads=1, tables=tables, endpoint=endpoint) as d:
            async with Client(endpoint, timeout=30.0) as client:
                job = await client.submit(items, detach=True)
                async for event in job.events():
                    if isinstance(event, p.ItemFinished):
                        break  # some done, some decoding, some queued
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait()
        async with (
            kvmuxd(tiny_model, threads=1, tables=tables, endpoint=endpoint),
            Client(endpoint, timeout=30.0) as client,
        ):
            results = await (await client.attach(job.job_id)).results()
    assert sorted(r.index for r in results) == list(range(len(items)))
    for item, r in zip(items, sorted(results, key=lambda r: r.index), strict=True):
        check_person(r)
        assert r.token_ids == decode_alone(reference, msgspec.structs.replace(item, seed=r.seed))
