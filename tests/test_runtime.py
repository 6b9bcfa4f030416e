"""Building the runtime's pieces from settings."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from telerag.benchmarks.random_llm import tiny_random_lm
from telerag.cli import runtime_flags
from telerag.cli.main import build_parser
from telerag.config.settings import Settings, SettingsError, load_settings
from telerag.engines.errors import EngineUnavailable
from telerag.engines.transformers.checkpoints import torch_dtype
from telerag.engines.transformers.engine import TransformersEngine
from telerag.engines.types import SamplingParams
from telerag.pipelines.errors import EmbedderError
from telerag.pipelines.registry import PIPELINES
from telerag.retrieval.engine import RetrievalEngine
from telerag.retrieval.errors import DatastoreCorruptError, DatastoreMismatchError, DeviceUnavailable
from telerag.server.errors import status_of
from telerag.server.process import runtime
from telerag.server.process.serve import startup_failure
from telerag.utils.device import resolve_device
from telerag.utils.progress import StepProgress
from tests.fake_sglang import FakeEngine
from tests.retrieval_helpers import random_datastore
from tests.serving import build_small_datastore, save_tiny_lm
from tests.tiny_models import tiny_embedder_dir


def test_sglang_engine_from_settings(sglang, monkeypatch):
    monkeypatch.setattr("telerag.engines.sglang._import_sglang", lambda: sglang)
    settings = Settings(
        engine={
            "kind": "sglang",
            "model_path": "/models/llama",
            "mem_fraction_static": 0.55,
            "context_length": 4096,
            "tp_size": 1,
        },
        server={"log_level": "debug"},
    )
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
    settings = load_settings(None, runtime_flags.overrides(args))
    assert settings.engine.kind == "transformers"
    engine = runtime.build_engine(settings)
    assert isinstance(engine, TransformersEngine) and engine.name == "tiny"
    await engine.close()


def test_bench_e2e_gives_faiss_the_threads_it_is_told(monkeypatch):
    """`bench e2e --cpu-threads N` is `retrieval.cpu_threads` (how a GPU run checks whether faiss's
    threads starve the thread driving the LLM); a command without the flag leaves the setting be."""
    monkeypatch.setenv("TELERAG_RETRIEVAL__CPU_THREADS", "6")
    told = build_parser().parse_args(["bench", "e2e", "--cpu-threads", "4"])
    assert load_settings(None, runtime_flags.overrides(told)).retrieval.cpu_threads == 4
    untold = build_parser().parse_args(["serve"])
    assert load_settings(None, runtime_flags.overrides(untold)).retrieval.cpu_threads == 6


async def test_the_engines_number_type_from_flag_environment_and_file(monkeypatch, tmp_path: Path):
    """`engine.dtype`: auto is float32 on the CPU (the exact default) and the checkpoint's own on
    a GPU; bfloat16 asked for is what the model computes in, and it still answers; a type the
    engine does not know is refused naming the key."""
    model, tokenizer = tiny_random_lm(0)
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    assert torch_dtype("auto", "cpu") is torch.float32 and torch_dtype(None, "cpu") is torch.float32
    assert torch_dtype("auto", "cuda") == "auto" and torch_dtype("float16", "cuda") is torch.float16
    args = build_parser().parse_args(["serve", "--model", str(tmp_path / "tiny"), "--device", "cpu", "--dtype", "bfloat16"])
    engine = runtime.build_engine(load_settings(None, runtime_flags.overrides(args)))
    assert isinstance(engine, TransformersEngine)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    [generation] = await engine.generate([engine.format_prompt("hello")], SamplingParams(max_tokens=3))
    assert generation.completion_tokens > 0
    await engine.close()
    monkeypatch.setenv("TELERAG_ENGINE__DTYPE", "auto")
    engine = runtime.build_engine(load_settings(None, {"engine": {"model_path": tmp_path / "tiny", "device": "cpu"}}))
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
    await engine.close()
    monkeypatch.setenv("TELERAG_ENGINE__DTYPE", "int8")
    with pytest.raises(SettingsError, match=r"engine\.dtype"):
        load_settings()


def test_the_engine_kind_is_transformers_or_sglang(monkeypatch):
    assert Settings().engine.kind == "transformers"
    monkeypatch.setenv("TELERAG_ENGINE__KIND", "cpu")
    assert load_settings().engine.kind == "transformers"
    with pytest.raises(ValidationError, match="kind"):
        Settings(engine={"kind": "vllm"})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--engine", "vllm"])


def test_a_device_that_is_not_there_is_one_start_up_failure(monkeypatch, tmp_path: Path):
    """The engine, the embedder and the retrieval engine resolve a device the same way: CUDA
    asked for without CUDA, or a name torch does not know, is refused before anything loads,
    each part with its own error (the engine's, the embedder's, retrieval's); start-up reports
    it as one line, and HTTP (were it ever to reach it) as a 503, not a 422."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", error=ValueError) == torch.device("cpu")
    assert resolve_device("cpu", error=ValueError) == torch.device("cpu")
    for name in ("cuda", "cuda:1", "gpu"):
        with pytest.raises(DeviceUnavailable):
            resolve_device(name, error=DeviceUnavailable)
    with pytest.raises(EngineUnavailable, match="CUDA is not available"):
        runtime.build_engine(Settings(engine={"device": "cuda"}))
    with pytest.raises(EmbedderError, match="CUDA is not available"):
        runtime.load_embedder(Settings(retrieval={"embedder_device": "cuda"}).retrieval)
    with pytest.raises(DeviceUnavailable, match="CUDA is not available"):
        RetrievalEngine(random_datastore(tmp_path / "ds", n=200, nlist=4), device="cuda")
    for failure in (
        DeviceUnavailable("device 'cuda' asked for, but CUDA is not available here (use auto or cpu)"),
        EngineUnavailable("device 'cuda' asked for, but CUDA is not available here (use auto or cpu)"),
        EmbedderError("device 'cuda' asked for, but CUDA is not available here (use auto or cpu)"),
    ):
        assert startup_failure(failure, tmp_path) == str(failure)
        assert status_of(failure) == 503


