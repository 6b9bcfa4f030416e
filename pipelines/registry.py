"""Pipeline names -> classes, and building them over one engine and one retriever."""

from __future__ import annotations

from collections.abc import Sequence

from pipelines.errors import UnknownPipeline
from pipelines.rag.base import RagPipeline
from pipelines.rag.flare import FLARE
from pipelines.rag.hyde import HyDE
from pipelines.rag.iter_retgen import IterRetGen
from pipelines.rag.iterative import Iterative
from pipelines.rag.naive import Naive
from pipelines.rag.self_rag import SelfRAG
from pipelines.rag.subquestion import SubQuestion
from pipelines.types import Engine, Retriever

PIPELINES: dict[str, type[RagPipeline]] = {
    cls.name: cls for cls in (Naive, HyDE, SubQuestion, Iterative, IterRetGen, FLARE, SelfRAG)
}


def build_pipelines(engine: Engine, retriever: Retriever, *, names: Sequence[str] | None = None) -> dict[str, RagPipeline]:
    unknown = [n for n in names or () if n not in PIPELINES]
    if unknown:
        raise UnknownPipeline(f"unknown pipeline(s): {', '.join(unknown)}; known: {', '.join(PIPELINES)}")
    return {name: PIPELINES[name](engine, retriever) for name in (names or PIPELINES)}
