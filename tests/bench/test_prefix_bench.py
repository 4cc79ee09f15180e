"""``bench.bench_prefix`` small, on ``tiny``: both kvmuxd processes give the same tokens, and
the tallies it reports are the cache's (shared prompts copied, nothing copied unshared)."""

from __future__ import annotations

import anyio
import pytest

from bench import bench_prefix


@pytest.mark.slow
def test_the_prefix_bench_runs_and_reports_what_the_cache_did() -> None:
    parsed = bench_prefix.parse_args(
        [
            "--model",
            "tiny",
            "--items",
            "24",
            "--system",
            "200",
            "--lines",
            "6",
            "--choice-prompt",
            "96",
            "--unshared",
            "12",
            "--unshared-prompt",
            "64",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--no-genai",
        ]
    )
    out = anyio.run(bench_prefix.bench, parsed)
    assert out["shared_tokens_equal"] and out["choices_tokens_equal"]
    assert out["unshared_tokens_equal"]
    shared = out["shared"]["on"]["cache"]
    # All but the first item copy the system prompt's 12 whole blocks of 16.
    assert shared["hit_tokens"] == 23 * 192 and shared["fork_failures"] == 0
    assert shared["kept_entries_at_end"] >= 1 and shared["kept_bytes_at_end"] > 0
    choices = out["choices"]["on"]["cache"]
    assert choices["hit_tokens"] == 6 * 3 * 94  # 3 choices of each line copy 94 of 96
    assert out["unshared"]["on"]["cache"]["hit_tokens"] == 0