def test_cluster_cache_takes_what_the_llm_leaves(monkeypatch):
    import torch

    defaults = Settings().retrieval
    assert runtime.cluster_cache_bytes(defaults, "cpu") == 0  # faiss alone on a CPU box
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: asked.append(device) or (20 << 30, 80 << 30))
    assert runtime.cluster_cache_bytes(defaults, "cuda") == (20 << 30) - (4096 << 20)
    assert runtime.cluster_cache_bytes(defaults, "cuda:1") == (20 << 30) - (4096 << 20)  # a device named by number too
    assert asked == [torch.device("cuda"), torch.device("cuda:1")]  # each one's own free memory
    assert runtime.cluster_cache_bytes(Settings(retrieval={"cache_headroom_mb": 30_000}).retrieval, "cuda") == 0
    assert runtime.cluster_cache_bytes(Settings(retrieval={"cache_mb": 100}).retrieval, "cuda") == 100 << 20


def test_pre_retrieval_profile(tmp_path: Path):
    from telerag.config.settings import pre_retrieval_profile

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
    from telerag.config.settings import load_settings

    config = tmp_path / "c.yaml"
    config.write_text("server:\n  port: 7000\n  host: 0.0.0.0\nscheduler:\n  max_batch: 5\n")
    monkeypatch.setenv("TELERAG_SERVER__PORT", "7100")
    settings = load_settings(config, {"scheduler": {"max_batch": 9}})
    assert settings.server.host == "0.0.0.0"  # from the file
    assert settings.server.port == 7100  # the environment beats the file
    assert settings.scheduler.max_batch == 9  # flags beat both
    with pytest.raises(SettingsError, match="not found"):
        load_settings(tmp_path / "missing.yaml")


