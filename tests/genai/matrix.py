"""The model-family matrix: one small random-weight model per builder family, exported offline.

Helpers only (no tests), shared by ``tests/genai/test_model_matrix.py`` and
``python -m bench.model_matrix``. Each :class:`Family` is a transformers
config class with a shape that exercises what is peculiar about that family
(a sliding window shorter than the decode, an odd head count, soft caps,
partial rotary, layers without rotary, ...). :func:`export` builds the
Hugging Face folder (the tokenizer of ``genai_fixture``), runs
onnxruntime-genai's model builder on it at one precision and caches the
result on disk, keyed by family, precision, recipe and package versions, so a
second run of the same CI job (or of the tests after the bench) reuses it.

The LM-head row of eos is zeroed in every model: a random-weight model
otherwise reaches eos at a random step, and the matrix needs 200 new tokens
from every prompt. A zero row makes eos's logit 0, which loses the argmax to
the largest of the other 447 random logits.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import genai_fixture as gf

ROOT = Path(__file__).resolve().parents[2]
#: Bump when a change here changes what an export holds: old cache entries stop matching.
RECIPE = 1

PRECISIONS = ("fp32", "fp16", "int4")

#: The shape every family starts from; VOCAB_SIZE (448) differs from every
#: Linear width below (the builder bug of genai_fixture._check_shapes).
BASE: dict[str, Any] = {
    "vocab_size": gf.VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 320,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "initializer_range": gf.INITIALIZER_RANGE,
    "tie_word_embeddings": False,
    "bos_token_id": gf.BOS_ID,
    "eos_token_id": gf.EOS_ID,
    "pad_token_id": gf.PAD_ID,
}

#: The sliding window of the windowed families: far shorter than the
#: 200-token decode, so most steps attend to a suffix of the prefix.
WINDOW = 48


_GEMMA2: dict[str, Any] = {
    "head_dim": 32,
    "num_hidden_layers": 4,
    "sliding_window": WINDOW,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "query_pre_attn_scalar": 32,
    # Tied, this random model repeats its last prompt token forever (the
    # scaled embedding dominates the residual through Gemma2's extra
    # norms): a decode that proves nothing. The gemma row covers tying.
    "tie_word_embeddings": False,
}


_GPTOSS: dict[str, Any] = {
    "head_dim": 32,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": WINDOW,
    "layer_types": ["sliding_attention", "full_attention"],
}


@dataclass(frozen=True)
class Family:
    """One builder family: its transformers config, and what the config exercises."""

    name: str
    architecture: str
    config_class: str
    peculiarity: str
    overrides: dict[str, Any] = field(default_factory=dict)
    #: Extra ``--extra_options KEY=VALUE`` for the builder, beyond hf_token=false.
    builder_options: tuple[str, ...] = ()

    def config_kwargs(self) -> dict[str, Any]:
        return {**BASE, **self.overrides}

    def linear_widths(self) -> set[int]:
        kw = self.config_kwargs()
        heads, kv = kw["num_attention_heads"], kw["num_key_value_heads"]
        head_dim = kw.get("head_dim") or kw["hidden_size"] // heads
        return {
            heads * head_dim,
            kv * head_dim,
            kw["hidden_size"],
            kw["intermediate_size"],
            2 * kw["intermediate_size"],  # Phi3's fused gate_up
            (heads + 2 * kv) * head_dim,  # fused qkv
        }


FAMILIES: tuple[Family, ...] = (
    Family("llama", "LlamaForCausalLM", "LlamaConfig", "baseline", {"head_dim": 32}),
    Family(
        "mistral",
        "MistralForCausalLM",
        "MistralConfig",
        f"sliding window {WINDOW} on every layer",
        {"head_dim": 32, "sliding_window": WINDOW},
    ),
    Family(
        "mistral-fullkv",
        "MistralForCausalLM",
        "MistralConfig",
        "mistral's config, exported with windowed_kv_cache=false: the builder then writes no "
        "window at all, so kvmux and the Generator agree, both attending past the window",
        {"head_dim": 32, "sliding_window": WINDOW},
        builder_options=("windowed_kv_cache=false",),
    ),
    Family(
        "qwen2",
        "Qwen2ForCausalLM",
        "Qwen2Config",
        "qkv biases; 3 query heads over 1 kv head",
        {"hidden_size": 96, "num_attention_heads": 3, "num_key_value_heads": 1},
    ),
    Family(
        "qwen3",
        "Qwen3ForCausalLM",
        "Qwen3Config",
        "q/k norms; head_dim 64 with hidden 128 (heads x head_dim != hidden)",
        {"head_dim": 64},
    ),
    Family(
        "phi3",
        "Phi3ForCausalLM",
        "Phi3Config",
        "fused qkv and gate_up",
        {"original_max_position_embeddings": 1024},
    ),
    Family(
        "phi3-longrope",
        "Phi3ForCausalLM",
        "Phi3Config",
        "LongRoPE: rotary factors switch past 64 tokens (Phi-3 128k's recipe)",
        {
            "original_max_position_embeddings": 64,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0 + 0.05 * i for i in range(16)],
                "long_factor": [2.0 + 0.3 * i for i in range(16)],
            },
        },
    ),
    Family(
        "phi",
        "PhiForCausalLM",
        "PhiConfig",
        "partial rotary (0.5); biases; parallel attention and MLP",
        {"partial_rotary_factor": 0.5},
    ),
    Family(
        "gemma",
        "GemmaForCausalLM",
        "GemmaConfig",
        "tied embeddings scaled by sqrt(hidden); GeLU",
        {"head_dim": 32, "tie_word_embeddings": True},
    ),
    Family(
        "gemma2",
        "Gemma2ForCausalLM",
        "Gemma2Config",
        f"attention and final logit soft caps; local (window {WINDOW}) / global layers",
        _GEMMA2,
    ),
    Family(
        "gemma2-fullkv",
        "Gemma2ForCausalLM",
        "Gemma2Config",
        "gemma2's config, exported with windowed_kv_cache=false (full-length local KV)",
        _GEMMA2,
        builder_options=("windowed_kv_cache=false",),
    ),
    Family(
        "gemma3",
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        f"q/k norms; local (window {WINDOW}, own rope base) / global layers",
        {
            "head_dim": 32,
            "num_hidden_layers": 4,
            "sliding_window": WINDOW,
            "layer_types": [
                "sliding_attention",
                "sliding_attention",
                "sliding_attention",
                "full_attention",
            ],
            "query_pre_attn_scalar": 32,
            "tie_word_embeddings": True,
        },
    ),
    Family(
        "granite",
        "GraniteForCausalLM",
        "GraniteConfig",
        "embedding, residual, attention and logit multipliers",
        {
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.03,
            "logits_scaling": 4.0,
        },
    ),
    Family(
        "olmo",
        "OlmoForCausalLM",
        "OlmoConfig",
        "LayerNorm without weights; qkv clipping",
        {"clip_qkv": 8.0},
    ),
    Family(
        "smollm3",
        "SmolLM3ForCausalLM",
        "SmolLM3Config",
        "layers without rotary (no_rope_layers)",
        {"num_hidden_layers": 4, "no_rope_layers": [1, 1, 1, 0]},
    ),
    Family(
        "nemotron",
        "NemotronForCausalLM",
        "NemotronConfig",
        "partial rotary (0.5); LayerNorm1P; squared-ReLU MLP",
        {"head_dim": 32, "partial_rotary_factor": 0.5},
    ),
    Family(
        "ernie4_5", "Ernie4_5ForCausalLM", "Ernie4_5Config", "ERNIE 4.5 dense", {"head_dim": 32}
    ),
    Family(
        "hunyuan",
        "HunYuanDenseV1ForCausalLM",
        "HunYuanDenseV1Config",
        "HunYuan dense: q/k norms after rotary",
        {"head_dim": 32},
    ),
    Family(
        "gptoss",
        "GptOssForCausalLM",
        "GptOssConfig",
        f"MoE (4 experts, top 2), attention sinks, local (window {WINDOW}) / global layers",
        _GPTOSS,
    ),
    Family(
        "gptoss-fullkv",
        "GptOssForCausalLM",
        "GptOssConfig",
        "gptoss's config, exported with windowed_kv_cache=false",
        _GPTOSS,
        builder_options=("windowed_kv_cache=false",),
    ),
    Family(
        "lfm2",
        "Lfm2ForCausalLM",
        "Lfm2Config",
        "hybrid: short-convolution layers between attention layers",
        {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention"] * 2},
    ),
    Family(
        "granitemoehybrid",
        "GraniteMoeHybridForCausalLM",
        "GraniteMoeHybridConfig",
        "hybrid: a Mamba2 layer before an attention layer",
        {
            "layer_types": ["mamba", "attention"],
            "num_local_experts": 0,
            "mamba_d_head": 32,
            "mamba_n_heads": 8,
            "mamba_d_state": 16,
        },
    ),
)

BY_NAME = {f.name: f for f in FAMILIES}


# --------------------------------------------------------------------------- cache


def cache_root() -> Path:
    """$KVMUX_MODEL_CACHE/genai-matrix, else the repo's (git-ignored) models/genai-matrix."""
    env = os.environ.get("KVMUX_MODEL_CACHE")
    return (Path(env) if env else ROOT / "models") / "genai-matrix"


