"""SGLangEngine against a fake `sglang` module whose `Engine` mirrors the signatures and the
streamed output of sglang 0.5 (`sglang/srt/entrypoints/engine.py`, `managers/tokenizer_manager.py`,
`managers/detokenizer_manager.py`): cumulative `text` and `output_ids`, `meta_info` with the
token counts, `finish_reason` dicts and cumulative `(logprob, id, text)` triples, `index` per
prompt of a batch, a matched stop string trimmed at the end, and abort when the stream closes."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import types
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from telerag.pipelines.engines.sglang import SGLangEngine, sampling_params
from telerag.pipelines.errors import EngineError, EngineOverloaded, EngineUnavailable, GenerationAborted
from telerag.pipelines.types import Engine, Generation, SamplingParams, TokenChunk

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass
class Script:
    """What the fake model produces for one prompt: token texts with their ids and log-probs,
    and optionally an abort (SGLang's finish_reason dict) after `abort_after` tokens."""

    pieces: list[str]
    abort: dict[str, Any] | None = None
    abort_after: int = 0

    def ids(self) -> list[int]:
        return [1000 + i for i in range(len(self.pieces))]

    def logprobs(self) -> list[float]:
        return [-0.1 * (i + 1) for i in range(len(self.pieces))]


class FakeTokenizer:
    chat_template: str | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict], tokenize: bool, add_generation_prompt: bool) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class FakeEngine:
    """`sglang.Engine` as far as the adapter uses it."""

    instances: list[FakeEngine] = []
    scripts: dict[str, Script] = {}
    fail_start: Exception | None = None
    fail_request: Exception | None = None
    fail_midway: Exception | None = None

    def __init__(self, **kwargs: Any) -> None:
        if FakeEngine.fail_start:
            raise FakeEngine.fail_start
        self.kwargs = kwargs
        self.tokenizer_manager = types.SimpleNamespace(tokenizer=FakeTokenizer())
        self.requests: list[dict[str, Any]] = []
        self.closed_streams = 0
        self.shutdown_calls = 0
        FakeEngine.instances.append(self)

    def shutdown(self) -> None:
        self.shutdown_calls += 1

    async def async_generate(
        self,
        prompt: list[str] | str | None = None,
        sampling_params: list[dict] | dict | None = None,
        input_ids: list[list[int]] | list[int] | None = None,
        image_data: Any = None,
        audio_data: Any = None,
        video_data: Any = None,
        mm_hashes: Any = None,
        mm_content_hashes: Any = None,
        return_logprob: list[bool] | bool | None = False,
        logprob_start_len: list[int] | int | None = None,
        top_logprobs_num: list[int] | int | None = None,
        token_ids_logprob: Any = None,
        lora_path: Any = None,
        custom_logit_processor: Any = None,
        require_reasoning: bool = False,
        return_hidden_states: Any = False,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
        stream: bool = False,
        **rest: Any,
    ) -> dict | AsyncIterator[dict]:
        self.requests.append(
            {"prompt": prompt, "sampling_params": sampling_params, "return_logprob": return_logprob, "stream": stream}
        )
        assert stream is True and isinstance(prompt, list) and isinstance(sampling_params, dict)
        return self._stream(prompt, sampling_params, bool(return_logprob))

    async def _stream(self, prompts: list[str], params: dict, return_logprob: bool) -> AsyncIterator[dict]:
        """Interleaves the prompts' outputs, one token each in turn, the last prompt first. Like
        SGLang's, it checks the request (and may refuse it) only when first asked for output."""
        if FakeEngine.fail_request:
            raise FakeEngine.fail_request
        states = [self._outputs(index, prompt, params, return_logprob) for index, prompt in enumerate(prompts)]
        try:
            while states:
                for state in list(reversed(states)):
                    out = next(state, None)
                    if out is None:
                        states.remove(state)
                        continue
                    if FakeEngine.fail_midway:
                        raise FakeEngine.fail_midway
                    yield out
                    await asyncio.sleep(0)
        finally:
            self.closed_streams += 1  # GeneratorExit here is where SGLang aborts the request

    def _outputs(self, index: int, prompt: str, params: dict, return_logprob: bool):
        """SGLang's detokenizer, per prompt: deltas appended to a cumulative text; a stop string
        is found in the decoded text and trimmed from the end, but what was sent stays sent."""
        script = FakeEngine.scripts[prompt]
        stops = params.get("stop") or []
        sent = ""
        for n in range(1, len(script.pieces) + 1):
            decoded = "".join(script.pieces[:n])
            matched = next((s for s in stops if s in decoded), None)
            finish: dict[str, Any] | None = None
            if script.abort is not None and n > script.abort_after:
                finish = dict(script.abort)
            elif matched is not None:
                finish = {"type": "stop", "matched": matched}
                decoded = decoded[: decoded.find(matched)]
            elif n == params["max_new_tokens"]:
                finish = {"type": "length", "length": n}
            elif n == len(script.pieces):
                finish = {"type": "stop", "matched": 2}  # the EOS token
            sent += decoded[len(sent):] if len(decoded) > len(sent) else ""
            meta: dict[str, Any] = {"id": f"rid-{index}", "finish_reason": finish, "prompt_tokens": len(prompt),
                                    "completion_tokens": n, "cached_tokens": 0}
            if return_logprob:
                meta["output_token_logprobs"] = [
                    (lp, tid, None) for lp, tid in zip(script.logprobs()[:n], script.ids()[:n], strict=True)
                ]
                meta["input_token_logprobs"] = []
            yield {"text": sent, "output_ids": script.ids()[:n], "meta_info": meta, "index": index}
            if finish is not None:
                return


