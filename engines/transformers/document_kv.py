"""Per-document KV (TurboRAG), the transformers engine's option that changes answers: each
document's KV is computed once, as if the document directly followed its prompt's head (the
fixed instruction), and reused wherever it lands in later prompts, its keys rotated to their new
positions; only the rest of a prompt (the question) is prefilled. Attention between documents is
lost: TurboRAG fine-tunes its model for that, and without fine-tuning its answers lose 4-6
points on RGB (15-23 on multi-document questions), so this is off unless asked for and measured
(`telerag bench prefix-cache`).

The store keeps heads' and chunks' KV, least recently used out first under a byte budget. Only
the engine's worker thread uses it; other threads read its counters.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from telerag.engines.transformers.prefix_cache import LayerKV, PrefixHit

# RoPE variants whose rotations compose (a key at position p moved by d is the key at p + d):
# fixed frequencies, scaled or not. Dynamic ones change the frequencies with the length.
COMPOSABLE_ROPE = {"default", "linear", "llama3"}

KVOf = Callable[[PrefixHit, Sequence[int]], list[LayerKV]]  # the KV of ids prefilled after a hit


@dataclass(frozen=True)
class ChunkedIds:
    """A prompt's ids cut as `types.DocumentChunks` cut its text: head, chunks, then the tail."""

    head: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]

    def ids(self) -> list[int]:
        """The head's and the chunks' ids, in order (the tail's follow)."""
        return [*self.head, *(i for chunk in self.chunks for i in chunk)]


class DocumentKV:
    """Heads' KV (at their own positions) and documents' KV (after their head), within
    `budget_bytes`; `assemble` builds a prompt's reused prefix from them."""

    def __init__(self, budget_bytes: int, inv_freqs: Sequence[torch.Tensor]) -> None:
        self.budget_bytes = budget_bytes
        self.inv_freqs = list(inv_freqs)  # per layer: its RoPE frequencies (head_dim / 2)
        self.bytes = 0
        self.evicted_bytes = 0
        self._kv: collections.OrderedDict[tuple[tuple[int, ...], ...], list[LayerKV]] = collections.OrderedDict()

    def assemble(self, ids: ChunkedIds, kv_of: KVOf) -> tuple[PrefixHit, int]:
        """The head's KV, then each chunk's KV rotated from where it was computed (right after
        the head) to where it stands, and how many of those tokens the store held; what it did
        not hold is computed with `kv_of` and kept."""
        empty = PrefixHit(0, [])
        head, held = self._get((ids.head,), lambda: kv_of(empty, ids.head))
        reused = len(ids.head) if held else 0
        head_hit = PrefixHit(len(ids.head), head)
        parts, at = [head], len(ids.head)
        for chunk in ids.chunks:
            kv, held = self._get((ids.head, chunk), functools.partial(kv_of, head_hit, chunk))
            parts.append(self._rotated(kv, at - len(ids.head)))
            reused += len(chunk) if held else 0
            at += len(chunk)
        layers = [
            (torch.cat([p[layer][0] for p in parts], dim=2), torch.cat([p[layer][1] for p in parts], dim=2))
            for layer in range(len(head))
        ]
        return PrefixHit(at, layers), reused

    def _get(self, key: tuple[tuple[int, ...], ...], compute: Callable[[], list[LayerKV]]) -> tuple[list[LayerKV], bool]:
        """The KV kept under `key` and True, or what `compute` gives (kept from now on) and False."""
        kv = self._kv.get(key)
        if kv is not None:
            self._kv.move_to_end(key)
            return kv, True
        kv = [(k.clone(), v.clone()) for k, v in compute()]
        self._kv[key] = kv
        self.bytes += _nbytes(kv)
        while self.bytes > self.budget_bytes and self._kv:
            _, dropped = self._kv.popitem(last=False)
            freed = _nbytes(dropped)
            self.bytes -= freed
            self.evicted_bytes += freed
        return kv, False

    def _rotated(self, kv: list[LayerKV], shift: int) -> list[LayerKV]:
        """`kv` with its keys moved `shift` positions on (RoPE: a rotation by shift x frequency)."""
        if shift == 0:
            return kv
        rotated = []
        for (keys, values), inv_freq in zip(kv, self.inv_freqs, strict=True):
            angles = shift * inv_freq.to(device=keys.device, dtype=torch.float64)
            angles = torch.cat([angles, angles])
            cos, sin = angles.cos().to(keys.dtype), angles.sin().to(keys.dtype)
            half = keys.shape[-1] // 2
            turned = torch.cat([-keys[..., half:], keys[..., :half]], dim=-1)  # rotate_half
            rotated.append((keys * cos + turned * sin, values))
        return rotated


def rope_frequencies(model: Any) -> list[torch.Tensor] | None:
    """Each decoder layer's RoPE frequencies, or None where keys cannot be moved exactly (no
    rotary embedding found, partial rotary, a RoPE whose rotations do not compose)."""
    config = getattr(model.config, "text_config", None) or model.config
    rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)
    layers = getattr(config, "num_hidden_layers", None)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rotary is None or not layers:
        return None
    layer_types = getattr(config, "layer_types", None) or []
    if hasattr(rotary, "layer_types") and len(layer_types) == layers:  # Gemma 3: a RoPE per kind of layer
        types: dict[str, str] = getattr(rotary, "rope_type", {})
        if any(types.get(t) not in COMPOSABLE_ROPE for t in layer_types):
            return None
        freqs = [getattr(rotary, f"{t}_inv_freq") for t in layer_types]
    else:
        if getattr(rotary, "rope_type", None) not in COMPOSABLE_ROPE or not hasattr(rotary, "inv_freq"):
            return None
        freqs = [rotary.inv_freq] * layers
    if any(2 * len(f) != head_dim for f in freqs):
        return None
    return [f.detach().float() for f in freqs]


def _nbytes(kv: list[LayerKV]) -> int:
    return sum(k.nbytes + v.nbytes for k, v in kv)
