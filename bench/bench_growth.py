"""Host KV growth cost per bucket, as bytes/s against numpy.copyto of the same bytes.

Both sides are measured in the same run, interleaved, so the ratio survives
the ±30% drift of a shared machine. Usage: python -m bench.bench_growth [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench.common import write_json
from kvmux.kv import HostKvCache, KvSpec, ensure_capacity, resolve_hard_max

# One Llama-8B-like layer group: 8 KV heads of 128, fp16. Four layers keep a
# 16k-token grow around 128 MiB of new buffers on a 24 GiB machine.
SPEC = KvSpec(num_layers=4, kv_heads=8, head_dim=128, dtype="float16")


def _grow_once(capacity: int) -> tuple[float, int]:
    cache = HostKvCache(SPEC, resolve_hard_max(None, None), min_bucket=capacity)
    ensure_capacity(cache, capacity)
    cache.advance(capacity)
    t0 = time.perf_counter()
    result = ensure_capacity(cache, capacity + 1)
    elapsed = time.perf_counter() - t0
    cache.release()
    return elapsed, result.bytes_copied


def _copyto_once(capacity: int, fresh: bool) -> float:
    shape = SPEC.buffer_shape(capacity)
    srcs = [np.ones(shape, dtype=np.float16) for _ in range(2 * SPEC.num_layers)]
    new_shape = SPEC.buffer_shape(2 * capacity)
    dsts = [] if fresh else [np.empty(new_shape, np.float16) for _ in srcs]
    for d in dsts:
        d.fill(0)  # fault the pages in: the warm baseline copies into touched memory
    t0 = time.perf_counter()
    for i, s in enumerate(srcs):
        d = np.empty(new_shape, np.float16) if fresh else dsts[i]
        np.copyto(d[:, :, :capacity, :], s)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    args = ap.parse_args(argv)
    sizes = [256, 1024, 4096] if args.quick else [256, 1024, 4096, 8192, 16384]
    repeats = 3 if args.quick else 7
    rows = []
    print(f"KV growth, host backend, {SPEC} ({SPEC.kv_bytes_per_token} KV bytes/token)")
    print(
        f"{'grow':>15} {'copied':>10} {'grow GB/s':>10} {'copyto fresh':>13} {'copyto warm':>12}"
        f" {'vs fresh':>9} {'vs warm':>8}"
    )
    for c in sizes:
        grow, fresh, warm = [], [], []
        copied = 0
        for _ in range(repeats):
            t, copied = _grow_once(c)
            grow.append(t)
            fresh.append(_copyto_once(c, fresh=True))
            warm.append(_copyto_once(c, fresh=False))
        g, f, w = (statistics.median(x) for x in (grow, fresh, warm))
        row = {
            "old_capacity": c,
            "new_capacity": 2 * c,
            "bytes_copied": copied,
            "grow_s": g,
            "copyto_fresh_s": f,
            "copyto_warm_s": w,
            "grow_bytes_per_s": copied / g,
            "ratio_vs_fresh": f / g,
            "ratio_vs_warm": w / g,
        }
        rows.append(row)
        print(
            f"{c:>6} -> {2 * c:>6} {copied / 2**20:>8.1f}Mi {copied / g / 1e9:>10.2f} "
            f"{copied / f / 1e9:>11.2f}GB/s {copied / w / 1e9:>10.2f}GB/s"
            f" {f / g:>9.2f} {w / g:>8.2f}"
        )
    print("ratio = copyto time / growth time (1.0 = growth costs what the bare copy costs)")
    print(f"written {write_json('growth', {'spec': str(SPEC), 'rows': rows})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
