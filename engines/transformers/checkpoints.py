"""Reading a causal LM from disk for the transformers engine: a transformers model directory, or
a GGUF file converted to one once and kept in the telerag cache."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from telerag.engines.errors import EngineUnavailable, ModelNotFound
from telerag.utils.storage import file_sha256, user_cache_dir

log = logging.getLogger(__name__)


def converted_gguf(gguf: str | Path, *, cache_dir: str | Path | None = None) -> Path:
    """A transformers model directory (weights and tokenizer) converted from `gguf`.

    transformers reads GGUF by parsing its metadata (a vocabulary of 262k tokens for Gemma 3,
    element by element) and dequantising every tensor, which takes tens of seconds on a CPU even
    with the file parsed once (`_parsed_once`), so it is done once and kept under
    `<cache>/models/<stem>-<sha256 prefix>`: a changed file gets a new directory (hashing the file
    costs little beside the conversion it saves). Written to a temporary directory and renamed, so
    a reader never sees half a model, and two processes converting at once both end with the same
    complete one.
    """
    gguf = Path(gguf).expanduser()
    if not gguf.is_file():
        raise ModelNotFound(f"no GGUF file at {gguf}")
    target = user_cache_dir(cache_dir) / "models" / f"{gguf.stem}-{file_sha256(gguf)[:16]}"
    if target.is_dir():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a transformers model, once (half a minute or more on a CPU); cached at %s", gguf.name, target)
    started = time.perf_counter()
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with _parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            log.info("tokenizer read; dequantising the weights ...")
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **_dequantized())
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


@contextlib.contextmanager
def _parsed_once() -> Iterator[None]:
    """transformers parses a GGUF file three times to convert it (for the tokenizer, the model's
    config and its weights: 20 s each on this project's 2-core machine for Gemma 3's vocabulary);
    here the first parse of each file is kept and handed to the other two. transformers opens the
    file with `gguf.GGUFReader(path)`, looked up in the `gguf` module at each call, so the module's
    name is pointed at a reader that remembers, for the conversion only (this thread's and any
    other's: a conversion runs once per process, and a reader is read-only)."""
    import gguf

    module: Any = gguf
    reader = module.GGUFReader
    parsed: dict[tuple[str, tuple[Any, ...]], Any] = {}

    def read_once(path: os.PathLike[str] | str, *mode: Any) -> Any:
        key = (os.fspath(path), mode)
        if key not in parsed:
            parsed[key] = reader(path, *mode)
        return parsed[key]

    module.GGUFReader = read_once
    try:
        yield
    finally:
        module.GGUFReader = reader


def _dequantized() -> dict[str, Any]:
    """Ask for plain dense weights, which can be saved: newer transformers (with `GgufConfig`)
    may keep GGUF blocks packed and then refuse to save them; older ones always unpack."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def torch_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype | str:
    """`dtype` (a name, or None / "auto"): "auto" is float32 on a CPU and the checkpoint's own on
    an accelerator. float32 on the CPU is the exact default: there a greedy answer came out the
    same alone or batched, with or without the prefix cache; in bfloat16 (twice the speed on a CPU
    with AMX, `cpu_has_amx`) some did not (docs/benchmarks.md)."""
    if dtype is None or dtype == "auto":
        return torch.float32 if device == "cpu" else "auto"
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype):
        raise EngineUnavailable(f"unknown dtype {dtype!r}")
    return resolved


def cpu_has_amx() -> bool:
    """Whether this CPU multiplies bfloat16 natively with AMX tiles (Intel Sapphire Rapids and
    later), where `bfloat16` pays (docs/configuration.md, "Number type on the CPU")."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())
