"""SGLangEngine against a fake `sglang` module whose `Engine` mirrors the signatures, the
streamed output and the side effects of sglang 0.5.23 (`sglang/srt/entrypoints/engine.py`,
`managers/tokenizer_manager.py`, `managers/detokenizer_manager.py`, `utils/common.py`):
cumulative `text` and `output_ids`, `meta_info` with the token counts, `finish_reason` dicts and
cumulative `(logprob, id, text)` triples, `index` per prompt of a batch, a matched stop string
trimmed at the end, abort when the stream closes; and, as SGLang does in its host process, a
SIGQUIT handler installed at launch, SIGTERM and SIGQUIT handlers installed on the event loop
by the first request, `logging.basicConfig(force=True)` at launch, and text prompts tokenised
with the tokenizer's special tokens."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from telerag.engines.errors import EngineError, EngineOverloaded, EngineUnavailable, GenerationAborted
from telerag.engines.sglang import SGLangEngine, sampling_params
from telerag.engines.types import Engine, Generation, SamplingParams, TokenChunk
from tests.fake_sglang import FakeEngine, FakeTokenizer, Script

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]


async def collect(
    engine: SGLangEngine, prompts: list[str], params: SamplingParams
) -> tuple[dict[int, str], dict[int, Generation]]:
    texts = dict.fromkeys(range(len(prompts)), "")
    finals: dict[int, Generation] = {}
    async for item in engine.stream(prompts, params):
        if isinstance(item, TokenChunk):
            assert item.index not in finals
            texts[item.index] += item.text
        else:
            finals[item.index] = item
    return texts, finals


def test_sampling_params_translate_to_sglang():
    assert sampling_params(SamplingParams()) == {"max_new_tokens": 256, "temperature": 0.0, "top_p": 1.0, "stop": None}
    assert sampling_params(SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, stop=(".", "\n"), logprobs=True)) == {
        "max_new_tokens": 7,
        "temperature": 0.7,
        "top_p": 0.9,
        "stop": [".", "\n"],
    }
    assert 0 < sampling_params(SamplingParams(temperature=1.0, top_p=0.0))["top_p"] <= 1e-6  # SGLang refuses 0


def test_the_engine_is_configured_as_asked(sglang: types.ModuleType):
    engine = SGLangEngine(
        "/models/Llama-3.2-3B/",
        mem_fraction_static=0.6,
        context_length=8192,
        tp_size=2,
        log_level="debug",
        module=sglang,
        random_seed=7,
    )
    assert isinstance(engine, Engine)
    assert engine.name == "Llama-3.2-3B"
    assert FakeEngine.instances[0].kwargs == {
        "model_path": "/models/Llama-3.2-3B/",
        "tp_size": 2,
        "mem_fraction_static": 0.6,
        "context_length": 8192,
        "log_level": "debug",
        "random_seed": 7,
        "incremental_streaming_output": False,
    }


def test_sglang_logs_at_the_servers_level_and_leaves_its_logging_alone(sglang: types.ModuleType):
    root = logging.getLogger()
    ours = logging.StreamHandler()
    root.addHandler(ours)
    root.setLevel(logging.INFO)
    handlers = list(root.handlers)
    SGLangEngine("m", module=sglang)
    assert FakeEngine.instances[0].kwargs["log_level"] == "info"  # the level this process logs at
    assert root.handlers == handlers and root.level == logging.INFO
    assert logging.getLogger("telerag.server").isEnabledFor(logging.INFO)  # not silenced by SGLang


async def test_the_servers_signal_handlers_survive_sglang(sglang: types.ModuleType):
    """uvicorn catches SIGTERM with `signal.signal` to drain; SGLang's handlers (at launch and on
    the loop at the first request) must not replace it, nor be called beside it."""
    received: list[int] = []

    def ours(signum: int, frame: object) -> None:
        received.append(signum)

    for sig in (signal.SIGTERM, signal.SIGQUIT):
        signal.signal(sig, ours)
    FakeEngine.scripts = {"q": Script(["x", "y"])}
    engine = SGLangEngine("m", module=sglang)
    await engine.generate(["q"], SamplingParams())
    await engine.generate(["q"], SamplingParams())
    fake = FakeEngine.instances[0]
    assert fake.tokenizer_manager.event_loop is asyncio.get_running_loop()  # SGLang's loop runs on ours
    for sig in (signal.SIGTERM, signal.SIGQUIT):
        assert signal.getsignal(sig) is ours  # checked first: a default handler would end pytest
        signal.raise_signal(sig)
    await asyncio.sleep(0.05)  # a handler on the loop would run as a callback
    assert received == [signal.SIGTERM, signal.SIGQUIT]
    assert fake.tokenizer_manager.signals == [] and fake.launch_signals == []


async def test_a_chat_prompt_reaches_the_model_with_one_bos(sglang: types.ModuleType):
    """The ids SGLang gets are the chat template's own (`apply_chat_template(tokenize=True)`):
    sent as text, SGLang would tokenise the rendered template, BOS included, with a second BOS."""
    FakeEngine.tokenizer = tokenizer = FakeTokenizer()
    tokenizer.chat_template = "..."
    engine = SGLangEngine("m", module=sglang)
    prompt = engine.format_prompt("Why?")
    FakeEngine.scripts = {"<user>Why?<assistant>": Script(["Because"]), "plain": Script(["text"])}
    texts, finals = await collect(engine, [prompt], SamplingParams())
    model_input = FakeEngine.instances[0].requests[0]["model_inputs"][0]
    messages = [{"role": "user", "content": "Why?"}]
    assert model_input == tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert model_input.count(tokenizer.bos_token_id) == 1 and model_input[0] == tokenizer.bos_token_id
    assert finals[0].prompt_tokens == len(model_input) and texts[0] == "Because"
    tokenizer.chat_template = None  # a base model: the plain text after one BOS, as SGLang would send it
    await engine.generate([engine.format_prompt("plain")], SamplingParams())
    assert FakeEngine.instances[0].requests[1]["model_inputs"][0] == tokenizer.encode("plain")


async def test_a_real_llama3_style_template_gets_one_bos(sglang: types.ModuleType):
    FakeEngine.tokenizer = tokenizer = llama3_style_tokenizer()
    engine = SGLangEngine("m", module=sglang)
    prompt = engine.format_prompt("hello world")
    messages = [{"role": "user", "content": "hello world"}]
    FakeEngine.scripts = {
        tokenizer.decode(
            tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False),
            skip_special_tokens=True,
        ): Script(["ok"])
    }
    await engine.generate([prompt], SamplingParams())
    model_input = FakeEngine.instances[0].requests[0]["model_inputs"][0]
    assert model_input == tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert model_input.count(tokenizer.bos_token_id) == 1
    assert tokenizer(prompt)["input_ids"].count(tokenizer.bos_token_id) == 2  # what sending the text would give


def llama3_style_tokenizer() -> Any:
    """A word-level tokenizer with Llama 3's special tokens, post-processor (BOS in front) and
    chat template (which writes BOS itself), built in-process."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    special = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "[UNK]"]
    words = ["user", "assistant", "hello", "world", "ok"]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(special + words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(special)
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[("<|begin_of_text|>", 0)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", unk_token="[UNK]"
    )
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|> "
        "{{ m['content'] }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|> {% endif %}"
    )
    return tokenizer


