"""What admission measured, kept across restarts: each pipeline's recent requests (`Workload`)
and, under the deadline policy, the service rate at each number running and the estimates'
error (`model`). A server that finds the file of its own configuration (the same engine
settings, cores and concurrency: `fingerprint`) starts from it and its warm-up runs one request,
for what the path sets up on first use, instead of the bursts that measure (`Service.warm_up`).

One JSON file per configuration under `server.calibration_dir`, written by rename when the
server stops; one that cannot be read, or was written by another version of this model, is
set aside with a log line and the server measures itself again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from telerag.config.settings import Settings
from telerag.server.admission.model import Measured
from telerag.server.admission.workload import CallOutput, ServedWork, Workload
from telerag.utils.storage import write_by_rename

log = logging.getLogger(__name__)

VERSION = 1  # of what is measured and how (the work model, the rates, the error): a file of another is not read


@dataclass(frozen=True)
class Calibration:
    workload: Workload
    measured: Measured | None  # None: a policy that measures nothing (the fixed limit)

    def to_json(self) -> str:
        served = [
            {"pipeline": pipeline, "hot": hot, "requests": [_served_json(prompt, work) for prompt, work in recent]}
            for (pipeline, hot), recent in self.workload.recent().items()
        ]
        measured = None
        if self.measured is not None:
            rate, error = self.measured.rate, self.measured.error
            measured = {
                "rate": [{"running": n, "work": rate.work[n], "busy_s": rate.busy_s[n]} for n in sorted(rate.work)],
                "error": [{"admitted": n, "ratios": list(ratios)} for n, ratios in sorted(error.ratios.items())],
            }
        return json.dumps({"version": VERSION, "workload": served, "measured": measured})

    @classmethod
    def from_json(cls, text: str, workload: Workload, measured: Measured | None) -> Calibration:
        """The file's measurements, put into `workload` and `measured` (fresh ones, of the
        server's settings) once the whole file has been read; `ValueError` (nothing put) when it
        is not one this version wrote."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"not a calibration of version {VERSION}")
        recent = {
            (str(entry["pipeline"]), bool(entry["hot"])): [(int(r["prompt"]), _served(r)) for r in entry["requests"]]
            for entry in data["workload"]
        }
        kept = data["measured"]
        rates = [(int(p["running"]), float(p["work"]), float(p["busy_s"])) for p in kept["rate"]] if kept else []
        errors = [(int(p["admitted"]), [float(r) for r in p["ratios"]]) for p in kept["error"]] if kept else []
        workload.restore(recent)
        if measured is not None:
            for n, work, busy_s in rates:
                measured.rate.work[n], measured.rate.busy_s[n] = work, busy_s
            for n, ratios in errors:
                measured.error.ratios[n] = deque(ratios, maxlen=measured.error.window)
        return cls(workload, measured)


def _served_json(prompt: int, work: ServedWork) -> dict[str, Any]:
    outputs = [[o.tokens, o.answer, o.cut] for o in work.outputs]
    return {"prompt": prompt, "prefilled": work.prefilled_tokens, "outputs": outputs}


def _served(request: Mapping[str, Any]) -> ServedWork:
    outputs = tuple(CallOutput(int(tokens), bool(answer), bool(cut)) for tokens, answer, cut in request["outputs"])
    return ServedWork(int(request["prefilled"]), outputs)


def calibration_path(directory: Path, settings: Settings, engine: str | None) -> Path:
    """The file, in `directory`, of a server of these settings whose engine is `engine`: what its
    measurements depend on (the engine's settings, the machine's cores, the policy and how many
    run at once) names it."""
    scheduler = settings.scheduler
    configuration = {
        "version": VERSION,
        "engine": engine,
        "engine_settings": settings.engine.model_dump(mode="json"),
        "cores": os.cpu_count(),
        "admission": scheduler.admission,
        "max_concurrency": scheduler.max_concurrency,
    }
    digest = hashlib.sha256(json.dumps(configuration, sort_keys=True, default=str).encode())
    return directory / f"admission-{digest.hexdigest()[:16]}.json"


def load_calibration(path: Path, workload: Workload, measured: Measured | None) -> Calibration | None:
    """The measurements kept at `path`, put into `workload` and `measured`; None (they are left
    as they were) when there are none, or none this server can read (that file is set aside)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        return Calibration.from_json(text, workload, measured)
    except (ValueError, KeyError, TypeError) as exc:
        aside = path.with_suffix(".unread")
        path.replace(aside)
        log.warning("admission's calibration %s could not be read (%s): set aside as %s; measuring again", path, exc, aside)
        return None


def save_calibration(path: Path, calibration: Calibration) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_by_rename(path, calibration.to_json().encode("utf-8"))
