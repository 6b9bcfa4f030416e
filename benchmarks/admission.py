"""`telerag bench admission`: the same load against the same server under three admission
policies, side by side, scored by goodput (whole answers within the deadline per second, DistServe's
measure) beside throughput, latency and refusals.

- `deadline`: this server's admission (`scheduler.admission_deadline_s`), whose promise is that
  an accepted request finishes within the deadline (its p99);
- `none`: everything admitted and queued (vLLM's and SGLang's way): no refusal, no bound on latency
  (`scheduler.admission: fixed` with a queue of no bound);
- `fixed-N`: at most N requests in flight, the rest refused at once (TGI's
  `--max-concurrent-requests`; `scheduler.admission: fixed`, no queue), N swept;
- `deadline-kept`: `deadline` starting from the measurements a start of its own kept
  (`server.calibration_dir`), so that its warm-up is one request; every other policy measures
  itself at every start.

Each policy is a `telerag serve` of its own (started, warmed up and ready before it is measured,
stopped after), with the same settings otherwise; the policy is its settings, so switching it
means a restart. Against each: bursts on the idle server (`bursts` requests sent at once, each
burst waited for), then each number of `users` for `duration_s` (`benchmarks.soak`: closed-loop
users that honour `Retry-After`). A refusal is a *burst refusal* when this run had fewer requests
in flight than the capacity, the N of the fixed policy with the best goodput at that load.

This machine's speed drifts by a quarter from one half hour to the next, and one policy measured
after another takes the drift for a difference between them. With `rounds` R, every policy is
measured R times, in turns (round r starts at the policy after round r-1's first), and each row
pools its rounds; each round's goodput is kept beside it, so that the spread between rounds says
how far a ratio of two rows can be trusted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

from telerag.benchmarks.soak import Answer, Refused, SoakConfig, SoakReport, soak
from telerag.utils.processes import free_port, stop

READY_TIMEOUT_S = 1800.0  # a first start builds the datastore and converts the model
QUEUE_WITHOUT_BOUND = 1_000_000  # `none`: no refusal


@dataclass(frozen=True)
class Policy:
    """An admission policy: `deadline` (with its `margin`, or the server's), `none` or `fixed`
    (with `n` in flight)."""

    kind: str
    n: int | None = None
    margin: float | None = None
    kept: bool = False  # it starts from the measurements a start of its own kept (`server.calibration_dir`)

    @property
    def name(self) -> str:
        if self.kind == "fixed":
            return f"fixed-{self.n}"
        name = self.kind if self.margin is None else f"{self.kind}-{self.margin:g}"
        return f"{name}-kept" if self.kept else name

    def environment(self, deadline_s: float, kept_dir: str) -> dict[str, str]:
        """The settings that make it (the rest as the server is configured): a policy that is
        not `kept` measures itself at every start, as it did before measurements were kept."""
        kept = {"TELERAG_SERVER__CALIBRATION_DIR": kept_dir if self.kept else "null"}
        prefix = "TELERAG_SCHEDULER__"
        if self.kind == "deadline":
            margin = {} if self.margin is None else {f"{prefix}ADMISSION_MARGIN": str(self.margin)}
            return {f"{prefix}ADMISSION_DEADLINE_S": str(deadline_s), **margin, **kept}
        if self.kind == "none":
            return {f"{prefix}ADMISSION": "fixed", f"{prefix}MAX_QUEUE": str(QUEUE_WITHOUT_BOUND), **kept}
        return {f"{prefix}ADMISSION": "fixed", f"{prefix}MAX_CONCURRENCY": str(self.n), f"{prefix}MAX_QUEUE": "0", **kept}


@dataclass(frozen=True)
class AdmissionConfig:
    policies: tuple[Policy, ...]
    users: tuple[int, ...] = (4, 16, 64)
    bursts: tuple[int, ...] = (8, 16)
    duration_s: float = 90.0  # each load's, in each round
    ramp_s: float = 10.0
    pipelines: tuple[str, ...] = ("naive",)
    max_tokens: int = 64
    deadline_s: float = 30.0  # the deadline that goodput counts against, and the `deadline` policy's
    serve_args: tuple[str, ...] = ()  # more `telerag serve` arguments (--config, --model, --datastore, ...)
    timeout_s: float = 600.0  # a request not answered in this long is a failure
    rounds: int = 1  # each policy measured this many times, in turns (see the module's docstring)


@dataclass
class AdmissionRow:
    mode: str
    users: int  # the number of users, or of requests in a burst
    burst: bool  # the requests were sent at once to an idle server
    requests: int
    answered: int
    answered_per_s: float
    goodput_per_s: float  # answered within the deadline, per second (not those the deadline stopped)
    latency_ms_p50: float | None
    latency_ms_p99: float | None
    refused: int
    refused_burst: int  # refusals while fewer requests than the capacity were in flight
    past_deadline: int  # answered, but later than the deadline
    past_1_2_deadline: int  # answered later than 1.2 times the deadline
    stopped_at_deadline: int  # answered with what the server's deadline left them (not goodput)
    failures: int
    refused_ms_p99: float | None
    slowest_ms: dict[str, float] = field(default_factory=dict)  # the slowest answer of each pipeline
    answered_by_pipeline: dict[str, int] = field(default_factory=dict)  # a pipeline the policy starves shows as 0
    goodput_per_s_by_round: list[float] = field(default_factory=list)  # each round's own

    @property
    def load(self) -> str:
        """The load as the table names it."""
        return f"burst {self.users}" if self.burst else f"{self.users} users"


@dataclass
class AdmissionReport:
    config: AdmissionConfig
    rows: list[AdmissionRow]
    capacity: dict[int, int]  # users -> the fixed N with the best goodput at that load

    def to_dict(self) -> dict:
        config = asdict(self.config)
        config["policies"] = [p.name for p in self.config.policies]
        return {"config": config, "capacity": self.capacity, "rows": [asdict(r) for r in self.rows]}


@contextlib.contextmanager
def serving(config: AdmissionConfig, policy: Policy, log: Callable[[str], None], kept_dir: str) -> Iterator[str]:
    """`telerag serve` with `policy`, ready; its URL. Stopped (SIGTERM, then killed) on exit."""
    port = free_port()
    env = {**os.environ, **policy.environment(config.deadline_s, kept_dir), "TELERAG_SERVER__PORT": str(port)}
    command = [sys.executable, "-m", "telerag.cli", "serve", *config.serve_args]
    with tempfile.TemporaryFile() as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            started = time.monotonic()
            while True:
                if process.poll() is not None:
                    output.seek(0)
                    tail = output.read().decode(errors="replace")[-3000:]
                    raise RuntimeError(f"telerag serve ({policy.name}) exited with {process.returncode}:\n{tail}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                        break
                if time.monotonic() - started > READY_TIMEOUT_S:
                    raise RuntimeError(f"telerag serve ({policy.name}) was not ready in {READY_TIMEOUT_S:g} s")
                time.sleep(0.5)
            log(f"{policy.name}: ready in {time.monotonic() - started:.0f} s")
            yield url
        finally:
            stop(process, grace_s=60)


async def _burst(url: str, config: AdmissionConfig, size: int, questions: Sequence[str]) -> SoakReport:
    """`size` requests sent at once to an idle server, as `size` users each sending one."""
    soak_config = SoakConfig(url=url, users=size, duration_s=0.0, pipelines=config.pipelines,
                             max_tokens=config.max_tokens, timeout_s=config.timeout_s, ramp_s=0.0, once=True)  # fmt: skip
    return await soak(soak_config, questions)


def _percentile_ms(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1e3 if values else None


@dataclass
class _Measured:
    """One policy at one load: each round's run of it, with how long each took."""

    policy: Policy
    users: int
    burst: bool
    runs: list[tuple[SoakReport, float]] = field(default_factory=list)

    @property
    def answers(self) -> list[Answer]:
        return [a for report, _ in self.runs for a in report.answers]

    @property
    def refusals(self) -> list[Refused]:
        return [r for report, _ in self.runs for r in report.refusals]

    @property
    def seconds(self) -> float:
        return sum(s for _, s in self.runs)

    def goodput_per_s(self, deadline_s: float) -> float:
        """Answers within `deadline_s`, per second, its rounds pooled."""
        return _within(self.answers, deadline_s) / self.seconds


def _row(measured: _Measured, deadline_s: float, pipelines: Sequence[str], capacity: int | None = None) -> AdmissionRow:
    """The row of `measured`, its rounds pooled; its refusals with fewer than `capacity` in flight
    are burst refusals (none without a capacity)."""
    reports = [report for report, _ in measured.runs]
    answers, refusals = measured.answers, measured.refusals
    latencies = [a.seconds for a in answers]
    slowest: dict[str, float] = {}
    for answer in answers:
        slowest[answer.pipeline] = max(slowest.get(answer.pipeline, 0.0), answer.seconds * 1e3)
    return AdmissionRow(
        mode=measured.policy.name,
        users=measured.users,
        burst=measured.burst,
        requests=sum(r.requests for r in reports),
        answered=len(answers),
        answered_per_s=len(answers) / measured.seconds,
        goodput_per_s=measured.goodput_per_s(deadline_s),
        latency_ms_p50=_percentile_ms(latencies, 50),
        latency_ms_p99=_percentile_ms(latencies, 99),
        refused=len(refusals),
        refused_burst=0 if capacity is None else sum(r.in_flight < capacity for r in refusals),
        past_deadline=sum(s > deadline_s for s in latencies),
        past_1_2_deadline=sum(s > 1.2 * deadline_s for s in latencies),
        stopped_at_deadline=sum(r.stopped_at_deadline for r in reports),
        failures=sum(sum(r.failures.values()) for r in reports),
        refused_ms_p99=_percentile_ms([r.seconds for r in refusals], 99),
        slowest_ms=slowest,
        answered_by_pipeline={name: sum(a.pipeline == name for a in answers) for name in pipelines},
        goodput_per_s_by_round=[_within(report.answers, deadline_s) / s for report, s in measured.runs],
    )


def _within(answers: Sequence[Answer], deadline_s: float) -> int:
    return sum(a.seconds <= deadline_s and not a.stopped_at_deadline for a in answers)


async def _measure(url: str, name: str, config: AdmissionConfig, questions: Sequence[str],
                   log: Callable[[str], None]) -> list[tuple[int, bool, SoakReport, float]]:  # fmt: skip
    """Each burst, then each load, against the server at `url` (policy `name`): (users, burst,
    what came back, seconds)."""
    measured = []
    for size in config.bursts:
        started = time.monotonic()
        report = await _burst(url, config, size, questions)
        seconds = time.monotonic() - started
        measured.append((size, True, report, seconds))
        log(f"{name}: burst of {size}: {report.answered} answered, {report.refused} refused in {seconds:.1f} s")
    for users in config.users:
        soak_config = SoakConfig(url=url, users=users, duration_s=config.duration_s, pipelines=config.pipelines,
                                 max_tokens=config.max_tokens, timeout_s=config.timeout_s, ramp_s=config.ramp_s)  # fmt: skip
        report = await soak(soak_config, questions)
        measured.append((users, False, report, report.duration_s))
        log(f"{name}: {users} users: {report.answered} answered, {report.refused} refused")
    return measured


def run_admission_study(config: AdmissionConfig, questions: Sequence[str], log: Callable[[str], None] = print) -> AdmissionReport:
    """Every policy against its own server, each measured at every burst and load, `config.rounds`
    times in turns."""
    measured: dict[tuple[Policy, int, bool], _Measured] = {}
    with tempfile.TemporaryDirectory(prefix="telerag-admission-kept-") as kept_dir:
        for policy in config.policies:
            if policy.kept:  # a start that measures and keeps what it measured, before those measured
                log(f"{policy.name}: a first start, to keep its measurements")
                with serving(config, policy, log, kept_dir):
                    pass
        for round_ in range(config.rounds):
            first = round_ % len(config.policies)
            for policy in (*config.policies[first:], *config.policies[:first]):
                name = policy.name if config.rounds == 1 else f"{policy.name} (round {round_ + 1} of {config.rounds})"
                with serving(config, policy, log, kept_dir) as url:
                    for users, burst, report, seconds in asyncio.run(_measure(url, name, config, questions, log)):
                        runs = measured.setdefault((policy, users, burst), _Measured(policy, users, burst)).runs
                        runs.append((report, seconds))
    ordered = list(measured.values())  # as round 1 measured them: the policies in their order
    capacity = {}
    for users in {*config.users, *config.bursts}:
        fixed = [(m.goodput_per_s(config.deadline_s), m.policy.n or 0) for m in ordered
                 if m.policy.kind == "fixed" and m.users == users]  # fmt: skip
        if fixed:
            capacity[users] = max(fixed)[1]
    rows = [_row(m, config.deadline_s, config.pipelines, capacity.get(m.users)) for m in ordered]
    return AdmissionReport(config=config, rows=rows, capacity=capacity)


def format_table(report: AdmissionReport) -> str:
    """One line per policy and load, under a header naming the deadline and the pipelines."""

    def num(value: float | None, digits: int = 0) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    config = report.config
    lines = [
        f"deadline {config.deadline_s:g} s, pipelines {','.join(config.pipelines)}, max_tokens {config.max_tokens}, "
        f"{config.duration_s:g} s a load; capacity (best fixed N by goodput): "
        + (", ".join(f"{u} users: {n}" for u, n in sorted(report.capacity.items())) or "-"),
        f"{'mode':<10}{'load':>10}{'requests':>9}{'answered/s':>11}{'goodput/s':>10}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'refused':>8}{'in burst':>9}{'late':>6}{'>1.2x':>6}{'cut':>5}{'failed':>7}",
    ]
    for r in report.rows:
        lines.append(
            f"{r.mode:<10}{r.load:>10}{r.requests:>9}{r.answered_per_s:>11.2f}{r.goodput_per_s:>10.2f}"
            f"{num(r.latency_ms_p50):>9}{num(r.latency_ms_p99):>9}{r.refused:>8}{r.refused_burst:>9}"
            f"{r.past_deadline:>6}{r.past_1_2_deadline:>6}{r.stopped_at_deadline:>5}{r.failures:>7}"
        )
    if len(config.pipelines) > 1:  # where a policy answers some pipelines and not others
        lines.append("answered by pipeline:")
        for r in report.rows:
            counts = ", ".join(f"{name} {count}" for name, count in r.answered_by_pipeline.items())
            lines.append(f"  {r.mode:<10}{r.load:>10}  {counts}")
    if config.rounds > 1:  # the spread that a ratio of two rows is to be read against
        lines.append("goodput/s by round:")
        for r in report.rows:
            lines.append(f"  {r.mode:<10}{r.load:>10}  " + ", ".join(f"{g:.2f}" for g in r.goodput_per_s_by_round))
    return "\n".join(lines)


def policies(kinds: Sequence[str], fixed: Sequence[int], margins: Sequence[float] = ()) -> tuple[Policy, ...]:
    """The policies `kinds` names (`fixed` once per N of `fixed`, `deadline` once per margin of
    `margins`, or with the server's), fixed ones first."""
    chosen = [Policy("fixed", n) for n in fixed] if "fixed" in kinds else []
    if "none" in kinds:
        chosen.append(Policy("none"))
    if "deadline" in kinds:
        chosen += [Policy("deadline", margin=m) for m in margins] if margins else [Policy("deadline")]
    if "deadline-kept" in kinds:
        chosen.append(Policy("deadline", kept=True))
    return tuple(chosen)