async def test_a_streamed_batch_translates_to_chunks_and_generations(sglang: types.ModuleType):
    FakeEngine.scripts = {"a": Script(["Par", "is", " is", " big"]), "b": Script(["Ro", "me"])}
    engine = SGLangEngine("m", module=sglang)
    texts, finals = await collect(engine, ["a", "b"], SamplingParams(max_tokens=3, logprobs=True))
    assert FakeEngine.instances[0].requests[0]["return_logprob"] is True
    assert texts == {0: "Paris is", 1: "Rome"}
    a, b = finals[0], finals[1]
    assert (a.text, a.finish_reason, a.completion_tokens, a.prompt_tokens, a.index) == ("Paris is", "length", 3, 2, 0)
    assert a.token_ids == (1000, 1001, 1002) and a.logprobs == pytest.approx((-0.1, -0.2, -0.3))
    assert (b.text, b.finish_reason, b.completion_tokens) == ("Rome", "stop", 2)
    assert 0 < a.ttft_ms <= a.total_ms
    generated = await engine.generate(["a", "b"], SamplingParams(max_tokens=3))
    assert [g.index for g in generated] == [0, 1]  # in prompt order, although "b" finishes first
    assert [g.text for g in generated] == ["Paris is", "Rome"] and generated[0].logprobs == ()


async def test_the_prompt_tokens_sglangs_radix_cache_held_are_the_generations_cached_tokens(sglang: types.ModuleType):
    FakeEngine.scripts = {"the nile flows north": Script(["Yes"]), "the nile flows south": Script(["No"])}
    engine = SGLangEngine("m", module=sglang)
    first, second, again = [
        (await engine.generate([prompt], SamplingParams(max_tokens=3)))[0]
        for prompt in ("the nile flows north", "the nile flows south", "the nile flows north")
    ]
    assert first.cached_tokens == 0
    assert 0 < second.cached_tokens < second.prompt_tokens  # the common beginning, as the fake's cache held it
    assert again.cached_tokens == again.prompt_tokens - 1