def test_the_default_datastore_follows_the_cache_directory(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TELERAG_CACHE_DIR", str(tmp_path / "cache"))
    assert load_settings().retrieval.datastore == tmp_path / "cache" / "datastores" / "wiki-en"
    monkeypatch.setenv("TELERAG_RETRIEVAL__DATASTORE", str(tmp_path / "mine"))
    assert load_settings().retrieval.datastore == tmp_path / "mine"


class Watch:
    """A LoadObserver that records the steps and the progress reports."""

    def __init__(self) -> None:
        self.steps: list[str] = []
        self.reports: list[StepProgress] = []

    def loading(self, step: str) -> None:
        self.steps.append(step)

    def report(self, progress: StepProgress) -> None:
        self.reports.append(progress)


async def test_load_checks_the_datastore_then_loads_the_model_then_opens_it(tmp_path: Path):
    embedder = tiny_embedder_dir(32, 0)
    settings = Settings(
        engine={"model_path": save_tiny_lm(tmp_path / "lm")},
        retrieval={"datastore": build_small_datastore(tmp_path / "ds", embedder), "embedder": embedder},
    )
    watch = Watch()
    async with runtime.open_runtime(settings, watch) as loaded:
        assert watch.steps == ["loading embedder", "checking datastore", "loading model", "opening datastore"]
        checksums = [p for p in watch.reports if p.step == "verify checksums"]
        assert checksums[0].fraction == 0 and checksums[-1].fraction == 1 and checksums[-1].unit == "B"
        assert loaded.datastore_info.passages > 0 and loaded.datastore_info.embedder == embedder.name


async def test_a_damaged_datastore_fails_the_load_before_the_model(tmp_path: Path):
    embedder = tiny_embedder_dir(32, 0)
    datastore = build_small_datastore(tmp_path / "ds", embedder)
    (datastore / "offsets.npy").write_bytes(b"\x93NUMPY garbage of the same length"[: (datastore / "offsets.npy").stat().st_size])
    settings = Settings(
        engine={"model_path": tmp_path / "no-such-model"}, retrieval={"datastore": datastore, "embedder": embedder}
    )
    watch = Watch()
    with pytest.raises(DatastoreCorruptError, match=r"offsets\.npy"):
        await runtime.load_runtime(settings, watch)
    assert watch.steps == ["loading embedder", "checking datastore"]


@pytest.mark.parametrize("other", ["dimension", "embedder"])
async def test_a_datastore_of_another_embedder_is_refused_in_one_line_before_the_model(tmp_path: Path, monkeypatch, other):
    """The datastore's embedder and dimension are checked against the configured embedder's
    before the LLM loads, by the one loader that serve, ask and the benchmarks use."""
    built_with = tiny_embedder_dir(32, 0)
    datastore = build_small_datastore(tmp_path / "ds", built_with)
    if other == "dimension":  # a model of the same name that makes 16-d vectors
        configured = tmp_path / "elsewhere" / built_with.name
        shutil.copytree(tiny_embedder_dir(16, 1), configured)
    else:
        configured = tiny_embedder_dir(32, 1)
    settings = Settings(retrieval={"datastore": datastore, "embedder": configured})
    monkeypatch.setattr(runtime, "build_engine", lambda _: pytest.fail("the LLM was loaded"))
    watch = Watch()
    with pytest.raises(DatastoreMismatchError) as refused:
        await runtime.load_runtime(settings, watch)
    assert watch.steps == ["loading embedder", "checking datastore"]
    line = startup_failure(refused.value, datastore)
    assert "\n" not in line and ("16-d" in line if other == "dimension" else "was built with embedder" in line)
    with pytest.raises(DatastoreMismatchError):  # the benchmarks' way in: the same loader
        runtime.open_retrieval(settings)
