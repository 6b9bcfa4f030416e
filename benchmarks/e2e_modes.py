"""The modes of `telerag bench e2e` (`benchmarks.e2e`), and how the retriever is set up for each.

cpu        every list searched by faiss on the CPU (requests run with `prefetch` off): the
           paper's baseline
lookahead  q_in's clusters prefetched beside the pre-retrieval LLM call into the configured
           cluster cache, then the cooperative search: what the server does
resident   every list resident in a cache as large as the datastore before the first
           request, nothing prefetched: the best possible
primed     before each request, untimed, the lists its searches probe (the cpu mode's q_out
           for the same question) read into the cluster cache and held until it ends, nothing
           prefetched: the best possible where the datastore does not fit (on disk); one
           request at a time
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import torch

from telerag.pipelines.retriever import DirectRetriever
from telerag.pipelines.types import RunOptions, SearchQuery, query_texts, query_vectors


class Mode(StrEnum):
    CPU = "cpu"
    LOOKAHEAD = "lookahead"
    RESIDENT = "resident"
    PRIMED = "primed"


MODES = (Mode.CPU, Mode.LOOKAHEAD, Mode.RESIDENT, Mode.PRIMED)  # cpu first: the others are compared with it
DEFAULT_MODES = MODES[:3]


@contextlib.contextmanager
def configured(retriever: DirectRetriever, mode: Mode) -> Iterator[RunOptions]:
    """Set the retriever up for `mode` (and back afterwards); the request options it runs with.
    `resident` copies every cluster into a cache the size of the datastore, held for the whole
    mode, and turns prefetching off (there is nothing left to copy); `primed` turns it off too
    (`Primer` reads each request's lists)."""
    if mode is Mode.PRIMED:
        budget, retriever.prefetch_budget_bytes = retriever.prefetch_budget_bytes, 0
        try:
            yield RunOptions(prefetch=True)  # the search reads the cache; nothing is prefetched
        finally:
            retriever.prefetch_budget_bytes = budget
        return
    if mode is not Mode.RESIDENT:
        yield RunOptions(prefetch=mode is Mode.LOOKAHEAD)
        return
    engine = retriever.retrieval_engine
    cache_bytes, demand_copy, budget = engine.cache.capacity_bytes, engine.demand is not None, retriever.prefetch_budget_bytes
    engine.resize_cache(retriever.datastore.n_vectors * engine.cache.row_bytes, demand_copy=False)
    everything = engine.cache.acquire(range(engine.nlist), fetch=True)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)  # every copy landed before the first request
    retriever.prefetch_budget_bytes = 0
    try:
        yield RunOptions(prefetch=True)
    finally:
        everything.release()
        retriever.prefetch_budget_bytes = budget
        engine.resize_cache(cache_bytes, demand_copy=demand_copy)


@dataclass(frozen=True)
class Primer:
    """The primed mode's preparation of request i: the lists its searches probe, as the cpu
    mode's request i searched them (the same question, its q_out), read into the cluster cache
    and held there until it is answered."""

    retriever: DirectRetriever
    nprobe: int | None
    searched: list[tuple[tuple[SearchQuery, ...], ...]]  # by the cpu mode's requests: each search's queries

    @contextlib.asynccontextmanager
    async def prepared(self, i: int) -> AsyncIterator[None]:
        queries = [query for search in self.searched[i] for query in search]
        if not queries:
            yield
            return
        engine = self.retriever.retrieval_engine
        embedded = await self.retriever.embed([text for query in queries for text in query_texts(query)])
        _, lists = engine.index.probe(query_vectors(queries, embedded.vectors), self.nprobe or engine.nprobe)
        lease = engine.cache.acquire(np.unique(lists[lists >= 0]), fetch=True)
        try:
            if lease.clusters_skipped:
                raise ValueError(
                    f"the cluster cache ({engine.cache.capacity_bytes / 2**20:.0f} MB) holds {len(lease.resident)} of the "
                    f"{len(lease.resident) + lease.clusters_skipped} lists request {i} probes: give the primed mode a larger one"
                )
            for arrival in lease.arrivals:
                await asyncio.to_thread(arrival.wait)
            yield
        finally:
            lease.release()
