"""Every family onnxruntime-genai's builder exports, at every CPU precision, through kvmux.

For each family of ``tests/genai/matrix.py`` (a small random-weight model
from the family's transformers config, exported offline by the builder and
cached under ``models/genai-matrix``) and each precision (fp32, fp16, int4):
load it in kvmux; if kvmux accepts it, decode greedily through the
``Engine`` and through a ``kvmuxd`` process (first bucket 8, prefill chunks
of 8, so the KV grows several times) and compare token for token with
onnxruntime-genai's Generator.

Prints the markdown table that docs/models.md carries between its
``model-matrix`` markers; ``--write`` puts it there, ``--check`` exits 1 if
docs/models.md holds another table (distinct-token counts aside: an int4 export's
depend on the CPU) or if any entry decodes differently from the Generator
(CI runs that). Timings go to stderr and bench/results/.
Needs the [genai] extra. Usage:
    python -m bench.model_matrix [--families llama,gemma2] [--precisions fp32,int4]
        [--write | --check]
"""

from __future__ import annotations

import argparse
import re
import sys
import time

from bench.common import ROOT, write_json
from tests.genai import matrix as m

PAGE = ROOT / "docs" / "models.md"
BEGIN = "<!-- model-matrix:begin (python -m bench.model_matrix --write) -->"
END = "<!-- model-matrix:end -->"

_CELL = {
    m.IDENTICAL: "identical",
    m.CAPPED: "identical up to the window (context capped)",
    m.REFUSED: "refused",
    m.NOT_EXPORTABLE: "not exportable",
    m.DIFFERS: "**DIFFERS**",
    m.GENERATOR_FAILS: "**Generator fails**",
    m.REPETITIVE: "**too repetitive to compare**",
}


def cell(o: m.Outcome) -> str:
    if o.status == m.IDENTICAL:
        logits = "logits bit-equal" if o.logit_diff == 0.0 else f"logits within {o.logit_diff:.0e}"
        return (
            f"identical ({o.new_tokens} tokens, {o.distinct} distinct, {o.growths} growths, "
            f"{logits})"
        )
    if o.status == m.CAPPED:
        return f"identical up to the window ({o.new_tokens} tokens, then capped)"
    return _CELL[o.status]


def why(o: m.Outcome) -> str | None:
    """The reason under the table for entries that are not a plain match."""
    if o.status in (m.IDENTICAL,):
        return None
    return f"{o.status}: {o.detail}"


def table(outcomes: list[m.Outcome], precisions: list[str]) -> str:
    by = {(o.family, o.precision): o for o in outcomes}
    families = list(dict.fromkeys(o.family for o in outcomes))
    lines = [
        "| family | what the test config exercises | " + " | ".join(precisions) + " |",
        "| --- | --- | " + " | ".join("---" for _ in precisions) + " |",
    ]
    notes: dict[str, list[str]] = {}
    for name in families:
        cells = []
        for precision in precisions:
            o = by[(name, precision)]
            text = cell(o)
            reason = why(o)
            if reason is not None:
                notes.setdefault(reason, []).append(f"{name} {precision}")
                text += f" [{list(notes).index(reason) + 1}]"
            cells.append(text)
        peculiarity = m.BY_NAME[name].peculiarity
        lines.append(f"| {name} | {peculiarity} | " + " | ".join(cells) + " |")
    lines.append("")
    for i, (reason, entries) in enumerate(notes.items(), 1):
        lines.append(f"[{i}] {', '.join(entries)}: {reason}")
        lines.append("")
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    summary = ", ".join(f"{n} {status}" for status, n in counts.items())
    lines.append(
        f"{len(families)} families x {len(precisions)} precisions: {summary}. Every "
        f"identical entry decodes {m.MIN_NEW}+ new tokens ({m.MIN_DISTINCT}+ distinct) "
        f"across {m.MIN_GROWTHS}+ KV growths "
        f"(first bucket {m.MIN_BUCKET}, prefill chunks of {m.PREFILL_CHUNK}), through "
        "`Engine` and through `kvmuxd`."
    )
    return "\n".join(lines)


# An int4 export's MatMulNBits runs at accuracy_level 4: activations are
# quantized to int8 by kernels that differ per instruction set (AVX-512 VNNI,
# AVX-VNNI, AVX2), so its greedy tokens, and so their distinct count, depend
# on the CPU, for the Generator and kvmux alike. --check compares the table
# without those counts; the 20+ floor is checked for every entry regardless.
_DISTINCT = re.compile(r", \d+ distinct,")


def comparable(block: str) -> str:
    return _DISTINCT.sub(",", block)


def readme_block(text: str) -> str | None:
    if BEGIN not in text or END not in text:
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.model_matrix", description=__doc__)
    parser.add_argument("--families", default=",".join(f.name for f in m.FAMILIES))
    parser.add_argument("--precisions", default=",".join(m.PRECISIONS))
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="put the table into docs/models.md")
    mode.add_argument("--check", action="store_true", help="fail unless docs/models.md holds it")
    args = parser.parse_args(argv)
    families = [m.BY_NAME[n] for n in args.families.split(",")]
    precisions = args.precisions.split(",")

    t0 = time.perf_counter()
    exports = m.export_all([(f, p) for f in families for p in precisions])
    export_seconds = time.perf_counter() - t0
    outcomes = []
    for exp in exports:
        o = m.check(exp)
        print(
            f"{o.family:>9} {o.precision:>5}  {o.status:<22} export {o.export_seconds:5.1f}s "
            f"check {o.check_seconds:5.1f}s  {o.detail[:90]}",
            file=sys.stderr,
            flush=True,
        )
        outcomes.append(o)
    total = time.perf_counter() - t0
    print(f"exports {export_seconds:.1f}s, all {total:.1f}s", file=sys.stderr)
    write_json(
        "model_matrix",
        {
            "export_seconds": export_seconds,
            "total_seconds": total,
            "outcomes": [o.__dict__ for o in outcomes],
        },
    )
    text = table(outcomes, precisions)
    print(text)

    failed = [o for o in outcomes if o.status in (m.DIFFERS, m.GENERATOR_FAILS, m.REPETITIVE)]
    for o in failed:
        print(f"FAIL {o.family} {o.precision}: {o.status}: {o.detail}", file=sys.stderr)
    if args.write:
        readme = PAGE.read_text(encoding="utf-8")
        if readme_block(readme) is None:
            print(f"docs/models.md has no {BEGIN} ... {END} block", file=sys.stderr)
            return 1
        head, rest = readme.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        PAGE.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}", encoding="utf-8")
    if args.check:
        block = readme_block(PAGE.read_text(encoding="utf-8"))
        if block is None or comparable(block) != comparable(text):
            print(
                "docs/models.md's model matrix differs from this run: run "
                "python -m bench.model_matrix --write",
                file=sys.stderr,
            )
            return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
