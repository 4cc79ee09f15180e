"""``kvmux generate "prompt"``: one completion, streamed to stdout as the daemon decodes it."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import msgspec

from .. import protocol as p
from ..printable import printable
from .connect import INTERRUPTED, ITEMS_FAILED, OK, CliError, open_client
from .interrupt import goodbye, goodbye_left


def item_from_args(args: argparse.Namespace, *, chat: bool) -> p.Item:
    """The one item the command line describes; a bad value ends the command naming it.

    With ``chat`` (the model has a chat template, and no ``--raw``) the prompt is a
    user message, after ``--system``'s, as ``ollama run`` and llama.cpp's conversation
    mode send it: an instruct model given bare text often ends at once."""
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.system is not None and not chat:
        why = "--raw sends the prompt as it is" if args.raw else "the model has no chat template"
        raise CliError(f"--system needs the model's chat template, and {why}")
    messages = None
    if chat:
        system = [] if args.system is None else [p.ChatMessage(role="system", content=args.system)]
        messages = [*system, p.ChatMessage(role="user", content=prompt)]
    item = p.Item(
        custom_id="generate",
        prompt=None if chat else prompt,
        messages=messages,
        max_new_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=list(args.stop),
        max_context=args.max_context,
        ignore_eos=args.ignore_eos,
    )
    try:
        return p.check_item(item)
    except (msgspec.ValidationError, ValueError) as exc:
        raise CliError(f"invalid option: {exc}") from None


async def generate(args: argparse.Namespace) -> int:
    client = await open_client(args.endpoint, args.timeout)
    out = sys.stdout
    # On a terminal, control bytes of a model's output are shown, not obeyed.
    shows = printable if out.isatty() else str
    shown = ""
    started = time.monotonic()
    try:
        chat = not args.raw and (await client.status()).chat_template
        item = item_from_args(args, chat=chat)
        job = await client.submit([item])
        result: p.ItemResult | None = None
        try:
            async for event in job.events():
                match event:
                    case p.TokenDelta(text=text) if text:
                        out.write(shows(text))
                        out.flush()
                        shown += text
                    case p.ItemFinished(result=finished):
                        result = finished
            if result is None:  # the stream dropped it; the job keeps every result
                (result,) = await job.results()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            said = await goodbye(client, client.cancel(job.job_id))
            what = "cancelled" if said else "cancel not confirmed by kvmuxd"
            print(f"\nkvmux: interrupted ({what})", file=sys.stderr)
            return INTERRUPTED
    finally:
        await client.close(goodbye=goodbye_left())
    # The final text can hold what the last delta had not completed yet
    # (a multi-byte character cut at the step boundary).
    if result.text.startswith(shown) and len(result.text) > len(shown):
        out.write(shows(result.text[len(shown) :]))
    if out.isatty():
        out.write("\n")  # keep the shell prompt off the completion's last line
    out.flush()
    if result.error is not None:
        print(f"kvmux: {result.error.code}: {result.error.message}", file=sys.stderr)
        return ITEMS_FAILED
    usage = result.usage
    n = usage.completion_tokens if usage else len(result.token_ids)
    if n == 0:
        print(f"kvmux: {_why_nothing(result, chat=chat)}", file=sys.stderr)
    elif sys.stderr.isatty():
        print(
            f"[{n} tokens, finish: {result.finish_reason}, {time.monotonic() - started:.2f} s]",
            file=sys.stderr,
        )
    return OK


def _why_nothing(result: p.ItemResult, *, chat: bool) -> str:
    """What a run that produced no token says: why it ended, and what to try."""
    if result.finish_reason == "stop":
        why = "the model's first token was its end of sequence"
    else:
        why = f"it finished at once ({result.finish_reason})"
    if chat:
        hint = "the prompt went in as a user message of the model's chat template (--raw: as is)"
    else:
        hint = (
            "the prompt went in as plain text: an instruct model may need its chat template "
            "(leave out --raw), a base model a longer start"
        )
    return f"no tokens generated: {why}; {hint}"