async def test_a_prefill_is_a_request_of_no_new_tokens_whose_prompt_the_radix_cache_then_holds(sglang: types.ModuleType):
    FakeEngine.scripts = {"the nile flows north": Script(["Yes"])}
    engine = SGLangEngine("m", module=sglang)
    (prefilled,) = await engine.prefill(["the nile flows north"])
    assert (prefilled.text, prefilled.completion_tokens, prefilled.cached_tokens) == ("", 0, 0)
    assert FakeEngine.instances[-1].requests[-1]["sampling_params"]["max_new_tokens"] == 0
    (generated,) = await engine.generate(["the nile flows north"], SamplingParams(max_tokens=3))
    assert generated.text == "Yes" and generated.cached_tokens == generated.prompt_tokens - 1


async def test_chunks_carry_each_new_token_and_its_logprob(sglang: types.ModuleType):
    FakeEngine.scripts = {"q": Script(["one", " two", " three"])}
    engine = SGLangEngine("m", module=sglang)
    chunks = [item async for item in engine.stream(["q"], SamplingParams(logprobs=True)) if isinstance(item, TokenChunk)]
    assert [(c.text, c.token_ids) for c in chunks] == [("one", (1000,)), (" two", (1001,)), (" three", (1002,))]
    assert [c.logprobs for c in chunks] == [pytest.approx((-0.1,)), pytest.approx((-0.2,)), pytest.approx((-0.3,))]


async def test_a_stop_string_sglang_began_to_stream_is_never_shown(sglang: types.ModuleType):
    # SGLang streams "Paris\n" before "Question" completes the stop, then trims only what it
    # had not sent: the adapter holds the "\n" back and drops it.
    FakeEngine.scripts = {"q": Script(["Paris", "\n", "Question", ":", " more"])}
    engine = SGLangEngine("m", module=sglang)
    texts, finals = await collect(engine, ["q"], SamplingParams(stop=("\nQuestion",)))
    assert FakeEngine.instances[0].requests[0]["sampling_params"]["stop"] == ["\nQuestion"]
    assert texts[0] == finals[0].text == "Paris" and finals[0].finish_reason == "stop"


async def test_closing_the_stream_closes_sglangs_stream(sglang: types.ModuleType):
    FakeEngine.scripts = {"q": Script(["x"] * 50)}
    engine = SGLangEngine("m", module=sglang)
    stream = engine.stream(["q"], SamplingParams())
    assert isinstance(await stream.__anext__(), TokenChunk)
    await stream.aclose()
    assert FakeEngine.instances[0].closed_streams == 1


async def test_on_chunk_hears_each_chunk_and_asking_no_more_ends_the_call_and_aborts_sglangs(sglang: types.ModuleType):
    FakeEngine.scripts = {"q": Script(["a", " b", " c"] + [" x"] * 50)}
    engine = SGLangEngine("m", module=sglang)
    heard: list[str] = []
    (whole,) = await engine.generate(["q"], SamplingParams(max_tokens=5), lambda chunk: heard.append(chunk.text))
    assert "".join(heard) == whole.text == "a b c x x" and whole.finish_reason == "length"
    heard.clear()
    (ended,) = await engine.generate(
        ["q"], SamplingParams(max_tokens=50), lambda chunk: bool(heard.append(chunk.text)) or len(heard) == 2
    )
    assert heard == ["a", " b"]
    assert (ended.text, ended.completion_tokens, ended.finish_reason) == ("a b", 2, "stop")
    assert FakeEngine.instances[0].closed_streams == 2  # the second one SGLang aborts


async def test_a_prompt_ends_at_its_deadline_with_what_it_has_and_sglang_aborts_the_rest(sglang: types.ModuleType):
    FakeEngine.scripts = {"q": Script(["a", "b", "\n", "Q"] + ["x"] * 500), "r": Script(["Rome"])}
    FakeEngine.token_delay_s = 0.01
    engine = SGLangEngine("m", module=sglang)
    params = SamplingParams(max_tokens=500, stop=("\nQ",), deadline=time.monotonic() + 0.02)
    texts, finals = await collect(engine, ["q", "r"], params)
    cut, done = finals[0], finals[1]
    assert cut.finish_reason == "deadline" and cut.completion_tokens < 500
    assert texts[0] == cut.text and "x" * 100 not in cut.text  # what was streamed, held-back tail included
    assert cut.prompt_tokens > 0 and done.finish_reason in ("stop", "deadline")
    assert FakeEngine.instances[0].closed_streams == 1  # SGLang aborts the request
    (late,) = await engine.generate(["q"], SamplingParams(deadline=time.monotonic()))
    assert (late.text, late.completion_tokens, late.finish_reason) == ("", 0, "deadline")
    assert len(FakeEngine.instances[0].requests) == 1  # one whose deadline had come was never sent


