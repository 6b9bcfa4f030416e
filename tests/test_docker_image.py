"""The CPU image built and run for real, offline: a private Docker engine (scripts/docker_engine:
Debian's docker.io, its own data root, socket and pidfile, no bridge), the base image pulled or,
where no registry can be reached, a stand-in made with debootstrap (Debian 12 with its Python
3.11, tagged with the base's name; so this proves the Dockerfile and the project on that, not on
the real python:3.12-slim image). Then, as compose runs it: the `cpu` target built with
`--network host` (with this machine's CPU build of torch where pip has one on disk: `local_wheels`,
the Dockerfile's TORCH_FIND_LINKS; else PyPI's CUDA build, 6 GB); a container on a free port with
a named volume for /data, ready once it has converted the Gemma GGUF (a minute); one question
answered over HTTP; `docker stop` within
compose's stop_grace_period with exit code 0; a new container from the same volume ready within
seconds, the datastore and the converted model not rebuilt. The volume starts with a slice of the
built-in Wikipedia datastore, built here as the server builds the whole one (the same embedder
and passages), so the cold start fits CI's time: the whole set's embedding in the container
takes 6-10 minutes on two cores (measured by hand, docs/benchmarks.md).

Skipped only where no engine can be had (not root, no dockerd, no debootstrap where the base
cannot be pulled, or dockerd cannot start here); a failed build or start fails. The engine and
all it made are removed at the end; with TELERAG_DOCKER_STATE set, the engine's state directory
(base image, build cache) is kept for the next run, and an engine already running there is reused
and left running.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from telerag.utils.processes import free_port
from tests.serving import build_wikipedia_slice

pytestmark = [pytest.mark.slow, pytest.mark.minutes(8.5)]  # in CI: the base image and the build 5.5 min, the runs 3

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "docker_engine"
BUILD_TIMEOUT_S = 1800  # measured here: 2.5 min with the base present and PyPI's torch, pip's downloads 3.2 GB
FIRST_READY_TIMEOUT_S = 600  # the GGUF's conversion (about a minute) and the load
# From the volume: load the model and the datastore, nothing built (the snapshots below prove that, not a clock:
# with the other test worker busy on 2 cores the load alone has taken over 60 s).
WARM_READY_TIMEOUT_S = 300
QUESTION = {"query": "Who painted the Mona Lisa?", "max_tokens": 16}
QUESTION_ARTICLE = "Mona Lisa"


def stop_grace_s() -> float:
    """The stop_grace_period every server service of docker/compose.yaml gets (x-telerag)."""
    spec = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text(encoding="utf-8"))
    return float(spec["x-telerag"]["stop_grace_period"].removesuffix("s"))


def dockerfile_default(arg: str) -> str:
    for line in (ROOT / "docker" / "Dockerfile").read_text(encoding="utf-8").splitlines():
        if line.startswith(f"ARG {arg}="):
            return line.partition("=")[2]
    raise AssertionError(f"docker/Dockerfile declares no ARG {arg}")


@dataclass
class Engine:
    state: Path
    log: Path

    def env(self) -> dict[str, str]:
        return {**os.environ, "TELERAG_DOCKER_STATE": str(self.state)}

    def script(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(SCRIPT), *args], env=self.env(), capture_output=True, text=True, timeout=timeout, check=False)

    def docker(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        done = self.script("docker", *args, timeout=timeout)
        if check:
            assert done.returncode == 0, f"docker {' '.join(args)}: {done.stderr[-3000:]}"
        return done


def mounts_under(path: Path) -> list[str]:
    """Mount points under `path` (what dockerd may leave mounted), deepest first."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        if point == str(path) or point.startswith(f"{path}/"):
            points.append(point)
    return sorted(points, key=len, reverse=True)


