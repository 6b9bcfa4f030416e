"""The cluster-aware routing rule (`server.ray_serve.routing.choose`), without Ray: SGLang's imbalance test,
the routing key, the cache's coverage of the question's clusters, and on a stream of questions
with topic locality over replicas with LRU caches, a hit rate above random routing's."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from telerag.server.ray_serve.routing import Balance, Candidate, RouteHint, Rule, choose

BALANCE = Balance(abs_threshold=4, rel_threshold=1.5)


def test_uneven_load_sends_to_the_least_loaded_whatever_the_cache_holds():
    hint = RouteHint(clusters=(1, 2, 3))
    holder, idle = Candidate("a", 9, frozenset({1, 2, 3})), Candidate("b", 2, frozenset())
    assert choose(hint, [holder, idle], BALANCE) == (["b", "a"], Rule.LEAST_LOADED)
    # both thresholds must be passed: 9 - 6 is not more than 4, and 5 - 0 is but 12 - 8 is not 1.5x
    assert choose(hint, [holder, Candidate("b", 6, frozenset())], BALANCE)[1] == Rule.CLUSTERS
    assert choose(hint, [Candidate("a", 12, frozenset({1})), Candidate("b", 8, frozenset())], BALANCE)[1] == Rule.CLUSTERS


def test_the_replica_holding_the_nearest_clusters_comes_first():
    hint = RouteHint(clusters=(7, 8, 9))
    nearest, farther = Candidate("a", 1, frozenset({7})), Candidate("b", 0, frozenset({8, 9}))
    assert choose(hint, [farther, nearest], BALANCE) == (["a", "b"], Rule.CLUSTERS)
    tie = [Candidate("a", 3, frozenset({7})), Candidate("b", 1, frozenset({7}))]
    assert choose(hint, tie, BALANCE) == (["b", "a"], Rule.CLUSTERS)  # equal coverage: the less loaded


def test_a_question_no_cache_holds_goes_to_the_least_loaded_with_the_fewest_clusters():
    candidates = [Candidate("a", 1, frozenset({1})), Candidate("b", 1, frozenset()), Candidate("c", 2, frozenset())]
    assert choose(RouteHint(clusters=(5,)), candidates, BALANCE) == (["b", "a", "c"], Rule.LEAST_LOADED)


def test_a_routing_key_keeps_one_replica_while_the_replicas_stay_the_same():
    replicas = [Candidate(f"r{i}", 0, frozenset({i})) for i in range(4)]
    for key in ("tenant-1", "tenant-2", "x"):
        first, rule = choose(RouteHint(clusters=(1,), key=key), replicas, BALANCE)
        assert rule == Rule.KEY
        assert choose(RouteHint(clusters=(3,), key=key), list(reversed(replicas)), BALANCE)[0][0] == first[0]
    assert len({choose(RouteHint(key=f"k{i}"), replicas, BALANCE)[0][0] for i in range(40)}) == 4  # keys spread


def topic_stream(topics: int, requests: int, run: int, seed: int) -> list[tuple[int, ...]]:
    """Each request's nearest clusters: questions grouped by topic in runs, topics shuffled, each
    topic's clusters its own three of a 3 * topics-list datastore plus a neighbour's one."""
    rng = random.Random(seed)
    stream: list[tuple[int, ...]] = []
    while len(stream) < requests:
        topic = rng.randrange(topics)
        for _ in range(run):
            own = [3 * topic + j for j in rng.sample(range(3), 3)]
            stream.append((*own, (3 * topic + 3) % (3 * topics)))
    return stream[:requests]


def hit_rate(stream: list[tuple[int, ...]], route, replicas: int = 2, capacity: int = 8) -> float:
    """Replicas with LRU caches of `capacity` clusters; a request's clusters are searched there
    (hits: resident already) and then resident."""
    caches = [OrderedDict[int, None]() for _ in range(replicas)]
    hits = total = 0
    for clusters in stream:
        cache = caches[route(clusters, caches)]
        for cluster in clusters:
            hits += cluster in cache
            total += 1
            cache[cluster] = None
            cache.move_to_end(cluster)
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits / total


@pytest.mark.parametrize("seed", range(5))
def test_on_a_stream_with_topic_locality_the_rule_hits_more_than_random_routing(seed):
    stream = topic_stream(topics=5, requests=300, run=3, seed=seed)
    rng = random.Random(seed)

    def by_rule(clusters, caches):
        candidates = [Candidate(str(i), 0, frozenset(cache)) for i, cache in enumerate(caches)]
        return int(choose(RouteHint(clusters=clusters), candidates, BALANCE)[0][0])

    cluster_aware, random_routing = hit_rate(stream, by_rule), hit_rate(stream, lambda clusters, caches: rng.randrange(2))
    assert cluster_aware > random_routing + 0.1, (cluster_aware, random_routing)


def test_replicas_and_shards_without_ray_are_refused_in_one_line():
    from telerag.cli.main import main

    for flag in ("--replicas", "--max-replicas", "--max-shard-replicas"):
        with pytest.raises(SystemExit, match="--replicas, --shards, --max-replicas and --max-shard-replicas need --ray"):
            main(["serve", flag, "2"])


def test_bench_clusters_stream_has_runs_of_one_article_repeats_and_is_seeded():
    from telerag.benchmarks.cluster import StreamShape, topic_stream
    from telerag.pipelines.questions import Question

    questions = [Question(f"q{a}-{n}?", title=f"A{a}") for a in range(5) for n in range(2)] + [Question("lone?", title="Lone")]
    shape = StreamShape(runs=40, run_length=3, repeat_rate=0.0, seed=1)
    stream = topic_stream(questions, shape)
    assert len(stream) == 120 and stream == topic_stream(questions, shape)
    titles = [f"A{a}" for a in range(5)] + ["Lone"]

    def article(text: str) -> str:
        return (
            "Lone"
            if text == "lone?"
            else text.split("-")[0][1:]
            if text.startswith("q")
            else next(t for t in titles if t in text)
        )

    for start in range(0, 120, 3):  # each run about one article: its own questions, then about its title
        run = stream[start : start + 3]
        assert len({article(text).removeprefix("A") for text in run}) == 1, run
    assert "Tell me about Lone." in stream or "What is Lone known for?" in stream
    repeated = topic_stream(questions, StreamShape(runs=200, run_length=3, repeat_rate=0.3, seed=2))
    repeats = sum(text in repeated[:i] for i, text in enumerate(repeated))
    assert repeats >= 0.3 * 600  # a repeat re-asks an earlier question; runs repeat some besides
