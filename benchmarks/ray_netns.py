"""A Ray cluster of several nodes on this one machine, each node in a network namespace of its
own: what a cluster of machines is to Ray (a node per address, nodes that reach each other only
over the network), with the filesystem shared by all of them (it stands for a shared volume).

The network, all of it inside namespaces this harness creates (nothing is added to the host's
own namespace, its firewall is not touched): a "switch" namespace holding a Linux bridge, and one
namespace per node joined to the bridge by a veth pair (the pair is created inside the switch's
namespace with its other end put straight into the node's), the node's end `eth0` with an address
10.77.<s>.<n>/24, where <s> changes from one run to the next. Every name starts with
`telerag-<pid>-<hex>-`; namespaces a dead process left are swept before a new cluster starts.

Ray: the head (`ray start --head`) and the workers (`ray start --address`) each started inside
its namespace with `ip netns exec`, every node with its own `--temp-dir` (a short one: Ray's
Unix sockets live there and a socket path has at most 107 bytes), a small object store and no
dashboard. A driver runs inside a namespace too (`NetnsCluster.python`): the calling process only
orchestrates through subprocesses.

Stopping: never `ray stop`, which stops every Ray process of the machine whatever namespace it
is in (the process IDs are shared), another test's cluster included; the processes in each
node's namespace (`ip netns pids`) are sent SIGTERM, then SIGKILL, then the namespaces are
deleted (their veths and the bridge go with them) and the temp dirs removed.

Used by the multi-node tests and by `telerag bench cluster --nodes N`; `scripts/ray_netns
[--workers N]` starts one and holds it for manual runs until Ctrl-C."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "telerag-"
PORT = 6379  # the head's GCS: each namespace has its own ports, no two runs can clash on it
OBJECT_STORE_BYTES = 100 * 1024**2  # per node (Ray's least is 75 MiB); the default is 30% of the machine's memory
# what a Ray process is started with: nothing reported to Ray's servers, no cluster address
# inherited from the caller's environment
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_DOCKER_CPU_WARNING": "1"}
WAIT_FOR_NODES = """
import json, sys, time, ray
address, ip, count, timeout_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
ray.init(address=address, _node_ip_address=ip, log_to_driver=False, configure_logging=False)
deadline = time.monotonic() + timeout_s
while True:
    alive = [node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]]
    if len(alive) >= count or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps({"alive": sorted(alive)}))
"""


class NetnsError(RuntimeError):
    """A command of the harness failed: its command line, exit status and output are in the message."""


def unavailable() -> str | None:
    """Why a cluster cannot be started here (a test's reason to skip, a command's to refuse), or None."""
    if importlib.util.find_spec("ray") is None:
        return "a multi-node cluster needs the `ray` extra (pip install 'telerag[ray]')"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2): each Ray node of a multi-node cluster runs in a network namespace"
    probe = f"{PREFIX}{os.getpid()}-probe-{secrets.token_hex(2)}"
    made = subprocess.run(["ip", "netns", "add", probe], check=False, capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here (it needs root or CAP_SYS_ADMIN): {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True, timeout=30)
    return None


def run(
    argv: list[str], *, timeout_s: float = 60, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`argv` run to its end; NetnsError with its output if it fails or runs past `timeout_s`."""
    try:
        done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=cwd)
    except subprocess.TimeoutExpired as exc:
        output = f"{tail(exc.stdout)}\n{tail(exc.stderr)}"
        raise NetnsError(f"{' '.join(argv)}: still running after {timeout_s:.0f} s\n{output}") from None
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: exit status {done.returncode}\n{tail(done.stdout)}\n{tail(done.stderr)}")
    return done


def tail(text: str | bytes | None, lines: int = 40) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-lines:])


def namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def pids_in(namespace: str) -> list[int]:
    """The processes whose network namespace is `namespace`."""
    listed = subprocess.run(["ip", "netns", "pids", namespace], check=False, capture_output=True, text=True, timeout=30)
    return [int(pid) for pid in listed.stdout.split() if pid != str(os.getpid())]


def kill_all(namespace: str, grace_s: float = 5.0) -> list[int]:
    """Every process of `namespace` ended, SIGTERM first (a raylet cleans up after itself), then
    SIGKILL for those left after `grace_s`; the processes that needed SIGKILL."""
    for pid in pids_in(namespace):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids_in(namespace) and time.monotonic() < deadline:
        time.sleep(0.2)
    killed = pids_in(namespace)
    for pid in killed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    while pids_in(namespace) and time.monotonic() < deadline:
        time.sleep(0.1)
    return killed


def stale(name: str) -> bool:
    """Whether `name` is `telerag-<pid>-…` of a process that has ended."""
    pid = name.removeprefix(PREFIX).split("-")[0]
    return name.startswith(PREFIX) and pid.isdigit() and not Path(f"/proc/{pid}").exists()