def remove_state(state: Path) -> None:
    for point in mounts_under(state):
        subprocess.run(["umount", point], capture_output=True, check=False)
    if mounts_under(state):
        pytest.fail(f"mounts left under {state}: {mounts_under(state)}; not removing it")
    shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    """A private engine with the base image present; stopped (if started here) and removed at the end."""
    if os.geteuid() != 0:
        pytest.skip("starting a Docker engine (dockerd) needs root")
    if shutil.which("dockerd") is None:
        pytest.skip("no dockerd: Debian's docker.io is not installed (.ci/run installs it as root with apt-get)")
    kept = "TELERAG_DOCKER_STATE" in os.environ
    state = Path(os.environ["TELERAG_DOCKER_STATE"]) if kept else Path(tempfile.mkdtemp(prefix="telerag-docker-", dir="/tmp"))
    engine = Engine(state=state, log=state / "dockerd.log")
    was_running = engine.script("status").returncode == 0
    started = engine.script("start", timeout=120)
    if started.returncode != 0:
        if not kept:
            remove_state(state)
        pytest.skip(f"a Docker engine cannot be started here: {started.stderr.strip()[-1500:]}")
    try:
        base = dockerfile_default("PYTHON_IMAGE")
        made = engine.script("base", base, timeout=1200)
        if made.returncode != 0 and shutil.which("debootstrap") is None:
            pytest.skip(
                f"{base} cannot be pulled and there is no debootstrap to make a stand-in "
                f"(.ci/run installs Debian's debootstrap): {made.stderr.strip()[-800:]}"
            )
        assert made.returncode == 0, f"scripts/docker_engine base failed:\n{made.stderr[-3000:]}"
        label = engine.docker("image", "inspect", "-f", '{{index .Config.Labels "org.telerag.stand-in"}}', base).stdout.strip()
        print(f"\n[docker] engine {state}; base {base}: {('stand-in, ' + label) if label else 'pulled'}")
        yield engine
    finally:
        if not was_running:
            stopped = engine.script("stop", timeout=180)
            assert stopped.returncode == 0, stopped.stderr
            if not kept:
                remove_state(state)


@contextlib.contextmanager
def local_wheels() -> Iterator[str | None]:
    """The folder of wheels pip on this machine looks in (its find-links: here, the CPU build of
    torch), served over loopback while the build runs, as the build's TORCH_FIND_LINKS: the image
    then installs that torch where it fits the base's Python rather than PyPI's 2-GB CUDA build.
    None where pip has no such folder (the build takes PyPI's)."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False)
    links = [line.split("=", 1)[1].strip("'\"") for line in listed.stdout.splitlines() if ".find-links=" in line]
    folders = [Path(link) for value in links for link in value.split() if Path(link).is_dir()]
    folder = next((f for f in folders if any(f.glob("torch-*.whl"))), None)
    if folder is None:
        yield None
        return
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(folder), str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline and server.poll() is None, "the wheels' server did not start"
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/"
    finally:
        server.terminate()
        server.wait(30)


@dataclass
class Image:
    tag: str
    build_s: float
    size_bytes: int


@pytest.fixture(scope="session")
def cpu_image(engine: Engine, tmp_path_factory) -> Iterator[Image]:
    """docker/Dockerfile's cpu target, built from the checkout as a user would (the build log is
    kept in pytest's temporary directory); removed at the end."""
    tag = f"telerag:cpu-test-{uuid.uuid4().hex[:8]}"
    log = tmp_path_factory.mktemp("docker") / "build.log"
    started = time.monotonic()
    build = ["build", "--network", "host", "--progress", "plain", "-f", "docker/Dockerfile", "--target", "cpu", "-t", tag]
    with log.open("w") as out, local_wheels() as wheels:
        build += ["--build-arg", f"TORCH_FIND_LINKS={wheels}"] if wheels else []
        command = [str(SCRIPT), "docker", *build, "."]
        done = subprocess.run(
            command, cwd=ROOT, env=engine.env(), stdout=out, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S, check=False
        )
    build_s = time.monotonic() - started
    assert done.returncode == 0, f"the cpu target did not build ({log}):\n" + log.read_text()[-5000:]
    size = int(engine.docker("image", "inspect", "-f", "{{.Size}}", tag).stdout)
    print(f"[docker] built {tag} in {build_s:.0f} s, {size / 1e9:.2f} GB")
    try:
        yield Image(tag=tag, build_s=build_s, size_bytes=size)
    finally:
        engine.docker("image", "rm", "-f", tag, check=False)


