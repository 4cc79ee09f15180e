"""``kvmux generate "prompt"``: one completion, streamed to stdout as the daemon decodes it."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import msgspec

from .. import protocol as p
from .connect import INTERRUPTED, ITEMS_FAILED, OK, CliError, open_client
from .interrupt import goodbye, goodbye_left


def item_from_args(args: argparse.Namespace) -> p.Item:
    """The one item the command line describes; a bad value ends the command naming it."""
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    item = p.Item(
        custom_id="generate",
        prompt=prompt,
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
    item = item_from_args(args)
    client = await open_client(args.endpoint, args.timeout)
    out = sys.stdout
    shown = ""
    started = time.monotonic()
    try:
        job = await client.submit([item])
        result: p.ItemResult | None = None
        try:
            async for event in job.events():
                match event:
                    case p.TokenDelta(text=text) if text:
                        out.write(text)
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
        out.write(result.text[len(shown) :])
    if out.isatty():
        out.write("\n")  # keep the shell prompt off the completion's last line
    out.flush()
    if result.error is not None:
        print(f"kvmux: {result.error.code}: {result.error.message}", file=sys.stderr)
        return ITEMS_FAILED
    if sys.stderr.isatty():
        usage = result.usage
        n = usage.completion_tokens if usage else len(result.token_ids)
        print(
            f"[{n} tokens, finish: {result.finish_reason}, {time.monotonic() - started:.2f} s]",
            file=sys.stderr,
        )
    return OK
