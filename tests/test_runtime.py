"""Building the runtime's pieces from settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from pydantic import ValidationError

from telerag.pipelines.engines.cpu import TransformersEngine, tiny_random_lm
from telerag.pipelines.errors import EngineUnavailable
from telerag.pipelines.registry import PIPELINES
from telerag.server import runtime
from telerag.server.cli import build_parser
from telerag.server.commands import serve
from telerag.server.settings import Settings, load_settings
from tests.test_engine_sglang import FakeEngine, sglang  # noqa: F401 - the fixture


def test_sglang_engine_from_settings(sglang, monkeypatch):  # noqa: F811
    monkeypatch.setattr("telerag.pipelines.engines.sglang._import_sglang", lambda: sglang)
    settings = Settings(engine={"kind": "sglang", "model_path": "/models/llama", "mem_fraction_static": 0.55,
                                "context_length": 4096, "tp_size": 1}, server={"log_level": "debug"})
    engine = runtime.build_engine(settings)
    assert engine.name == "llama"
    assert FakeEngine.instances[-1].kwargs["mem_fraction_static"] == 0.55
    assert FakeEngine.instances[-1].kwargs["context_length"] == 4096
    assert FakeEngine.instances[-1].kwargs["log_level"] == "debug"  # SGLang logs at the server's level
    with pytest.raises(EngineUnavailable, match="model_path"):
        runtime.build_engine(Settings(engine={"kind": "sglang"}))


@pytest.mark.parametrize("kind", ["transformers", "cpu"])
async def test_the_transformers_engine_from_settings_and_flags(kind: str, tmp_path: Path):
    """`transformers` names the engine (it runs on CUDA too); `cpu`, its old name, still works,
    in the settings file, the environment and `telerag serve --engine`."""
    model, tokenizer = tiny_random_lm(0)
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    args = build_parser().parse_args(["serve", "--engine", kind, "--model", str(tmp_path / "tiny"), "--device", "cpu"])
    settings = load_settings(None, serve.overrides(args))
    assert settings.engine.kind == "transformers"
    engine = runtime.build_engine(settings)
    assert isinstance(engine, TransformersEngine) and engine.name == "tiny"
    await engine.close()


def test_the_engine_kind_is_transformers_or_sglang(monkeypatch):
    assert Settings().engine.kind == "transformers"
    monkeypatch.setenv("TELERAG_ENGINE__KIND", "cpu")
    assert load_settings().engine.kind == "transformers"
    with pytest.raises(ValidationError, match="kind"):
        Settings(engine={"kind": "vllm"})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--engine", "vllm"])


def test_cluster_cache_takes_what_the_llm_leaves(monkeypatch):
    import torch

    defaults = Settings().retrieval
    assert runtime.cluster_cache_bytes(defaults, "cpu") == 0  # faiss alone on a CPU box
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (20 << 30, 80 << 30))
    assert runtime.cluster_cache_bytes(defaults, "cuda") == (20 << 30) - (4096 << 20)
    assert runtime.cluster_cache_bytes(Settings(retrieval={"cache_headroom_mb": 30_000}).retrieval, "cuda") == 0
    assert runtime.cluster_cache_bytes(Settings(retrieval={"cache_mb": 100}).retrieval, "cuda") == 100 << 20


def test_pre_retrieval_profile(tmp_path: Path):
    from telerag.server.settings import pre_retrieval_profile

    profile = pre_retrieval_profile()
    assert set(PIPELINES) <= profile.keys() and profile["naive"] == 0 and profile["hyde"] > 0
    bad = tmp_path / "p.yaml"
    bad.write_text("t_llm_ms:\n  hyde: -5\n")
    with pytest.raises(ValueError, match="t_llm_ms"):
        pre_retrieval_profile(bad)
    bad.write_text("copy_gbps: 54\n")
    with pytest.raises(ValueError, match="t_llm_ms"):
        pre_retrieval_profile(bad)


def test_settings_precedence(tmp_path: Path, monkeypatch):
    from telerag.server.settings import load_settings

    config = tmp_path / "c.yaml"
    config.write_text("server:\n  port: 7000\n  host: 0.0.0.0\nscheduler:\n  max_batch: 5\n")
    monkeypatch.setenv("TELERAG_SERVER__PORT", "7100")
    settings = load_settings(config, {"scheduler": {"max_batch": 9}})
    assert settings.server.host == "0.0.0.0"  # from the file
    assert settings.server.port == 7100  # the environment beats the file
    assert settings.scheduler.max_batch == 9  # flags beat both
    with pytest.raises(FileNotFoundError):
        load_settings(tmp_path / "missing.yaml")