def _versions() -> dict[str, str]:
    import onnxruntime_genai
    import torch
    import transformers

    return {
        "onnxruntime_genai": onnxruntime_genai.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }


def cache_key(family: Family) -> str:
    payload = json.dumps(
        {
            "recipe": RECIPE,
            "config": family.config_kwargs(),
            "builder": family.builder_options,
            "versions": _versions(),
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Export:
    """One cached export: its folder, or why the builder could not write it."""

    family: Family
    precision: str
    folder: Path
    error: str | None  # the builder's failure, in one line; None when exported
    seconds: float  # time spent now (0.0 when it came from the cache)


def _build_hf(family: Family, out_dir: Path) -> Path:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    tokenizer = gf._train_tokenizer(0)
    if len(tokenizer) != gf.VOCAB_SIZE:
        raise RuntimeError(f"tokenizer trained to {len(tokenizer)} tokens, wanted {gf.VOCAB_SIZE}")
    if gf.VOCAB_SIZE in family.linear_widths():
        raise ValueError(
            f"{family.name}: vocab_size {gf.VOCAB_SIZE} equals a Linear width "
            f"{sorted(family.linear_widths())}; the genai builder would take it for lm_head"
        )
    config = getattr(transformers, family.config_class)(**family.config_kwargs())
    config.architectures = [family.architecture]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():
        head = model.get_output_embeddings()
        head.weight[gf.EOS_ID].zero_()  # see the module docstring
        if getattr(head, "bias", None) is not None:
            head.bias[gf.EOS_ID] = 0.0
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = gf.BOS_ID, gf.EOS_ID, gf.PAD_ID
    gen.do_sample = False
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _entry(family: Family) -> Path:
    return cache_root() / f"{family.name}-{cache_key(family)}"


def cached(family: Family, precision: str) -> Export | None:
    """The cached export, or None if this family/precision was never exported."""
    entry = _entry(family)
    folder = entry / precision
    error_file = entry / f"{precision}.error.txt"
    if (folder / "genai_config.json").is_file():
        return Export(family, precision, folder, None, 0.0)
    if error_file.is_file():
        return Export(family, precision, folder, error_file.read_text().strip(), 0.0)
    return None


def _builder_in_process(
    hf_dir: Path, out_dir: Path, precision: str, options: tuple[str, ...]
) -> None:
    """What ``python -m onnxruntime_genai.models.builder`` does, minus its ~9 s of imports."""
    from onnxruntime_genai.models import builder

    cache_dir = str(out_dir.parent / (out_dir.name + ".builder-cache"))
    args = (None, str(hf_dir), str(out_dir), precision, "cpu", cache_dir)
    prepared = builder.parse_extra_options(*args, ["hf_token=false", *options])
    builder.create_model(*args, **prepared)


def export(family: Family, precision: str, *, in_process: bool = False) -> Export:
    """The builder's export of ``family`` at ``precision`` (cpu), built once and cached.

    A builder failure is cached too (as ``<precision>.error.txt``): it is a
    fact about the builder version, and the matrix reports it as "not
    exportable". ``in_process`` runs the builder in this process (the export
    worker of :func:`export_all`) instead of as its command.
    """
    hit = cached(family, precision)
    if hit is not None:
        return hit
    t0 = time.perf_counter()
    entry = _entry(family)
    entry.mkdir(parents=True, exist_ok=True)
    hf_dir = entry / "hf"
    if not (hf_dir / "config.json").is_file():
        tmp_hf = Path(tempfile.mkdtemp(prefix="hf-", dir=entry))
        _build_hf(family, tmp_hf)
        shutil.rmtree(hf_dir, ignore_errors=True)
        tmp_hf.rename(hf_dir)
    # Export beside the final folder and rename: a crash never leaves a
    # half-written folder that a later run would take for a cached export.
    tmp_out = Path(tempfile.mkdtemp(prefix=f"{precision}-", dir=entry))
    error: str | None = None
    try:
        if in_process:
            _builder_in_process(hf_dir, tmp_out, precision, family.builder_options)
            if not (tmp_out / "genai_config.json").is_file():
                error = "the builder wrote no genai_config.json"
        else:
            gf.export_with_genai_builder(hf_dir, tmp_out, precision, family.builder_options)
    except gf.BuilderFailed as exc:
        error = exc.last_line
    except Exception as exc:  # noqa: BLE001 - any builder failure is the finding
        error = f"{type(exc).__name__}: {exc}".splitlines()[0]
    shutil.rmtree(entry / (tmp_out.name + ".builder-cache"), ignore_errors=True)
    if error is None:
        shutil.rmtree(entry / precision, ignore_errors=True)
        tmp_out.rename(entry / precision)
    else:
        shutil.rmtree(tmp_out, ignore_errors=True)
        (entry / f"{precision}.error.txt").write_text(error + "\n")
    return Export(family, precision, entry / precision, error, time.perf_counter() - t0)


def export_all(pairs: list[tuple[Family, str]]) -> list[Export]:
    """Every pair's export; those not cached are exported by one worker process.

    One process pays the builder's imports once (an export then takes about
    a second instead of ten). Should the worker die, what it left undone is
    exported one builder command at a time.
    """
    missing = [(f, p) for f, p in pairs if cached(f, p) is None]
    seconds: dict[tuple[str, str], float] = {}
    if missing:
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "seconds.json"
            cmd = [sys.executable, "-m", "tests.genai.matrix", str(report)]
            cmd += [f"{f.name}:{p}" for f, p in missing]
            env = {**gf._offline_env(), "PYTHONPATH": str(ROOT)}
            subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=1800)
            if report.is_file():
                for key, value in json.loads(report.read_text()).items():
                    name, precision = key.split(":")
                    seconds[(name, precision)] = float(value)
    out = []
    for family, precision in pairs:
        exp = export(family, precision)
        took = seconds.get((family.name, precision))
        if took is not None:
            exp = Export(family, precision, exp.folder, exp.error, took)
        out.append(exp)
    return out


def _worker(argv: list[str]) -> None:
    report, *pairs = argv
    took: dict[str, float] = {}
    for pair in pairs:
        name, precision = pair.split(":")
        took[pair] = export(BY_NAME[name], precision, in_process=True).seconds
        Path(report).write_text(json.dumps(took))


# --------------------------------------------------------------------------- the check

#: Decode shape of every entry: a 20-token prompt prefilled in chunks of 8
#: into buckets from 8 (8 -> 16 -> 32 while prefilling), then 250 new tokens
#: through 64, 128, 256 and 512: four growths during the decode alone (three
#: where a window raises the first bucket to 64).
PROMPT = [gf.BOS_ID, *range(40, 59)]
N_NEW = 250
MIN_BUCKET = 8
PREFILL_CHUNK = 8
MIN_GROWTHS = 3
MIN_NEW = 200
#: A random model can fall into repeating a token or two; a corrupted KV
#: would then go unnoticed. A decode with fewer distinct tokens proves nothing.
MIN_DISTINCT = 20

IDENTICAL = "identical"
REFUSED = "refused"
DIFFERS = "differs"
NOT_EXPORTABLE = "not exportable"
GENERATOR_FAILS = "generator fails"
REPETITIVE = "too repetitive to compare"
CAPPED = "identical to a cap"


@dataclass(frozen=True)
class Outcome:
    """What kvmux did with one export, against the Generator."""

    family: str
    precision: str
    status: str  # IDENTICAL, REFUSED, DIFFERS or NOT_EXPORTABLE
    detail: str  # the refusal or builder error; for a match, what was compared
    new_tokens: int = 0
    growths: int = 0  # during the decode, after the prompt was in
    export_seconds: float = 0.0
    check_seconds: float = 0.0
    distinct: int = 0  # distinct token ids among the new tokens
    #: Largest |kvmux - Generator| over the logits of every pick (0.0: bit-equal).
    logit_diff: float = 0.0


@dataclass
class Decode:
    """One side's greedy decode: new tokens, and the logits each was picked from."""

    tokens: list[int]
    logits: list[Any]  # one float32 vector per new token
    growths: int = 0  # KV growths after the prompt was in (kvmux only)


def engine_greedy(folder: Path, n_new: int = N_NEW) -> Decode:
    """kvmux's Engine, greedy, small buckets and chunked prefill."""
    from kvmux.daemon.engine import Engine, EngineOptions, SamplingParams

    engine = Engine(
        folder,
        EngineOptions(min_bucket=MIN_BUCKET, prefill_chunk=PREFILL_CHUNK, intra_op_threads=1),
    )
    session = engine.new_session(PROMPT, SamplingParams(max_new_tokens=n_new, temperature=0.0))
    logits: list[Any] = []
    pick = session.sampler

    def keep(row: Any) -> int:
        logits.append(row.copy())  # the sampler sees every step's logits
        return pick(row)

    session.sampler = keep  # type: ignore[assignment]
    # Every pick through ``keep``: not the engine's argmax for a whole run, which
    # calls no sampler (and would leave nothing to compare).
    session.picks_argmax = False
    growths, capacity = 0, None
    try:
        while not session.finished:
            engine.step(session)
            if not session.prefilling:
                if capacity is not None and session.cache.capacity != capacity:
                    growths += 1
                capacity = session.cache.capacity
        completion = session.completion()
    finally:
        session.release()
    tokens = completion.token_ids + ([gf.EOS_ID] if completion.finish_reason == "stop" else [])
    if len(logits) != len(tokens):
        raise RuntimeError(f"{len(logits)} logits recorded for {len(tokens)} picks")
    return Decode(tokens, logits, growths)


def generator_greedy(folder: Path, n_new: int) -> Decode:
    """onnxruntime-genai's Generator, greedy, with the logits of every pick."""
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(PROMPT) + n_new, batch_size=1)
    gen = og.Generator(model, params)
    gen.append_tokens(PROMPT)
    out = Decode([], [])
    while not gen.is_done() and len(out.tokens) < n_new:
        # The logits the next token is picked from: the prompt's last position
        # first, then each new token's.
        out.logits.append(np.array(gen.get_logits(), dtype=np.float32).reshape(-1))
        gen.generate_next_token()
        out.tokens.append(int(gen.get_next_tokens()[0]))
    return out


