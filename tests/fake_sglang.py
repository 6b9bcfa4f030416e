"""A fake `sglang` module whose `Engine` mirrors the signatures, the streamed output and the
side effects of sglang 0.5.23 (`sglang/srt/entrypoints/engine.py`,
`managers/tokenizer_manager.py`, `managers/detokenizer_manager.py`, `utils/common.py`), for
`tests/test_engine_sglang.py` (which says what it mirrors), the `sglang` fixture
(`tests/conftest.py`) and `tests/sglang_server.py`."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar


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
    """Characters as ids and "<s>" (BOS, id 1) as one token. Like a Llama tokenizer, `encode`
    puts BOS in front unless told not to, and the chat template writes BOS into the text."""

    bos_token, bos_token_id = "<s>", 1
    chat_template: str | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.bos_token_id] if add_special_tokens else []
        for i, part in enumerate(text.split(self.bos_token)):
            ids += ([self.bos_token_id] if i else []) + [ord(c) for c in part]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        bos = "" if skip_special_tokens else self.bos_token
        return "".join(bos if i == self.bos_token_id else chr(i) for i in ids)

    def apply_chat_template(
        self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = False
    ) -> str | list[int]:
        text = self.bos_token + "".join(f"<{m['role']}>{m['content']}" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        return self.encode(text, add_special_tokens=False) if tokenize else text


@dataclass
class FakeTokenizerManager:
    """SGLang's TokenizerManager: a text prompt is tokenised with the special tokens; the
    output loop starts on the first request's event loop, which (in the main thread) gets
    SGLang's own SIGTERM and SIGQUIT handlers."""

    tokenizer: Any
    event_loop: asyncio.AbstractEventLoop | None = None
    signals: list[int] = field(default_factory=list)  # those SGLang's handlers received

    def auto_create_handle_loop(self) -> None:
        if self.event_loop is not None:
            return
        self.event_loop = asyncio.get_running_loop()
        if threading.current_thread() is threading.main_thread():
            self.event_loop.add_signal_handler(signal.SIGTERM, self.signals.append, signal.SIGTERM)
            self.event_loop.add_signal_handler(signal.SIGQUIT, self.signals.append, signal.SIGQUIT)

    def model_input(self, text: str | None, input_ids: list[int] | None) -> list[int]:
        return self.tokenizer.encode(text) if input_ids is None else list(input_ids)


class FakeEngine:
    """`sglang.Engine` as far as the adapter uses it."""

    instances: ClassVar[list[FakeEngine]] = []
    scripts: ClassVar[dict[str, Script]] = {}
    default_script: Script | None = None  # for a prompt without its own script
    token_delay_s = 0.0  # how long each token takes
    tokenizer: Any = None
    fail_start: Exception | None = None
    fail_request: Exception | None = None
    fail_midway: Exception | None = None

    def __init__(self, **kwargs: Any) -> None:
        if FakeEngine.fail_start:
            raise FakeEngine.fail_start
        self.kwargs = dict(kwargs)
        kwargs.setdefault("log_level", "error")  # SGLang: "Do not print logs by default"
        logging.basicConfig(level=kwargs["log_level"].upper(), format="[fake sglang] %(message)s", force=True)
        self.launch_signals: list[int] = []
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGQUIT, lambda signum, frame: self.launch_signals.append(signum))
        self.tokenizer_manager = FakeTokenizerManager(FakeEngine.tokenizer or FakeTokenizer())
        self.requests: list[dict[str, Any]] = []
        self.closed_streams = 0
        self.prefilled: list[list[int]] = []  # every prompt so far: what its radix cache would hold
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
        assert stream is True and isinstance(sampling_params, dict)
        assert (prompt is None) != (input_ids is None), "one of text and input_ids"
        batch = prompt if prompt is not None else input_ids
        assert isinstance(batch, list) and batch and isinstance(batch[0], (str, list))
        texts = prompt or [None] * len(batch)
        ids = input_ids or [None] * len(batch)
        model_inputs = [self.tokenizer_manager.model_input(t, i) for t, i in zip(texts, ids, strict=True)]
        self.requests.append(
            {
                "prompt": prompt,
                "input_ids": input_ids,
                "model_inputs": model_inputs,
                "sampling_params": sampling_params,
                "return_logprob": return_logprob,
                "stream": stream,
            }
        )
        return self._stream(model_inputs, sampling_params, bool(return_logprob))

    async def _stream(self, model_inputs: list[list[int]], params: dict, return_logprob: bool) -> AsyncIterator[dict]:
        """Interleaves the prompts' outputs, one token each in turn, the last prompt first. Like
        SGLang's, it starts the output loop and checks the request (and may refuse it) only when
        first asked for output."""
        self.tokenizer_manager.auto_create_handle_loop()
        if FakeEngine.fail_request:
            raise FakeEngine.fail_request
        states = [self._outputs(index, ids, params, return_logprob) for index, ids in enumerate(model_inputs)]
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
                    await asyncio.sleep(FakeEngine.token_delay_s)
        finally:
            self.closed_streams += 1  # GeneratorExit here is where SGLang aborts the request

    def _outputs(self, index: int, model_input: list[int], params: dict, return_logprob: bool) -> Iterator[dict]:
        """SGLang's detokenizer, per prompt: deltas appended to a cumulative text; a stop string
        is found in the decoded text and trimmed from the end, but what was sent stays sent. The
        script is the one for the prompt's text (its special tokens skipped)."""
        cached = max((_common_prefix(model_input, seen) for seen in self.prefilled), default=0)
        self.prefilled.append(list(model_input))
        if params["max_new_tokens"] == 0:  # prefill only (SGLang's `Req.is_prefill_only`): finished at once, nothing made
            meta = {"id": f"rid-{index}", "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": len(model_input)}
            meta |= {"completion_tokens": 0, "cached_tokens": min(cached, len(model_input) - 1)}
            yield {"text": "", "output_ids": [], "meta_info": meta, "index": index}
            return
        text = self.tokenizer_manager.tokenizer.decode(model_input, skip_special_tokens=True)
        script = FakeEngine.scripts.get(text, FakeEngine.default_script)
        assert script is not None, f"no script for {text!r}"
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
            sent += decoded[len(sent) :] if len(decoded) > len(sent) else ""
            meta: dict[str, Any] = {
                "id": f"rid-{index}",
                "finish_reason": finish,
                "prompt_tokens": len(model_input),
                "completion_tokens": n,
                "cached_tokens": min(cached, len(model_input) - 1),
            }
            if return_logprob:
                meta["output_token_logprobs"] = [
                    (lp, tid, None) for lp, tid in zip(script.logprobs()[:n], script.ids()[:n], strict=True)
                ]
                meta["input_token_logprobs"] = []
            yield {"text": sent, "output_ids": script.ids()[:n], "meta_info": meta, "index": index}
            if finish is not None:
                return


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
