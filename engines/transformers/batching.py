"""The running batch of the transformers engine: rows decoding together in one KV cache, padded
on the left so that every row's next token sits in the same column; rows join it after their
prefill and leave it when they finish (see `transformers`)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from telerag.engines.transformers.decoding import DecodingRow, StreamCall
from telerag.engines.transformers.prefix_cache import LayerKV, PrefixHit


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows as one batch padded on the left, so every row's next token comes at the same
    last position: (input_ids, attention_mask), both (len(rows), longest)."""
    width = max(len(row) for row in rows)
    ids = torch.tensor([[pad_id] * (width - len(row)) + list(row) for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask


@dataclass(eq=False)
class Batch:
    """Rows decoding together. They share one KV cache and one timeline: each row is padded on
    the left so that all rows' next tokens sit at the same last column of `mask`."""

    live: list[DecodingRow]
    next_ids: torch.Tensor  # (rows, n): what the next forward pass feeds (the prompts at first)
    mask: torch.Tensor  # (rows, timeline): 1 where a row has a token, the ones in next_ids included
    positions: torch.Tensor  # (rows, n): each row's own positions of next_ids
    temperature: torch.Tensor  # (rows,)
    top_p: torch.Tensor  # (rows,)
    cache: Any = None

    @classmethod
    def of_prompts(cls, live: list[DecodingRow], pad_id: int, device: torch.device) -> Batch:
        """New rows whose next forward pass is the prefill of their prompts, padded on the left."""
        ids, mask = left_pad([d.row.prompt_ids for d in live], pad_id)
        return cls(
            live=live,
            next_ids=ids.to(device),
            mask=mask.to(device),
            positions=(mask.cumsum(dim=1) - 1).clamp(min=0).to(device),
            temperature=torch.tensor([d.params.temperature for d in live], device=device),
            top_p=torch.tensor([d.params.top_p for d in live], device=device),
        )

    @classmethod
    def of_suffix(cls, row: DecodingRow, hit: PrefixHit, config: Any, device: torch.device) -> Batch:
        """One new row whose next forward pass prefills its prompt after the cached prefix `hit`,
        into a cache that keeps the KV of every prompt token it computes (see `recorded_kv`)."""
        ids = row.row.prompt_ids
        return cls(
            live=[row],
            next_ids=torch.tensor([ids[hit.tokens :]], device=device),
            mask=torch.ones((1, len(ids)), dtype=torch.long, device=device),
            positions=torch.arange(hit.tokens, len(ids), device=device)[None],
            temperature=torch.tensor([row.params.temperature], device=device),
            top_p=torch.tensor([row.params.top_p], device=device),
            cache=recording_cache(config, hit),
        )

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

    def extend(self, other: Batch) -> None:
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


def joined(batch: Batch | None, fresh: Batch | None) -> Batch:
    """The running batch with the freshly prefilled one merged in (either may be missing)."""
    if batch is None or fresh is None:
        joined = batch or fresh
        assert joined is not None
        return joined
    batch.extend(fresh)
    return batch


def calls_in(batch: Batch | None) -> set[StreamCall]:
    """The callers with rows in `batch` (none without a batch): whom a failed step must tell."""
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


def prefix_cacheable(config: Any) -> bool:
    """Whether the model's cache can start from a cached prefix (`Batch.of_suffix`): the layers
    `_fit_cache` understands, sliding ones able to record their past."""
    try:
        from transformers.cache_utils import DynamicCache
    except ImportError:
        return False
    return _resizable(DynamicCache(config=config))


def recording_cache(config: Any, hit: PrefixHit) -> Any:
    """A cache holding `hit`'s KV, its sliding layers recording every token's KV, not only the
    window's, until `end_recording`."""
    from transformers.cache_utils import DynamicCache

    cache: Any = DynamicCache(config=config)  # of the layers `prefix_cacheable` accepted
    for layer, kv in itertools.zip_longest(cache.layers, hit.kv):
        if layer.is_sliding:
            layer.activate_past_recording()
        if kv is None:
            continue
        keys, values = kv
        layer.lazy_initialization(keys, values)
        if layer.is_sliding:
            kept = min(hit.tokens, layer.sliding_window - 1)
            keys, values = keys[:, :, hit.tokens - kept :], values[:, :, hit.tokens - kept :]
            layer.cumulative_length = hit.tokens
        layer.keys, layer.values = keys, values
    return cache


def recorded_kv(cache: Any, tokens: int) -> list[LayerKV]:
    """The KV of the last `tokens` tokens of a recording cache, per layer."""
    return [(layer.keys[:, :, -tokens:], layer.values[:, :, -tokens:]) for layer in cache.layers]


def end_recording(cache: Any) -> None:
    """Sliding layers back to keeping only their window, so the batch can take the cache in."""
    for layer in cache.layers:
        if layer.is_sliding:
            layer.record_past = False
            layer.keys = layer.keys[:, :, -(layer.sliding_window - 1) :]
            layer.values = layer.values[:, :, -(layer.sliding_window - 1) :]
