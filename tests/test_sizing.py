"""Chameleon's model (`benchmarks.sizing.chameleon`): each tier's throughput from per-batch
latencies, and the best split of a budget of replicas between the tiers."""

from __future__ import annotations

import pytest

from telerag.benchmarks.sizing import chameleon


def test_a_balanced_split_serves_what_both_tiers_can():
    # one search of 10 ms, 90 ms besides: an inference replica answers 10 requests/s, a shard 100
    row = chameleon(batch=1, searches=1, inference_ms=90, retrieval_ms=10, shards=1, budget=11)
    assert row.inference_rps == pytest.approx(10) and row.retrieval_rps == pytest.approx(100)
    assert (row.inference_replicas, row.shard_replicas) == (10, 1) and row.throughput_rps == pytest.approx(100)
    assert row.inference_share == pytest.approx(10 / 11)


def test_the_best_split_follows_the_tiers_costs_and_counts_every_shard():
    shares = []
    for retrieval_ms in (1, 10, 50, 200):  # the search grows against the LLM: more of the budget to retrieval
        row = chameleon(batch=8, searches=2, inference_ms=400, retrieval_ms=retrieval_ms, shards=2, budget=40)
        assert row.inference_replicas + 2 * row.shard_replicas <= 40 and min(row.inference_replicas, row.shard_replicas) >= 1
        best = max(
            min(n_i * row.inference_rps, n_r * row.retrieval_rps) for n_r in range(1, 20) for n_i in [40 - 2 * n_r] if n_i >= 1
        )
        assert row.throughput_rps == pytest.approx(best)
        shares.append(row.inference_share)
    assert shares == sorted(shares, reverse=True) and shares[0] > 0.9 and shares[-1] < 0.6


def test_a_budget_without_room_for_both_tiers_is_refused():
    with pytest.raises(ValueError, match="holds no inference replica"):
        chameleon(batch=1, searches=1, inference_ms=10, retrieval_ms=1, shards=4, budget=4)
