"""A whole node lost, here: `serve --ray`'s applications (the ingress, two inference replicas,
two retrieval shards of two replicas each) on a Ray cluster of a head and two workers, each node
in a network namespace of its own (`telerag.benchmarks.ray_netns`), the datastore on the filesystem they all
read (the shared volume). Under a load of queries and a stream of document writes, every process
of a worker that holds a shard replica is killed at once (its raylet with them): no acknowledged
write is lost, no answer is served from a partial top-k (each query is a passage's own text,
which must come first; an answer either has it or is a 503/429 in the one error body), Serve
places the lost replicas on the nodes left and they serve again, having read the writer's log.
Where the lost node held the ingress (the writer), the requests in flight there get Serve's
proxy's own error (at most one per client thread), the writes stop until Serve starts it again,
and none acknowledged is lost. Then the writer alone is killed under the writes, wherever it
runs, with the same outcome. Then the whole cluster is lost (every process of every node
killed) and started again: the applications deployed anew find every acknowledged write.

The driver's part is this module run as a script inside the head's namespace
(`python -m tests.test_node_faults <json>`); it prints one line, `FAULTS <json>`, of what it
found, and the test asserts on that."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter

import pytest

from telerag.benchmarks.ray_netns import kill_all, pids_in
from telerag.config.settings import Settings
from tests.document_stream import DocumentStream
from tests.netns_cluster import cluster_for_test, driver_findings

pytestmark = [pytest.mark.slow, pytest.mark.minutes(5.5)]  # about 5 min in CI

MARK = "FAULTS "
QUERIES = 12  # passages whose own text is asked


def placement(app_names: tuple[str, ...]) -> list[dict]:
    """Each Serve replica of the named applications: its deployment and its node's address."""
    from telerag.benchmarks.cluster import replica_places

    return [{"deployment": place.deployment, "ip": place.ip} for place in replica_places(app_names)]


def serve_applications(args: dict) -> tuple[Settings, str]:
    """Connect to the cluster, start Serve's proxy on the head and deploy `serve --ray`'s
    applications (the tier, then the ingress and replicas); the settings and the URL, once ready."""
    import ray
    from ray import serve

    from telerag.benchmarks.cluster import wait_ready
    from telerag.server.ray_serve.applications import deploy_inference, tier_shape
    from telerag.server.ray_serve.tier import deploy_tier

    settings = Settings.model_validate(args["settings"])
    ray.init(address=args["address"], _node_ip_address=args["ip"], log_to_driver=False, configure_logging=False)
    url = f"http://{args['ip']}:{args['port']}"
    serve.start(http_options={"host": args["ip"], "port": args["port"]}, proxy_location="HeadOnly")
    deploy_tier(settings.retrieval.datastore, tier_shape(settings))
    deploy_inference(settings)
    wait_ready(url, 240)
    return settings, url