def sweep_stale() -> list[str]:
    """What a run killed before its cleanup left: the namespaces `telerag-<pid>-…` whose process
    has ended (their processes killed, the namespaces deleted) and its temp dirs; the names swept."""
    swept = []
    for name in filter(stale, namespaces()):
        kill_all(name, grace_s=1.0)
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True, timeout=30)
        swept.append(name)
    for path in filter(lambda path: stale(path.name), Path("/tmp").glob(f"{PREFIX}*")):
        shutil.rmtree(path, ignore_errors=True)
        swept.append(str(path))
    return swept


def memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of process `pid` in bytes; PSS shares each shared page among its processes."""
    values = {"Rss": 0, "Pss": 0}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in values:
                values[key] = int(rest.split()[0]) * 1024
    return values["Rss"], values["Pss"]


@dataclass
class Node:
    namespace: str
    ip: str
    temp_dir: Path
    head: bool = False


@dataclass
class NetnsCluster:
    """A head and `workers` worker nodes of `cpus` CPUs each, each in a network namespace of its
    own (see the module's docstring); a context manager that takes every part down at its exit,
    whatever happened. `logs_to`: where each node's Ray logs are copied if the body failed."""

    workers: int = 2
    cpus: int = 1
    object_store_bytes: int = OBJECT_STORE_BYTES
    logs_to: Path | None = None
    start_timeout_s: float = 120.0
    cwd: Path = field(default_factory=Path.cwd)  # where every command runs, and first on its PYTHONPATH
    prefix: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}-")
    subnet: int = field(default_factory=lambda: secrets.randbelow(254) + 1)
    token: str = field(default_factory=lambda: secrets.token_hex(32))
    nodes: list[Node] = field(default_factory=list)
    created: list[str] = field(default_factory=list)  # the namespaces, in the order made
    root: Path | None = None
    killed: dict[str, list[int]] = field(default_factory=dict)  # at stop: the processes that needed SIGKILL

    @property
    def switch(self) -> str:
        return f"{self.prefix}switch"

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def address(self) -> str:
        return f"{self.head.ip}:{PORT}"

    def __enter__(self) -> NetnsCluster:
        try:
            self.start()
        except BaseException:
            self.stop(failed=True)
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        self.stop(failed=kind is not None)

    def start(self) -> None:
        sweep_stale()
        self.root = Path(tempfile.mkdtemp(prefix=self.prefix, dir="/tmp"))  # short: Ray's socket paths
        self.add_namespace(self.switch)
        self.ip_in(self.switch, "link", "add", "br0", "type", "bridge")
        self.ip_in(self.switch, "link", "set", "br0", "up")
        for number in range(self.workers + 1):
            name = "head" if number == 0 else f"worker{number}"
            node = Node(f"{self.prefix}{name}", f"10.77.{self.subnet}.{number + 1}", self.root / name, head=number == 0)
            self.add_namespace(node.namespace)
            port = f"p{number}"  # the switch's end (an interface name is unique per namespace only)
            self.ip_in(self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", node.namespace)
            self.ip_in(self.switch, "link", "set", port, "master", "br0", "up")
            self.ip_in(node.namespace, "addr", "add", f"{node.ip}/24", "dev", "eth0")
            self.ip_in(node.namespace, "link", "set", "eth0", "up")
            self.nodes.append(node)
        for node in self.nodes:
            self.start_ray(node)
        self.wait_for_nodes()

    def add_namespace(self, name: str) -> None:
        run(["ip", "netns", "add", name])
        self.created.append(name)
        self.ip_in(name, "link", "set", "lo", "up")

    def ip_in(self, namespace: str, *args: str) -> None:
        run(["ip", "-n", namespace, *args])

    def env(self) -> dict[str, str]:
        """Every Ray process's and driver's environment: the caller's, less its RAY_ variables,
        with token authentication on and this cluster's own token (`ray start --head` turns it
        on by itself where ~/.ray/auth_token exists, and a worker then fails to join with
        "InvalidAuthToken: Authentication token is missing or incorrect")."""
        env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
        paths = os.pathsep.join(filter(None, [str(self.cwd), env.get("PYTHONPATH")]))
        return {**env, **RAY_ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token, "PYTHONPATH": paths}

    def exec_in(self, namespace: str, argv: list[str], *, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        """`argv` run inside `namespace` to its end (NetnsError if it fails)."""
        return run(["ip", "netns", "exec", namespace, *argv], timeout_s=timeout_s, env=self.env(), cwd=self.cwd)

    def python(self, args: list[str], *, namespace: str | None = None, timeout_s: float = 300) -> subprocess.CompletedProcess:
        """This interpreter run with `args` inside `namespace` (the head's by default) to its end,
        its output captured."""
        return self.exec_in(namespace or self.head.namespace, [sys.executable, *args], timeout_s=timeout_s)

    def driver(self, args: list[str]) -> subprocess.CompletedProcess[str]:
        """This interpreter run with `args` in the head's namespace as a driver of the cluster
        (RAY_ADDRESS the head's), to its end: its standard output captured, its log passed through."""
        argv = ["ip", "netns", "exec", self.head.namespace, sys.executable, *args]
        env = {**self.env(), "RAY_ADDRESS": self.address}
        return subprocess.run(argv, check=False, stdout=subprocess.PIPE, text=True, env=env, cwd=self.cwd)

    def start_ray(self, node: Node) -> None:
        ray = str(Path(sys.executable).with_name("ray"))
        argv = [ray, "start", "--node-ip-address", node.ip, "--temp-dir", str(node.temp_dir), "--disable-usage-stats"]
        argv += [f"--num-cpus={self.cpus}", "--num-gpus=0", f"--object-store-memory={self.object_store_bytes}"]
        if node.head:
            argv += ["--head", f"--port={PORT}", "--include-dashboard=false"]
        else:
            argv += [f"--address={self.address}"]
        self.exec_in(node.namespace, argv, timeout_s=self.start_timeout_s)

    def wait_for_nodes(self) -> list[str]:
        """The nodes' addresses once `ray.nodes()` (from a driver in the head's namespace) shows
        every node alive; NetnsError past `start_timeout_s`."""
        args = ["-c", WAIT_FOR_NODES, self.address, self.head.ip, str(len(self.nodes)), str(self.start_timeout_s)]
        alive = json.loads(self.python(args, timeout_s=self.start_timeout_s + 60).stdout.splitlines()[-1])["alive"]
        if sorted(alive) != sorted(node.ip for node in self.nodes):
            raise NetnsError(f"after {self.start_timeout_s:.0f} s the nodes alive are {alive}, not {[n.ip for n in self.nodes]}")
        return alive

    def restart_ray(self) -> None:
        """The whole cluster lost and started again: every process of every node killed at once
        (SIGKILL: nothing cleans up), then Ray started on each node anew."""
        for node in self.nodes:
            kill_all(node.namespace, grace_s=0.0)
        for node in self.nodes:
            self.start_ray(node)
        self.wait_for_nodes()

    def processes(self) -> dict[str, dict[str, int]]:
        """Each node's processes now: their count, RSS and PSS in bytes (summed)."""
        report = {}
        for node in self.nodes:
            pids = pids_in(node.namespace)
            sizes = [memory(pid) for pid in pids]
            report[node.namespace.removeprefix(self.prefix)] = {
                "processes": len(pids),
                "rss_bytes": sum(rss for rss, _ in sizes),
                "pss_bytes": sum(pss for _, pss in sizes),
            }
        return report

    @contextlib.contextmanager
    def watching_memory(self, every_s: float = 1.0) -> Iterator[dict[str, dict[str, int]]]:
        """`processes()` sampled every `every_s` while the body runs: the dict yielded is filled
        with the sample whose PSS summed over the nodes was the highest."""
        peak: dict[str, dict[str, int]] = {}
        done = threading.Event()

        def total(sample: dict[str, dict[str, int]]) -> int:
            return sum(node["pss_bytes"] for node in sample.values())

        def sample() -> None:
            while not done.wait(every_s):
                now = self.processes()
                if total(now) > total(peak):
                    peak.clear()
                    peak.update(now)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            yield peak
        finally:
            done.set()
            sampler.join()

    def stop(self, *, failed: bool = False) -> None:
        """Every process in the nodes' namespaces ended, the namespaces (veths, bridge) deleted,
        the temp dirs removed (each node's logs copied to `logs_to` first if `failed`)."""
        errors = []
        if failed and self.logs_to is not None:
            for node in self.nodes:
                with contextlib.suppress(OSError):
                    shutil.copytree(node.temp_dir / "session_latest" / "logs", self.logs_to / node.namespace, symlinks=False)
        for name in reversed(self.created):  # the workers before the head, the switch last
            try:
                if forced := kill_all(name):
                    self.killed[name] = forced
                run(["ip", "netns", "del", name])
            except (NetnsError, OSError, subprocess.SubprocessError) as exc:
                errors.append(f"{name}: {exc}")
        self.created.clear()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
        if errors:
            raise NetnsError("the cluster was not taken down whole:\n" + "\n".join(errors))


def describe(cluster: NetnsCluster) -> str:
    """How to reach each node of `cluster`, and a driver's command line."""
    lines = [f"Ray cluster at {cluster.address}, {len(cluster.nodes)} nodes:"]
    for node in cluster.nodes:
        lines.append(f"  {node.ip}  ip netns exec {node.namespace} bash   (Ray temp dir {node.temp_dir})")
    init = f"ray.init(address='{cluster.address}', _node_ip_address='{cluster.head.ip}')"
    lines += [
        "a driver, in the head's namespace (each address given: Ray's own detection finds 127.0.0.1 in a namespace):",
        f"  ip netns exec {cluster.head.namespace} env RAY_AUTH_MODE=token RAY_AUTH_TOKEN={cluster.token} \\",
        f'    {sys.executable} -c "import ray; {init}; print(ray.nodes())"',
    ]
    return "\n".join(lines)
