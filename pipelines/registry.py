"""Pipeline names -> classes, and building them over one engine and one retriever."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from telerag.engines.types import Engine
from telerag.pipelines.errors import UnknownPipeline
from telerag.pipelines.pipelining import PipeliningConfig
from telerag.pipelines.rag.base import RagPipeline
from telerag.pipelines.rag.flare import FLARE
from telerag.pipelines.rag.hyde import HyDE
from telerag.pipelines.rag.iter_retgen import IterRetGen
from telerag.pipelines.rag.iterative import Iterative
from telerag.pipelines.rag.naive import Naive
from telerag.pipelines.rag.self_rag import SelfRAG
from telerag.pipelines.rag.subquestion import SubQuestion
from telerag.pipelines.search_budget import SearchBudget
from telerag.pipelines.types import Retriever

PIPELINES: dict[str, type[RagPipeline]] = {
    cls.name: cls for cls in (Naive, HyDE, SubQuestion, Iterative, IterRetGen, FLARE, SelfRAG)
}


def pipeline_names(spec: str) -> tuple[str, ...]:
    """The pipelines a command-line value names: one, several comma-separated, or `all`."""
    names = tuple(PIPELINES) if spec == "all" else tuple(n.strip() for n in spec.split(",") if n.strip())
    unknown = [n for n in names if n not in PIPELINES]
    if unknown or not names:
        raise UnknownPipeline(f"unknown pipeline(s): {', '.join(unknown) or spec!r}; known: {', '.join(PIPELINES)} or all")
    return names


def build_pipelines(
    engine: Engine,
    retriever: Retriever,
    *,
    names: Sequence[str] | None = None,
    pre_retrieval_ms: Mapping[str, float] | None = None,
    pipelining: PipeliningConfig | None = None,
    search_budget: SearchBudget | None = None,
) -> dict[str, RagPipeline]:
    """`pre_retrieval_ms`: each pipeline's expected pre-retrieval time to start from (see
    `RagPipeline`); the server reads it from `config/prefetch_profiles.yaml`. `pipelining` and
    `search_budget` as `RagPipeline`'s; the pipelines share one search budget (one retriever,
    one queue of searches)."""
    unknown = [n for n in names or () if n not in PIPELINES]
    if unknown:
        raise UnknownPipeline(f"unknown pipeline(s): {', '.join(unknown)}; known: {', '.join(PIPELINES)}")
    seeds = pre_retrieval_ms or {}
    budget = search_budget or SearchBudget()
    return {
        name: PIPELINES[name](engine, retriever, pre_retrieval_ms=seeds.get(name), pipelining=pipelining, search_budget=budget)
        for name in (names or PIPELINES)
    }