def drive(args: dict) -> dict:
    """The driver's part, in the head's namespace (see the module's docstring)."""
    import httpx
    import ray
    from ray import serve

    from telerag.retrieval.live import opened
    from telerag.server.ray_serve.applications import APP
    from telerag.server.ray_serve.tier import APP as TIER_APP
    from tests.test_cluster import kill_replica

    settings, url = serve_applications(args)
    with opened(settings.retrieval.datastore) as live:
        snapshot = live.snapshot()
        asked = [
            (p.doc_id, p.text) for p in snapshot.passages_of(list(range(0, snapshot.passages, snapshot.passages // QUERIES)))
        ]

    answers: list[dict] = []
    stop = threading.Event()

    def ask(worker: int) -> None:
        n = worker
        while not stop.is_set():
            doc_id, text = asked[n % len(asked)]
            n += 2
            started = time.monotonic()
            try:
                response = httpx.post(
                    f"{url}/v1/rag/query", json={"query": text, "pipeline": "naive", "max_tokens": 2}, timeout=60
                )
            except httpx.HTTPError as exc:
                answers.append(
                    {"status": 0, "error": type(exc).__name__, "at": time.monotonic(), "s": time.monotonic() - started}
                )
                continue
            try:
                body = response.json()
            except ValueError:  # not this server's answer: Serve's proxy's, for a request whose ingress died
                body = {"raw": response.text[:200]}
            first = body["documents"][0]["doc_id"] if response.status_code == 200 and body.get("documents") else None
            error = body.get("error")  # the one error body: type, code, message
            at = time.monotonic()
            answers.append(
                {"status": response.status_code, "want": doc_id, "first": first, "error": error, "at": at, "s": at - started}
            )

    threads = [threading.Thread(target=ask, args=(w,)) for w in range(2)]
    for thread in threads:
        thread.start()
    stream = DocumentStream(url, pause_s=0.1).start()  # a stream, not a flood
    acknowledged = stream.acknowledged
    try:
        while len(acknowledged) < 5 or len(answers) < 6:
            time.sleep(0.1)
        before = placement((APP, TIER_APP))
        victims = {r["ip"] for r in before if r["deployment"].startswith("shard-")} - {args["ip"]}
        victim = sorted(victims)[0]
        killed_at, acknowledged_before = time.monotonic(), len(acknowledged)
        killed = pids_in(args["namespaces"][victim])
        kill_all(args["namespaces"][victim], grace_s=0.0)
        recovered_s = None
        deadline = killed_at + args["recover_s"]
        wanted = {"inference": 2, "shard-0": 2, "shard-1": 2}
        while time.monotonic() < deadline:  # every replica answering again, none on the lost node
            reachable = Counter(r["deployment"] for r in placement((APP, TIER_APP)) if r["ip"] != victim)
            if all(reachable[name] == count for name, count in wanted.items()):
                recovered_s = time.monotonic() - killed_at
                break
            time.sleep(1.0)
        # then writes and queries through the replaced replicas (one stuck on the lost node may time out first)
        settle = time.monotonic()
        while time.monotonic() - settle < 90 and (
            len(acknowledged) < acknowledged_before + 5 or sum(a["at"] >= settle for a in answers) < 10
        ):
            time.sleep(0.2)
        # then the writer (the ingress, wherever Serve placed it) killed under the writes: Serve starts it
        # again, it cuts a record cut short off its log, and the writes go on
        writer_killed_at = len(acknowledged)
        kill_replica("ingress")
        stream.wait_for(writer_killed_at + 5, 240 - (time.monotonic() - settle))
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
        stream_ended = stream.stop()
    stuck = sum(thread.is_alive() for thread in threads) + (not stream_ended)
    missing = stream.missing()
    found_last = stream.last_found([f"after-{n}" for n in range(6)])  # through both replicas (keys spread)
    serve.shutdown()
    ray.shutdown()
    return {
        "acknowledged_ids": acknowledged,
        "victim": victim,
        "killed_processes": len(killed),
        "placement_before": before,
        "recovered_s": recovered_s,
        "acknowledged": len(acknowledged),
        "acknowledged_before_kill": acknowledged_before,
        "acknowledged_before_writer_kill": writer_killed_at,
        "missing": missing,
        "answers": [{**a, "after_kill": a["at"] >= killed_at} for a in answers],
        "found_last": found_last,
        "stuck_threads": stuck,
    }


def after_restart(args: dict) -> dict:
    """The driver's part once the whole cluster was killed and started again: the applications
    deployed anew over the same volume; which acknowledged writes are missing, and whether a
    search through each replica finds the last one."""
    import ray
    from ray import serve

    _, url = serve_applications(args)
    stream = DocumentStream(url)
    stream.acknowledged.extend(args["acknowledged"])
    missing, found_last = stream.missing(), stream.last_found([f"restart-{n}" for n in range(6)])
    serve.shutdown()
    ray.shutdown()
    return {"missing": missing, "found_last": found_last}


@pytest.fixture
def cluster(tmp_path):
    with cluster_for_test(tmp_path / "ray-logs", cpus=2) as running:
        yield running


def test_a_node_killed_under_queries_and_writes_then_the_whole_cluster_loses_no_acknowledged_write(cluster, tmp_path):
    from tests.test_cluster import tiny_cluster_settings

    settings = tiny_cluster_settings(
        tmp_path,
        retrieval={"nprobe": 6},
        scheduler={"max_concurrency": 2, "max_queue": 4},
        cluster={"replicas": 2, "shards": 2, "shard_replicas": 2, "replica_cpus": 0.5, "shard_cpus": 0.5, "attempts": 3},
    )
    args = {
        "address": cluster.address,
        "ip": cluster.head.ip,
        "port": 8000,
        "settings": settings.model_dump(mode="json"),
        "namespaces": {node.ip: node.namespace for node in cluster.nodes},
        "recover_s": 150,
    }
    found = driver_findings(cluster.python(["-m", "tests.test_node_faults", json.dumps(args)], timeout_s=560).stdout, MARK)
    answers = found["answers"]
    keys = ("victim", "killed_processes", "recovered_s", "acknowledged", "acknowledged_before_kill", "stuck_threads")
    summary = {key: found[key] for key in keys}
    summary["on_victim"] = sorted(r["deployment"] for r in found["placement_before"] if r["ip"] == found["victim"])
    summary["answers"] = {
        "before_kill": sum(not a["after_kill"] for a in answers),
        "after_kill_ok": sum(a["after_kill"] and a["status"] == 200 for a in answers),
        "after_kill_refused": sum(a["after_kill"] and a["status"] != 200 for a in answers),
        "proxy_answers": sum(a["status"] not in (0, 200) and a["error"] is None for a in answers),
        "slowest_s": round(max(a["s"] for a in answers), 1),
        "refused_by": Counter(  # what the refusals said, to tell a failure from another
            f"{a['status']} {a['error']['code']}: {a['error']['message'][:60]}"
            for a in answers
            if a["after_kill"] and isinstance(a["error"], dict)
        ).most_common(4),
    }
    print(json.dumps(summary))

    assert found["killed_processes"] > 0 and not pids_in(args["namespaces"][found["victim"]])
    assert found["missing"] == [], found["missing"]  # no acknowledged write lost
    assert found["acknowledged"] >= found["acknowledged_before_kill"] + 5  # writes went on after the loss
    assert found["acknowledged"] >= found["acknowledged_before_writer_kill"] + 5  # and after the writer's
    proxied = []  # Serve's proxy's own answers: only for the requests in flight where the ingress died
    for answer in answers:
        if answer["status"] == 200:
            assert answer["first"] == answer["want"], answer  # never an answer from a partial top-k
        elif answer["error"] is None:
            proxied.append(answer)
        else:  # refused in the one error body (a lost connection would be 0: none)
            assert answer["status"] in (429, 503) and set(answer["error"]) >= {"type", "message", "code"}, answer
    ingress_deaths = 1 + ("ingress" in summary["on_victim"])  # the writer killed alone, and on the lost node
    assert len(proxied) <= 2 * ingress_deaths and all(a["status"] >= 500 and a["after_kill"] for a in proxied), proxied
    assert found["recovered_s"] is not None, "Serve did not place the lost replicas again"
    assert summary["answers"]["after_kill_ok"] >= 5
    assert all(found["found_last"]), found["found_last"]  # the replaced replicas read the writer's log

    # the whole cluster lost (every process of every node killed) and started again: the datastore
    # comes back at its last acknowledged write
    cluster.restart_ray()
    again = {**args, "acknowledged": found["acknowledged_ids"]}
    restarted = driver_findings(cluster.python(["-m", "tests.test_node_faults", json.dumps(again)], timeout_s=400).stdout, MARK)
    assert restarted["missing"] == [] and all(restarted["found_last"]), restarted


if __name__ == "__main__":
    given = json.loads(sys.argv[1])
    found = after_restart(given) if "acknowledged" in given else drive(given)
    print(MARK + json.dumps(found), flush=True)
    os._exit(0)  # Ray's threads left behind would hold the process
