"""An LLM of a real architecture with random weights, built in process from a model directory that
holds only `config.json` and a tokenizer: for timing at a model's real size with nothing to
download or load (`telerag bench e2e --random-weights`, `scripts/gpu_e2e`). Its text is noise."""

from __future__ import annotations

from pathlib import Path

import torch

from telerag.pipelines.engines.cpu import TransformersEngine
from telerag.pipelines.errors import ModelNotFound


def random_weight_engine(model_dir: Path, *, device: str = "cpu", dtype: torch.dtype | None = None, seed: int = 0) -> TransformersEngine:
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