async def daemon_greedy(folder: Path, n_new: int = N_NEW) -> list[int]:
    """The same decode through a real ``kvmuxd`` process and the client."""
    from bench.bench_daemon import kvmuxd
    from kvmux.client import Client, Item

    tables = {"kv": {"min_bucket": MIN_BUCKET}, "scheduler": {"prefill_chunk": PREFILL_CHUNK}}
    async with kvmuxd(folder, threads=1, tables=tables) as daemon, Client(daemon.endpoint) as c:
        job = await c.submit([Item(prompt_tokens=PROMPT, max_new_tokens=n_new, temperature=0.0)])
        (result,) = await job.results()
        job.close()
    if result.status != "ok":
        raise RuntimeError(f"kvmuxd failed the item: {result.error}")
    return list(result.token_ids) + ([gf.EOS_ID] if result.finish_reason == "stop" else [])


def check(exp: Export) -> Outcome:
    """Load ``exp`` in kvmux; if it loads, compare Engine and kvmuxd with the Generator."""
    import anyio

    from kvmux.daemon.model import ModelFormatError, load_model

    name, precision = exp.family.name, exp.precision
    if exp.error is not None:
        builder = f"onnxruntime-genai {_versions()['onnxruntime_genai']}'s builder fails"
        # The table must not depend on where the cache lives.
        error = exp.error
        for hf in (exp.folder.parent / "hf", (exp.folder.parent / "hf").resolve()):
            error = error.replace(str(hf), "HF_FOLDER")
        return Outcome(
            name, precision, NOT_EXPORTABLE, f"{builder}: {error}", export_seconds=exp.seconds
        )
    t0 = time.perf_counter()
    try:
        spec = load_model(exp.folder)
    except ModelFormatError as exc:
        return Outcome(
            name, precision, REFUSED, "; ".join(exc.problems), export_seconds=exp.seconds
        )
    # A model whose features cap its context decodes up to the cap, not past it.
    n_new = N_NEW
    if spec.context_length is not None:
        n_new = min(N_NEW, spec.context_length - len(PROMPT))
    try:
        reference = generator_greedy(exp.folder, n_new)
    except Exception as exc:  # noqa: BLE001 - the peer's failure is the finding
        return Outcome(
            name,
            precision,
            GENERATOR_FAILS,
            str(exc).splitlines()[0][:300],
            export_seconds=exp.seconds,
        )
    expected = reference.tokens
    kvmux = engine_greedy(exp.folder, n_new)
    got, growths = kvmux.tokens, kvmux.growths
    via_daemon = anyio.run(daemon_greedy, exp.folder, n_new)
    logit_diff = max(
        (float(abs(a - b).max()) for a, b in zip(kvmux.logits, reference.logits, strict=False)),
        default=0.0,
    )
    seconds = time.perf_counter() - t0
    mismatches = []
    for side, tokens in (("Engine", got), ("kvmuxd", via_daemon)):
        if tokens != expected:
            first = next(
                (i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b),
                min(len(tokens), len(expected)),
            )
            mismatches.append(
                f"{side} differs from the Generator at new token {first} "
                f"({len(tokens)} vs {len(expected)} tokens)"
            )
    n = len(expected)
    if mismatches:
        status, detail = DIFFERS, "; ".join(mismatches)
    elif len(set(expected)) < min(MIN_DISTINCT, n):
        status = REPETITIVE
        detail = f"the Generator's {n} tokens hold {len(set(expected))} distinct ids"
    elif spec.features.context_cap is not None:
        status = CAPPED
        detail = (
            f"{n} new tokens, to the context cap {spec.features.context_cap}: "
            "window declared in genai_config.json, not applied by the graph"
        )
    else:
        detail = f"{n} new tokens ({len(set(expected))} distinct), {growths} growths while decoding"
        status = IDENTICAL
    return Outcome(
        name,
        precision,
        status,
        detail,
        n,
        growths,
        exp.seconds,
        seconds,
        len(set(expected)),
        logit_diff,
    )


if __name__ == "__main__":
    _worker(sys.argv[1:])
