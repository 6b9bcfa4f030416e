"""All configuration, in one place: `config/default.yaml` (or `--config FILE`), then
environment variables (`TELERAG_…`, nested with `__`, e.g. `TELERAG_SERVER__PORT=9000`), then
`telerag serve` flags, each overriding the one before."""

from __future__ import annotations

import os
from contextvars import ContextVar
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from telerag.utils.files import user_cache_dir

_config_file: ContextVar[Path | None] = ContextVar("telerag_config_file", default=None)  # --config, while loading


def packaged_config(name: str) -> Path:
    """A file of the defaults installed with the package (`config/` in the repository)."""
    return Path(str(resources.files("telerag.config").joinpath(name)))


DEFAULT_CONFIG = packaged_config("default.yaml")


ENGINE_KIND_ALIASES = {"cpu": "transformers"}  # its old name: the transformers engine runs on CUDA too


class EngineSettings(BaseModel):
    kind: Annotated[
        Literal["transformers", "sglang"], BeforeValidator(lambda kind: ENGINE_KIND_ALIASES.get(kind, kind))
    ] = "transformers"
    model_path: Path | None = None  # None: the embedded Gemma 3 270M
    device: str = "auto"
    mem_fraction_static: float = Field(0.6, gt=0, lt=1)  # SGLang: leave room for the cluster cache
    context_length: int | None = None
    tp_size: int = Field(1, ge=1)


class RetrievalSettings(BaseModel):
    datastore: Path = Field(default_factory=lambda: user_cache_dir() / "datastores" / "wiki-en")
    build_if_missing: bool = True  # build the built-in Wikipedia datastore on first run
    embedder: Path | None = None  # None: the packaged all-MiniLM-L6-v2
    embedder_device: str = "auto"
    device: str = "auto"  # where the cluster cache and device search run
    cache_mb: float | None = None  # None: 0 on CPU (straight to faiss); on CUDA what the LLM leaves, less the headroom
    cache_headroom_mb: float = Field(4096, ge=0)  # GPU memory the default cache leaves free (embedder, search, KV growth)
    prefetch_budget_mb: float | None = None  # None: B * t_LLM per pipeline (see pre_retrieval_profile), capped by the cache
    demand_copy: bool | None = None  # copy part of each search's missed clusters too; None: on with CUDA
    cpu_threads: int | None = Field(None, ge=1)  # faiss threads of the CPU half; None: all cores, one fewer on CUDA
    nprobe: int | None = None  # None: 4 * sqrt(nlist)
    top_k: int = Field(3, ge=1)
    verify_checksums: bool = True


class SchedulerSettings(BaseModel):
    batch_window_ms: float = Field(0.0, ge=0)  # extra wait for company when idle; batching under load needs none
    max_batch: int = Field(32, ge=1)
    max_concurrency: int = Field(16, ge=1)  # requests running at once
    max_queue: int = Field(64, ge=0)  # requests waiting beyond those; past it: 429
    request_timeout_s: float = Field(300.0, gt=0)
    # A request that would finish later than this (its estimated work and all admitted before it,
    # at the measured service rate) is refused at once: 429 with Retry-After. None: no deadline.
    admission_deadline_s: float | None = Field(30.0, gt=0)
    max_in_flight_per_key: int | None = Field(None, ge=1)  # requests one API key may have admitted; None: no bound


class LimitSettings(BaseModel):
    max_query_chars: int = Field(4000, ge=1)
    max_top_k: int = Field(50, ge=1)
    max_tokens: int = Field(1024, ge=1)
    max_prompt_tokens: int = Field(8192, ge=1)  # estimated: the query's tokens and top_k passages
    max_body_bytes: int = Field(256 * 1024, ge=1024)


class ServerSettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: SecretStr | None = None
    api_keys: list[SecretStr] = Field(default_factory=list)  # several clients, each with its own key (beside api_key)
    protect_docs: bool = False  # /docs, /redoc, /openapi.json and /metrics need the API key too
    cors_origins: list[str] = Field(default_factory=list)
    log_level: str = "info"
    # After SIGTERM (or SIGINT) the server answers 503 to new work and waits this long for the
    # requests it accepted; past it, or at a second signal, it stops at once (exit status 1).
    shutdown_grace_s: float = Field(30.0, ge=0)
    # Before /ready turns 200, one short request runs through the whole path, so that what the
    # engine, the embedder and the search set up on first use does not stall the first clients.
    warm_up: bool = True
    # How long a thread may hold the GIL before another one waiting for it gets a turn (Python's
    # default: 5 ms). The transformers engine and the retrieval workers are threads of this process; with
    # the default the event loop can wait 5 ms at each wake-up while they run.
    switch_interval_ms: float = Field(0.5, gt=0)
    # Connections (server/connections.py): a request's headers must arrive within header_timeout_s
    # of the connection opening (or of the request's first byte); an idle keep-alive connection is
    # closed after keep_alive_timeout_s; past max_connections open, new ones get only the probes.
    header_timeout_s: float = Field(10.0, gt=0)
    keep_alive_timeout_s: float = Field(5.0, gt=0)
    max_connections: int = Field(1024, ge=1)

    def keys(self) -> list[SecretStr]:
        """Every accepted API key (`api_key` and `api_keys`); none: the API is open."""
        return ([self.api_key] if self.api_key is not None else []) + list(self.api_keys)

    @model_validator(mode="after")
    def _protect_docs_needs_a_key(self) -> ServerSettings:
        if self.protect_docs and not self.keys():
            raise ValueError("server.protect_docs needs an API key (server.api_key or server.api_keys)")
        return self


class _YamlSource(PydanticBaseSettingsSource):
    def __init__(self, settings_cls: type[BaseSettings], path: Path | None) -> None:
        super().__init__(settings_cls)
        self.path = path

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover - unused
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        if self.path is None or not self.path.is_file():
            return {}
        data = yaml.safe_load(self.path.read_text(encoding="utf-8")) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{self.path}: the configuration must be a mapping")
        return data


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TELERAG_", env_nested_delimiter="__", extra="forbid")

    engine: EngineSettings = Field(default_factory=EngineSettings)
    retrieval: RetrievalSettings = Field(default_factory=RetrievalSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = _config_file.get() or Path(os.environ.get("TELERAG_CONFIG", DEFAULT_CONFIG))
        return init_settings, env_settings, _YamlSource(settings_cls, path)


def pre_retrieval_profile(path: Path | None = None) -> dict[str, float]:
    """Each pipeline's expected pre-retrieval time in ms (t_LLM of TeleRAG §4.2), where its
    prefetch budget starts; the pipelines refine it from their own calls. Default: the packaged
    `prefetch_profiles.yaml`."""
    path = path or packaged_config("prefetch_profiles.yaml")
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    times = data.get("t_llm_ms") if isinstance(data, dict) else None
    if not isinstance(times, dict) or not all(isinstance(v, int | float) and v >= 0 for v in times.values()):
        raise ValueError(f"{path}: t_llm_ms must map pipeline names to milliseconds >= 0")
    return {str(name): float(ms) for name, ms in times.items()}


def load_settings(config: Path | None = None, overrides: dict[str, Any] | None = None) -> Settings:
    """Settings from the YAML file, the environment and `overrides` (flags, nested dicts)."""
    if config is not None and not Path(config).is_file():
        raise FileNotFoundError(f"configuration file not found: {config}")
    token = _config_file.set(Path(config) if config is not None else None)
    try:
        return Settings(**(overrides or {}))
    finally:
        _config_file.reset(token)
