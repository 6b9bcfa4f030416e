"""`telerag bench sizing`: Chameleon's model of a disaggregated deployment (§6.3),
from per-batch latencies measured here for a datastore and a pipeline: how many inference
replicas and retrieval shard replicas a budget of replicas is best split into.

With b requests in flight on an inference replica, L_I(b) is the time a batch takes without its
searches (the LLM calls, embedding, queueing: `bench e2e`'s cpu mode, latency less the faiss
search) and L_R(b) one search of b queries through the retrieval tier's S shards (`bench tier`).
A request makes s searches. An inference replica waits for its searches, as Chameleon's GPUs
do, so it answers Th_I = b / (L_I(b) + s L_R(b)) requests a second; a set of one replica per
shard answers Th_R = b / (s L_R(b)). With N_I inference replicas and N_R replicas of each shard
the system answers min(N_I Th_I, N_R Th_R); the best split of a budget N = N_I + S N_R (every
replica costing the same, as Chameleon assumes of its accelerators) is found by trying each.

Measured on one machine, both tiers share its cores: the latencies are what each tier costs
here, not what each would cost on nodes of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from telerag.benchmarks.e2e import E2EConfig, LLMChoice, run_configured_e2e
from telerag.benchmarks.tier import TierBenchConfig, run_tier_bench
from telerag.config.settings import Settings


@dataclass(frozen=True)
class SizingRow:
    batch: int
    searches_per_request: float  # s
    inference_ms: float  # L_I(b)
    retrieval_ms: float  # L_R(b): one search of b queries through every shard
    inference_rps: float  # Th_I: one inference replica
    retrieval_rps: float  # Th_R: one replica of every shard
    inference_replicas: int  # N_I of the best split of the budget
    shard_replicas: int  # N_R: replicas of each shard
    throughput_rps: float  # min(N_I Th_I, N_R Th_R)
    inference_share: float  # N_I / (N_I + S N_R)


def chameleon(batch: int, searches: float, inference_ms: float, retrieval_ms: float, shards: int, budget: int) -> SizingRow:
    """The model's throughputs and the best split of `budget` replicas (at least one of each)."""
    search_s = searches * retrieval_ms / 1e3
    inference_rps = batch / (inference_ms / 1e3 + search_s)
    retrieval_rps = batch / search_s if search_s else float("inf")
    splits = [(budget - shards * n_r, n_r) for n_r in range(1, budget) if budget - shards * n_r >= 1]
    if not splits:
        raise ValueError(f"a budget of {budget} replicas holds no inference replica beside one replica of {shards} shards")
    n_i, n_r = max(splits, key=lambda split: (min(split[0] * inference_rps, split[1] * retrieval_rps), split[0]))
    return SizingRow(
        batch=batch,
        searches_per_request=searches,
        inference_ms=inference_ms,
        retrieval_ms=retrieval_ms,
        inference_rps=inference_rps,
        retrieval_rps=retrieval_rps,
        inference_replicas=n_i,
        shard_replicas=n_r,
        throughput_rps=min(n_i * inference_rps, n_r * retrieval_rps),
        inference_share=n_i / (n_i + shards * n_r),
    )


@dataclass
class SizingReport:
    datastore: str
    pipeline: str
    llm: str
    shards: int
    budget: int
    rows: list[SizingRow] = field(default_factory=list)


def run_sizing(
    settings: Settings,
    e2e_config: E2EConfig,
    tier_config: TierBenchConfig,
    *,
    budget: int,
    llm: LLMChoice = LLMChoice.CONFIGURED,
    log: Callable[[str], None] = print,
) -> SizingReport:
    """`bench e2e` (cpu mode) for L_I, then `bench tier` (on Ray) for L_R, at the same batches."""
    (shards,) = tier_config.shards
    e2e = run_configured_e2e(settings, e2e_config, llm=llm, log=log)
    tier = run_tier_bench(tier_config, progress=False)
    search_ms = {row.batch: row.tier_ms_p50 for row in tier.rows}
    report = SizingReport(
        datastore=str(Path(tier_config.datastore)), pipeline=e2e_config.pipelines[0], llm=e2e.llm, shards=shards, budget=budget
    )
    for row in e2e.rows:  # the search itself leaves the replica; embedding q_out and queueing stay
        inference_ms = row.latency_ms_mean - row.retrieval_cpu_ms_mean - row.retrieval_device_ms_mean
        report.rows.append(chameleon(row.batch, row.searches_mean, inference_ms, search_ms[row.batch], shards, budget))
    return report


def format_table(report: SizingReport) -> str:
    lines = [
        f"{report.datastore}, pipeline {report.pipeline}, {report.llm}: {report.shards} shards, a budget of "
        f"{report.budget} replicas (N_I + {report.shards} N_R), each costing the same",
        f"{'batch':>5}{'s':>5}{'L_I ms':>9}{'L_R ms':>9}{'Th_I r/s':>10}{'Th_R r/s':>10}{'N_I':>5}{'N_R':>5}"
        f"{'system r/s':>11}{'inference share':>16}",
    ]
    for row in report.rows:
        lines.append(
            f"{row.batch:>5}{row.searches_per_request:>5.1f}{row.inference_ms:>9.1f}{row.retrieval_ms:>9.2f}"
            f"{row.inference_rps:>10.2f}{row.retrieval_rps:>10.1f}{row.inference_replicas:>5}{row.shard_replicas:>5}"
            f"{row.throughput_rps:>11.2f}{row.inference_share:>16.3f}"
        )
    return "\n".join(lines)
