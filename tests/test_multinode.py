"""More than one node, here: a Ray cluster of a head and two workers on this machine, each node in
a network namespace of its own (`telerag.benchmarks.ray_netns`), the datastore on the filesystem they all
read (it stands for the shared volume). The retrieval tier deployed from a driver inside the
head's namespace spreads its shard replicas over the nodes, each replica in its node's namespace,
and searches through it equal one faiss index.

The driver's part is this module run as a script inside the namespace
(`python -m tests.test_multinode <json>`); it prints one line, `MULTINODE <json>`, of what it
found, and the test asserts on that."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from tests.netns_cluster import cluster_for_test, driver_findings

pytestmark = [pytest.mark.slow, pytest.mark.minutes(3.5)]  # in CI the tier about 1 min, the bench 2.5

MARK = "MULTINODE "
SHARDS, REPLICAS, CPUS_PER_REPLICA = 2, 2, 0.5  # 4 replicas of 0.5 CPU: more than any one node of 1 CPU holds


def replica_placement(app: str) -> list[dict]:
    """Each replica of the application's shards: its deployment, and the node, address and
    network namespace it runs in, as the replica itself sees them."""
    from telerag.benchmarks.cluster import ask_replicas

    def where(_replica: object) -> dict:
        import os

        import ray  # in the replica's process

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "netns": os.readlink("/proc/self/ns/net"),
            "pid": os.getpid(),
        }

    return [
        {"deployment": deployment, **found}
        for _, deployment, found in ask_replicas((app,), where, timeout_s=60)
        if deployment.startswith("shard-")
    ]


def compare(tier: object, datastore: Path, searches: int) -> dict:
    """`searches` random searches (1 to 8 queries, a random nprobe, some lists -1 as the device's)
    through the tier and through one faiss index over the whole datastore: how many, and those
    whose results differ."""
    import numpy as np

    from telerag.retrieval.datastore import Datastore
    from telerag.retrieval.ivf import CPUIndex, same_results
    from tests.retrieval_helpers import random_queries

    whole = CPUIndex(Datastore.load(datastore))
    rng = np.random.default_rng(7)
    differ, compared = [], 0
    for i in range(searches):
        q = random_queries(int(rng.integers(1, 9)), whole.datastore.dim, seed=i)
        list_scores, lists = whole.probe(q, int(rng.integers(1, whole.nlist + 1)))
        lists = np.where(rng.random(lists.shape) < 0.2, -1, lists)
        for k in (1, 10):
            got = tier.search_lists(q, k, lists, list_scores)  # type: ignore[attr-defined]
            want = whole.search_lists(q, k, lists, list_scores)
            for row in range(len(q)):
                compared += 1
                if not same_results(got[1][row], got[0][row], want[1][row], want[0][row]):
                    differ.append({"search": i, "k": k, "row": row, "got": got[1][row].tolist(), "want": want[1][row].tolist()})
    return {"rows": compared, "differ": differ[:5], "differing": len(differ)}


def drive(args: dict) -> dict:
    """The driver's part, in the head's namespace: connect, deploy the tier, search, report."""
    import ray
    from ray import serve

    from telerag.server.ray_serve.tier import APP, TierShape, deploy_tier

    ray.init(address=args["address"], _node_ip_address=args["ip"], log_to_driver=False, configure_logging=False)
    try:
        nodes = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
        serve.start(proxy_location="Disabled")
        started = time.monotonic()
        tier = deploy_tier(args["datastore"], TierShape(shards=SHARDS, replicas=REPLICAS, cpus_per_replica=CPUS_PER_REPLICA))
        deployed_s = time.monotonic() - started
        try:
            states = {name: dict(d.replica_states) for name, d in serve.status().applications[APP].deployments.items()}
            found = {"nodes": nodes, "deploy_s": deployed_s, "replica_states": states}
            found["replicas"] = replica_placement(APP)
            found["search"] = compare(tier, Path(args["datastore"]), args["searches"])
            found["netns"] = os.readlink("/proc/self/ns/net")
            return found
        finally:
            serve.delete(APP)
            serve.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture
def cluster(tmp_path):
    with cluster_for_test(tmp_path / "ray-logs", cpus=1) as running:
        yield running


def test_the_tier_spreads_its_shards_over_three_nodes_in_their_namespaces_and_equals_one_faiss_index(cluster, tmp_path):
    from tests.retrieval_helpers import random_datastore

    random_datastore(tmp_path / "ds", n=3000, dim=16, nlist=24, empty_lists=1)  # on the volume every node reads
    args = {"address": cluster.address, "ip": cluster.head.ip, "datastore": str(tmp_path / "ds"), "searches": 20}
    with cluster.watching_memory() as memory:  # the peak while the driver runs
        done = cluster.python(["-m", "tests.test_multinode", json.dumps(args)], timeout_s=400)
    found = driver_findings(done.stdout, MARK)
    placed = sorted((replica["deployment"], replica["ip"]) for replica in found["replicas"])
    print(json.dumps({"deploy_s": round(found["deploy_s"], 1), "replicas": placed, "peak_memory": memory}))

    ips = {node.ip for node in cluster.nodes}
    assert set(found["nodes"].values()) == ips, found["nodes"]
    shards = {name: states for name, states in found["replica_states"].items() if name != "directory"}
    assert shards == {f"shard-{n}": {"RUNNING": REPLICAS} for n in range(SHARDS)}, found["replica_states"]
    replicas = found["replicas"]
    assert len(replicas) == SHARDS * REPLICAS, replicas
    for replica in replicas:  # each on a node of the cluster, seeing that node's address and namespace
        assert found["nodes"][replica["node_id"]] == replica["ip"], replica
    assert len({replica["node_id"] for replica in replicas}) > 1, replicas  # (a) spread over the nodes
    namespaces = {replica["ip"]: replica["netns"] for replica in replicas}
    assert len(set(namespaces.values())) == len(namespaces), namespaces  # one namespace per node
    assert os.readlink("/proc/self/ns/net") not in namespaces.values()  # none of them this process's (the host's)
    if cluster.head.ip in namespaces:
        assert namespaces[cluster.head.ip] == found["netns"]  # the driver's: the head's
    search = found["search"]
    assert search["rows"] > 0 and search["differing"] == 0, search  # (b) the tier equals one faiss index
    assert sum(node["pss_bytes"] for node in memory.values()) < 6 * 1024**3, memory


def test_bench_cluster_on_nodes_of_their_own_serves_the_one_process_servers_documents_and_finds_each_write(tmp_path, capsys):
    """`telerag bench cluster --nodes 3` brings up its own cluster of three namespaced nodes, runs
    as its driver in the head's namespace (its log passed through, its report brought back), and
    takes it down: the replicas spread over the nodes serve the one-process server's documents,
    and each document written through the ingress is found by the first query after it."""
    import yaml

    from telerag.benchmarks.ray_netns import PREFIX, namespaces, unavailable
    from telerag.cli.main import main
    from tests.test_cluster import question, tiny_cluster_settings

    if reason := unavailable():
        pytest.skip(reason)
    settings = tiny_cluster_settings(
        tmp_path,
        retrieval={"nprobe": 4},
        scheduler={"max_concurrency": 2, "max_queue": 2},
        cluster={"replicas": 2, "shards": 2, "replica_cpus": 0.5, "shard_cpus": 0.5, "routing_stats_period_s": 0.2},
    )
    config, questions = tmp_path / "settings.yaml", tmp_path / "questions.txt"
    config.write_text(yaml.safe_dump(settings.model_dump(mode="json")), encoding="utf-8")
    questions.write_text("".join(f"{question(t, n)} [Topic {t}]\n" for t in range(6) for n in range(2)), encoding="utf-8")
    argv = ["bench", "cluster", "--config", str(config), "--questions", str(questions), "--nodes", "3", "--json"]
    argv += ["--routers", "cluster", "--batch", "2", "--runs", "4", "--run-length", "2", "--tier-searches", "3"]
    assert main([*argv, "--write-rate", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    print("\n".join(out[:-1]))
    assert report["nodes"] == 3
    assert not [name for name in namespaces() if name.startswith(f"{PREFIX}{os.getpid()}-")]  # its cluster taken down
    (row,) = report["rows"]
    assert row["nodes"] >= 2 and row["requests"] == 8 and row["same_documents"] == 1.0 and row["remote_overhead"] > 0
    (writes,) = report["writes"]  # the stream once more on new replicas, beside writes at 2 a second
    assert writes["router"] == "cluster" and writes["requests"] == 8 and writes["writes"] > 0
    assert writes["never_found"] == 0 and writes["fresh_ms_p99"] == 0  # every write found by the first query after it
    assert writes["ack_ms_p99"] >= writes["ack_ms_p50"] > 0 and writes["latency_ms_p50_alone"] > 0
    assert out[1].split()[:5] == ["router", "replicas", "shards", "nodes", "batch"] and len(out) == 2 + 1 + 2 + 1
    assert out[3].split()[:3] == ["router", "batch", "requests"]


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (["--nodes", "0"], "bench cluster --nodes: at least 1"),
        (["--node-cpus", "2"], "bench cluster --node-cpus: at least 1, and only with --nodes"),
        (["--nodes", "2", "--node-cpus", "0"], "bench cluster --node-cpus: at least 1, and only with --nodes"),
    ],
)
def test_bench_cluster_refuses_a_node_count_or_node_cpus_it_cannot_honour(flags, refusal):
    from telerag.cli.main import main

    with pytest.raises(SystemExit) as refused:
        main(["bench", "cluster", *flags])
    assert str(refused.value) == refusal


if __name__ == "__main__":
    print(MARK + json.dumps(drive(json.loads(sys.argv[1]))), flush=True)