@dataclass
class Container:
    engine: Engine
    name: str
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def state(self) -> str:
        return self.engine.docker("inspect", "-f", "{{.State.Status}} {{.State.ExitCode}}", self.name).stdout.strip()

    def logs(self, tail: int = 60) -> str:
        done = self.engine.docker("logs", "--tail", str(tail), self.name, check=False)
        return (done.stdout + done.stderr)[-6000:]

    def wait_ready(self, timeout: float) -> float:
        """Seconds until /ready answers 200; fails at once if the container exits."""
        started = time.monotonic()
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return time.monotonic() - started
            status = self.state()
            assert status.startswith("running"), f"the container exited ({status}):\n{self.logs()}"
            assert time.monotonic() - started < timeout, f"not ready within {timeout} s:\n{self.logs()}"
            time.sleep(0.5)

    def stop(self, grace_s: float) -> tuple[float, int, int]:
        """`docker stop -t grace`: (seconds, docker's exit status, the container's exit code)."""
        started = time.monotonic()
        done = self.engine.docker("stop", "-t", str(int(grace_s)), self.name, timeout=grace_s + 60, check=False)
        took = time.monotonic() - started
        exit_code = int(self.engine.docker("inspect", "-f", "{{.State.ExitCode}}", self.name).stdout)
        return took, done.returncode, exit_code


@pytest.fixture
def run_container(engine: Engine, cpu_image: Image) -> Iterator:
    """Starts containers of the image on the host's network, each on a free port; all removed at the end."""
    names: list[str] = []

    def run(volume: str) -> Container:
        container = Container(engine=engine, name=f"telerag-test-{uuid.uuid4().hex[:8]}", port=free_port())
        names.append(container.name)
        port, data = f"TELERAG_SERVER__PORT={container.port}", f"{volume}:/data"
        engine.docker("run", "--detach", "--name", container.name, "--network", "host", "-e", port, "-v", data, cpu_image.tag)
        return container

    yield run
    for name in names:
        engine.docker("rm", "--force", name, check=False)


@pytest.fixture
def volume(engine: Engine) -> Iterator[str]:
    name = f"telerag-test-data-{uuid.uuid4().hex[:8]}"
    engine.docker("volume", "create", name)
    yield name
    engine.docker("volume", "rm", "--force", name, check=False)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime in ns) of every file under root: a rebuild or a rewrite changes them."""
    files = (path for path in sorted(root.rglob("*")) if path.is_file())
    return {path.relative_to(root).as_posix(): (path.stat().st_ino, path.stat().st_mtime_ns) for path in files}


def ask(container: Container) -> dict:
    response = httpx.post(f"{container.url}/v1/rag/query", json=QUESTION, timeout=120)
    assert response.status_code == 200, response.text
    body = response.json()
    assert isinstance(body["answer"], str) and body["answer"].strip(), body
    assert body["documents"], body
    return body


def test_the_cpu_image_serves_stops_cleanly_and_restarts_from_its_volume(engine, cpu_image, volume, run_container):
    grace = stop_grace_s()
    data = Path(engine.docker("volume", "inspect", "-f", "{{.Mountpoint}}", volume).stdout.strip())
    datastore, models = data / "telerag" / "datastores" / "wiki-en", data / "telerag" / "models"
    build_wikipedia_slice(datastore, [QUESTION_ARTICLE], others=150)

    first = run_container(volume)
    cold_s = first.wait_ready(FIRST_READY_TIMEOUT_S)
    body = ask(first)
    titles = [document.get("title") for document in body["documents"]]
    assert QUESTION_ARTICLE in titles, titles
    print(f"[docker] cold start to /ready {cold_s:.0f} s; answer {body['answer']!r}; documents {titles}")
    stop_s, stop_status, exit_code = first.stop(grace)
    print(f"[docker] docker stop: {stop_s:.1f} s, status {stop_status}, container exit code {exit_code}")
    assert stop_status == 0 and stop_s < grace, f"docker stop took {stop_s:.1f} s (grace {grace} s), status {stop_status}"
    assert exit_code == 0, f"the container exited with {exit_code}:\n{first.logs()}"

    assert (datastore / "manifest.json").is_file() and any(models.iterdir()), sorted(p.name for p in (data / "telerag").iterdir())
    built = snapshot(datastore), snapshot(models)

    second = run_container(volume)
    warm_s = second.wait_ready(WARM_READY_TIMEOUT_S)
    again = ask(second)
    print(f"[docker] warm restart to /ready {warm_s:.1f} s; answer {again['answer']!r}")
    assert (snapshot(datastore), snapshot(models)) == built, "the datastore or the converted model was rebuilt"
    stop_s, stop_status, exit_code = second.stop(grace)
    assert stop_status == 0 and stop_s < grace and exit_code == 0, (stop_s, stop_status, exit_code)