@pytest.mark.parametrize(
    ("abort", "error"),
    [
        ({"type": "abort", "message": "The request queue is full.", "status_code": 503}, EngineOverloaded),
        ({"type": "abort", "message": "Input is too long", "status_code": 400}, EngineError),
        ({"type": "abort", "message": "Aborted", "status_code": None}, GenerationAborted),
    ],
)
async def test_an_abort_by_sglang_is_a_typed_error(sglang: types.ModuleType, abort: dict, error: type[Exception]):
    FakeEngine.scripts = {"q": Script(["a", "b", "c"], abort=abort, abort_after=1)}
    engine = SGLangEngine("m", module=sglang)
    with pytest.raises(error, match=abort["message"]):
        await engine.generate(["q"], SamplingParams())
    assert FakeEngine.instances[0].closed_streams == 1


async def test_sglang_failures_are_engine_errors(sglang: types.ModuleType):
    FakeEngine.scripts = {"q": Script(["a", "b"])}
    engine = SGLangEngine("m", module=sglang)
    FakeEngine.fail_request = ValueError("prompt longer than the context")
    with pytest.raises(EngineError, match="refused"):
        await engine.generate(["q"], SamplingParams())
    FakeEngine.fail_request, FakeEngine.fail_midway = None, RuntimeError("scheduler died")
    with pytest.raises(EngineError, match="scheduler died"):
        await engine.generate(["q"], SamplingParams())


def test_a_failed_start_is_engine_unavailable(sglang: types.ModuleType):
    FakeEngine.fail_start = RuntimeError("CUDA out of memory")
    with pytest.raises(EngineUnavailable, match="out of memory"):
        SGLangEngine("m", module=sglang)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_without_sglang_installed_the_engine_is_unavailable():
    with pytest.raises(EngineUnavailable, match="SGLang is not available"):
        SGLangEngine("m")


async def test_tokens_prompts_and_close_go_through_sglang(sglang: types.ModuleType):
    engine = SGLangEngine("m", module=sglang)
    assert engine.count_tokens("abc") == 3 and engine.decode([1, 104, 105]) == "hi"
    assert engine.format_prompt("Why?") == "Why?"
    engine.tokenizer.chat_template = "..."
    assert engine.format_prompt("Why?") == "<s><user>Why?<assistant>"
    assert engine.format_prompt("Why?", system="Be brief.") == "<s><system>Be brief.<user>Why?<assistant>"
    await engine.close()
    assert FakeEngine.instances[0].shutdown_calls == 1


@pytest.mark.slow  # a server process: about 20 s here, most of it importing torch
def test_sigterm_drains_a_server_with_sglang_in_it_then_stops_sglang():
    """The server's own shutdown, not SGLang's: a request accepted before SIGTERM gets its whole
    answer, then SGLang is shut down and the process exits (tests/sglang_server.py)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.sglang_server", str(port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while not _answers(f"{base}/ready"):  # SGLang installs its signal handlers at the first request: the warm-up
            assert process.poll() is None and time.time() < deadline, process.stdout.read() if process.stdout else ""
            time.sleep(0.2)
        query = {"query": "What is the capital of France?", "pipeline": "naive"}
        first = httpx.post(f"{base}/v1/rag/query", json=query, timeout=30)
        assert first.status_code == 200, first.text
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, f"{base}/v1/rag/query", json=query, timeout=30)
            while "telerag_requests_in_flight 1.0" not in httpx.get(f"{base}/metrics", timeout=5).text:
                assert time.time() < deadline and not pending.done()
                time.sleep(0.05)
            process.send_signal(signal.SIGTERM)
            response = pending.result()
        assert response.status_code == 200 and response.json()["answer"] == first.json()["answer"] != ""
        assert process.wait(timeout=30) == 0  # drained: a clean exit
        report = json.loads(process.stdout.read().strip().splitlines()[-1])
        assert report == {"shutdown_calls": 1, "sglang_signals": []}
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