@pytest.fixture
def sglang() -> types.ModuleType:
    FakeEngine.instances, FakeEngine.scripts = [], {}
    FakeEngine.fail_start = FakeEngine.fail_request = FakeEngine.fail_midway = None
    return types.SimpleNamespace(Engine=FakeEngine)  # type: ignore[return-value]


async def collect(
    engine: SGLangEngine, prompts: list[str], params: SamplingParams
) -> tuple[dict[int, str], dict[int, Generation]]:
    texts = {i: "" for i in range(len(prompts))}
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
        "max_new_tokens": 7, "temperature": 0.7, "top_p": 0.9, "stop": [".", "\n"]
    }


def test_the_engine_is_configured_as_asked(sglang: types.ModuleType):
    engine = SGLangEngine("/models/Llama-3.2-3B/", mem_fraction_static=0.6, context_length=8192, tp_size=2,
                          module=sglang, random_seed=7)
    assert isinstance(engine, Engine)
    assert engine.name == "Llama-3.2-3B"
    assert FakeEngine.instances[0].kwargs == {
        "model_path": "/models/Llama-3.2-3B/", "tp_size": 2, "mem_fraction_static": 0.6, "context_length": 8192,
        "random_seed": 7, "incremental_streaming_output": False,
    }


async def test_a_streamed_batch_translates_to_chunks_and_generations(sglang: types.ModuleType):
    FakeEngine.scripts = {"a": Script(["Par", "is", " is", " big"]), "b": Script(["Ro", "me"])}
    engine = SGLangEngine("m", module=sglang)
    texts, finals = await collect(engine, ["a", "b"], SamplingParams(max_tokens=3, logprobs=True))
    assert FakeEngine.instances[0].requests[0]["return_logprob"] is True
    assert texts == {0: "Paris is", 1: "Rome"}
    a, b = finals[0], finals[1]
    assert (a.text, a.finish_reason, a.completion_tokens, a.prompt_tokens, a.index) == ("Paris is", "length", 3, 1, 0)
    assert a.token_ids == (1000, 1001, 1002) and a.logprobs == pytest.approx((-0.1, -0.2, -0.3))
    assert (b.text, b.finish_reason, b.completion_tokens) == ("Rome", "stop", 2)
    assert 0 < a.ttft_ms <= a.total_ms
    generated = await engine.generate(["a", "b"], SamplingParams(max_tokens=3))
    assert [g.index for g in generated] == [0, 1]  # in prompt order, although "b" finishes first
    assert [g.text for g in generated] == ["Paris is", "Rome"] and generated[0].logprobs == ()


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
    assert engine.count_tokens("abc") == 3 and engine.decode([104, 105]) == "hi"
    assert engine.format_prompt("Why?") == "Why?"
    engine.tokenizer.chat_template = "..."
    assert engine.format_prompt("Why?") == "<user>Why?<assistant>"
    assert engine.format_prompt("Why?", system="Be brief.") == "<system>Be brief.<user>Why?<assistant>"
    await engine.close()
    assert FakeEngine.instances[0].shutdown_calls == 1
