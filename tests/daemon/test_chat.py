"""Chat items and vLLM's sampling parameters through a real daemon on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from kvmux.client import Item, ItemResult
from kvmux.client import protocol as p
from kvmux.daemon.engine import Engine
from kvmux.daemon.journal import Journal
from kvmux.daemon.scheduler import item_params, item_prompt

from .conftest import connected, make_config, running

replace = msgspec.structs.replace

pytestmark = pytest.mark.anyio

CHAT = [
    p.ChatMessage(role="system", content="Answer in one word."),
    p.ChatMessage(role="user", content="Which colour is the sky?", name="ann"),
]
RENDERED = "<s><|system|>\nAnswer in one word.\n<|user|>\nWhich colour is the sky?\n<|assistant|>\n"


def alone(reference: Engine, item: Item) -> list[int]:
    """The tokens ``item`` gets from the engine in this process, with every parameter."""
    return reference.generate(
        item_prompt(reference, item), item_params(item), max_context=item.max_context
    ).token_ids


def by_id(results: list[ItemResult]) -> dict[str, ItemResult]:
    return {r.custom_id: r for r in results}


def without_template(tiny_model: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "no-template"
    folder.mkdir()
    for f in tiny_model.iterdir():
        if f.name != "chat_template.jinja":
            (folder / f.name).symlink_to(f)
    return folder


async def test_a_chat_item_decodes_as_its_rendered_prompt(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    assert reference.render_chat([msgspec.structs.asdict(m) for m in CHAT]) == RENDERED
    base = Item(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    items = [
        replace(base, custom_id="chat", messages=CHAT, line=3, choice=1, choices=2),
        replace(base, custom_id="text", prompt=RENDERED, line=4),
    ]
    async with running(make_config(tiny_model, sock_dir)) as daemon, connected(daemon) as c:
        results = by_id(await (await c.submit(items)).results())
    chat, text = results["chat"], results["text"]
    assert chat.status == text.status == "ok"
    assert chat.token_ids == text.token_ids == alone(reference, items[1])
    assert chat.text == text.text
    assert chat.usage is not None and chat.usage.prompt_tokens == len(reference.encode(RENDERED))
    # The same 80 prompt tokens: the second item starts on the first one's prefill of all
    # but the last two (see DecodeSession.fork_tokens).
    assert text.usage == replace(chat.usage, cached_tokens=chat.usage.prompt_tokens - 2)
    assert (chat.chat, chat.line, chat.choice, chat.choices) == (True, 3, 1, 2)
    assert (text.chat, text.line, text.choice, text.choices) == (False, 4, 0, 1)


async def test_template_failures_fail_their_item_alone(
    tiny_model: Path, sock_dir: Path, tmp_path: Path, reference: Engine
) -> None:
    hostile = tmp_path / "hostile.jinja"
    hostile.write_text(
        "{% if messages[0]['content'] == 'escape' %}{{ ''.__class__.__mro__ }}{% endif %}"
        "{% if messages[0]['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}",
        encoding="utf-8",
    )
    ok = Item(custom_id="ok", prompt="plain text", max_new_tokens=8, temperature=0.0, line=1)
    items = [
        Item(custom_id="escape", messages=[p.ChatMessage(role="user", content="escape")], line=2),
        Item(custom_id="tool", messages=[p.ChatMessage(role="tool", content="x")], line=3),
        ok,
        Item(custom_id="fine", messages=[p.ChatMessage(role="user", content="hi")], line=4),
    ]
    cfg = make_config(tiny_model, sock_dir)
    cfg = msgspec.structs.replace(
        cfg, model=msgspec.structs.replace(cfg.model, chat_template=str(hostile))
    )
    async with running(cfg) as daemon, connected(daemon) as c:
        results = by_id(await (await c.submit(items)).results())
    for name, needle in (("escape", "unsafe"), ("tool", "no tools here")):
        r = results[name]
        assert r.status == "error" and r.error is not None
        assert r.error.code == "bad_request" and needle in r.error.message
        assert r.chat and r.line == items[[i.custom_id for i in items].index(name)].line
    assert results["ok"].status == "ok"
    assert results["ok"].token_ids == alone(reference, ok)
    fine = results["fine"]
    assert fine.status == "ok" and fine.usage is not None
    # The configured template was the one used: "[user] hi\n" is 10 byte tokens.
    assert fine.usage.prompt_tokens == len(reference.encode("[user] hi\n")) == 10


async def test_a_model_without_a_template_names_the_fix(
    tiny_model: Path, sock_dir: Path, tmp_path: Path
) -> None:
    items = [
        Item(custom_id="chat", messages=CHAT, line=1),
        Item(custom_id="text", prompt="hello", max_new_tokens=4, line=2),
    ]
    cfg = make_config(without_template(tiny_model, tmp_path), sock_dir)
    async with running(cfg) as daemon, connected(daemon) as c:
        results = by_id(await (await c.submit(items)).results())
    chat = results["chat"]
    assert chat.status == "error" and chat.error is not None
    assert chat.error.code == "bad_request"
    assert 'model.chat_template = "FILE"' in chat.error.message and "kvmuxd.toml" in (
        chat.error.message
    )
    assert chat.chat and chat.line == 1
    assert results["text"].status == "ok" and len(results["text"].token_ids) == 4


async def test_a_rendered_chat_over_the_prompt_cap_is_refused(
    tiny_model: Path, sock_dir: Path
) -> None:
    cfg = make_config(tiny_model, sock_dir, scheduler={"max_prompt_tokens": 40})
    long = Item(custom_id="long", messages=[p.ChatMessage(role="user", content="y" * 200)])
    async with running(cfg) as daemon, connected(daemon) as c:
        (result,) = await (await c.submit([long])).results()
    assert result.status == "error" and result.error is not None
    assert "scheduler.max_prompt_tokens" in result.error.message


async def test_sampling_parameters_and_logprobs_through_the_daemon(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    base = Item(prompt="The sky is", max_new_tokens=16, ignore_eos=True, temperature=0.0)
    items = [
        replace(base, custom_id="rep", repetition_penalty=1.7),
        replace(base, custom_id="pres", presence_penalty=-2.0, frequency_penalty=-1.0),
        replace(base, custom_id="minp", temperature=1.5, top_k=0, min_p=0.2, seed=4),
        replace(base, custom_id="lp", logprobs=3),
        replace(base, custom_id="plain"),
    ]
    async with running(make_config(tiny_model, sock_dir)) as daemon, connected(daemon) as c:
        results = by_id(await (await c.submit(items)).results())
    for item in items:
        r = results[item.custom_id]
        assert r.status == "ok", r.error
        assert r.token_ids == alone(reference, item), item.custom_id
    assert results["rep"].token_ids != results["plain"].token_ids
    assert results["pres"].token_ids != results["plain"].token_ids
    lp = results["lp"].logprobs
    assert lp is not None and [e.token_id for e in lp] == results["lp"].token_ids
    assert all(len(e.top) == 3 and e.top[0].logprob >= e.logprob for e in lp)
    assert all(e.token == reference.tokenizer.token_text(e.token_id) for e in lp)
    assert results["plain"].logprobs is None
    # On the wire a step is compact: [id, text, logprob, [[id, text, logprob], ...]].
    wire = msgspec.msgpack.decode(p.encode(results["lp"]))
    assert wire["logprobs"][0][0] == lp[0].token_id and len(wire["logprobs"][0][3]) == 3
    assert json.loads(msgspec.json.encode(lp[0]))[2] == pytest.approx(lp[0].logprob)


async def test_a_stop_token_id_finishes_the_item(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    plain = Item(prompt="Hello", max_new_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = alone(reference, plain)
    at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    stopped = msgspec.structs.replace(plain, custom_id="s", stop_token_ids=[tokens[at]])
    held = msgspec.structs.replace(
        plain, custom_id="m", stop_token_ids=[tokens[0]], min_new_tokens=3
    )
    async with running(make_config(tiny_model, sock_dir)) as daemon, connected(daemon) as c:
        results = by_id(await (await c.submit([stopped, held])).results())
    assert results["s"].token_ids == tokens[:at] and results["s"].finish_reason == "stop"
    assert len(results["m"].token_ids) >= 3 and tokens[0] not in results["m"].token_ids[:3]
    assert results["m"].token_ids == alone(reference, held)


async def test_the_journal_keeps_chat_items_and_their_results(
    tiny_model: Path, sock_dir: Path
) -> None:
    path = sock_dir / "jobs.sqlite3"
    item = Item(
        custom_id="c",
        messages=CHAT,
        max_new_tokens=6,
        temperature=0.8,
        repetition_penalty=1.3,
        stop_token_ids=[7],
        logprobs=2,
        line=9,
        choice=1,
        choices=3,
    )
    cfg = make_config(tiny_model, sock_dir, jobs={"journal": str(path)})
    async with running(cfg) as daemon, connected(daemon) as c:
        (result,) = await (await c.submit([item], detach=True)).results()
    assert result.status == "ok" and result.seed is not None
    journal = Journal(path)
    try:
        (job,) = journal.load()
    finally:
        journal.close()
    (kept,) = job.items
    # Stored whole, with the seed the daemon chose, so a replay draws the same tokens.
    assert kept == msgspec.structs.replace(item, seed=result.seed)
    assert job.results[0] == result
    assert result.chat and result.line == 9 and result.choices == 3
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
