"""`telerag bench admission` end to end on the tiny model: a server of its own per policy, bursts
and loads against each, rows that say what the policies did, and the capacity that names the
burst refusals."""

from __future__ import annotations

import contextlib
import json

import pytest

from telerag.benchmarks import admission
from telerag.benchmarks.admission import (
    AdmissionConfig,
    AdmissionReport,
    Policy,
    _Measured,
    _row,
    format_table,
    policies,
    run_admission_study,
)
from telerag.benchmarks.soak import Answer, Refused, SoakReport
from telerag.cli.main import main
from tests.serving import build_small_datastore, save_tiny_lm
from tests.tiny_models import tiny_embedder_dir


def test_each_policy_is_settings_of_the_server():
    fresh = {"TELERAG_SERVER__CALIBRATION_DIR": "null"}  # each start measures itself, unless kept
    assert Policy("deadline").environment(30.0, "/k") == {"TELERAG_SCHEDULER__ADMISSION_DEADLINE_S": "30.0", **fresh}
    assert Policy("none").environment(30.0, "/k")["TELERAG_SCHEDULER__ADMISSION"] == "fixed"  # with a queue of no bound
    fixed = Policy("fixed", 4).environment(30.0, "/k")
    assert fixed["TELERAG_SCHEDULER__ADMISSION"] == "fixed" and fixed["TELERAG_SERVER__CALIBRATION_DIR"] == "null"
    assert fixed["TELERAG_SCHEDULER__MAX_CONCURRENCY"] == "4" and fixed["TELERAG_SCHEDULER__MAX_QUEUE"] == "0"
    assert [p.name for p in policies(["deadline", "none", "fixed"], [2, 8])] == ["fixed-2", "fixed-8", "none", "deadline"]
    by_margin = policies(["deadline"], [2], [0.1, 0.15])  # the margin compared side by side, a server each
    assert [p.name for p in by_margin] == ["deadline-0.1", "deadline-0.15"]
    assert by_margin[1].environment(30.0, "/k")["TELERAG_SCHEDULER__ADMISSION_MARGIN"] == "0.15"
    (kept,) = policies(["deadline-kept"], [])
    assert kept.name == "deadline-kept" and kept.environment(30.0, "/k")["TELERAG_SERVER__CALIBRATION_DIR"] == "/k"


def test_an_answer_the_servers_deadline_stopped_is_counted_apart_from_goodput():
    answers = [Answer("naive", 5.0), Answer("naive", 29.0, stopped_at_deadline=True), Answer("naive", 31.0)]
    report = SoakReport(users=2, duration_s=10.0, requests=3, answered=3, stopped_at_deadline=1, answers=answers)
    row = _row(_Measured(Policy("deadline"), 2, False, [(report, 10.0)]), 30.0, ("naive", "flare"))
    assert (row.goodput_per_s, row.stopped_at_deadline, row.past_deadline) == (0.1, 1, 1)
    assert row.answered_by_pipeline == {"naive": 3, "flare": 0}  # a pipeline never answered shows as 0
    config = AdmissionConfig(policies=(Policy("deadline"),), users=(2,), bursts=(), pipelines=("naive", "flare"))
    table = format_table(AdmissionReport(config=config, rows=[row], capacity={}))
    assert table.splitlines()[-2:] == ["answered by pipeline:", "  deadline     2 users  naive 3, flare 0"]


def test_rounds_take_the_policies_in_turns_and_each_row_pools_its_rounds(monkeypatch):
    served: list[str] = []
    goodput = {"fixed-4": [2, 1], "none": [1, 1], "deadline": [2, 0]}  # answers within the deadline, by round

    @contextlib.contextmanager
    def serving(config, policy, log, kept_dir):
        served.append(policy.name)
        yield policy.name

    async def measure(url, name, config, questions, log):
        within = goodput[url][sum(s == url for s in served) - 1]
        answers = [Answer("naive", 1.0)] * within + [Answer("naive", 40.0)]  # and one late, each round
        refusals = [Refused(0.01, in_flight=2, reason="deadline"), Refused(0.01, in_flight=5, reason="deadline")]
        report = SoakReport(users=4, duration_s=10.0, requests=len(answers) + 2, answered=len(answers), refused=2,
                            answers=answers, refusals=refusals)  # fmt: skip
        return [(4, False, report, 10.0)]

    monkeypatch.setattr(admission, "serving", serving)
    monkeypatch.setattr(admission, "_measure", measure)
    config = AdmissionConfig(policies=policies(["deadline", "none", "fixed"], [4]), users=(4,), bursts=(), rounds=2)
    report = run_admission_study(config, ["q"], log=lambda line: None)
    assert served == ["fixed-4", "none", "deadline", "none", "deadline", "fixed-4"]  # round 2 starts one later
    served.clear()
    goodput["deadline-kept"] = [0, 1]  # its second start is the one measured
    kept = AdmissionConfig(policies=policies(["deadline", "deadline-kept"], []), users=(4,), bursts=())
    assert [r.mode for r in run_admission_study(kept, ["q"], log=lambda line: None).rows] == ["deadline", "deadline-kept"]
    assert served == ["deadline-kept", "deadline", "deadline-kept"]  # a first start keeps its measurements, unmeasured
    rows = {r.mode: r for r in report.rows}
    assert list(rows) == ["fixed-4", "none", "deadline"]
    assert rows["fixed-4"].goodput_per_s_by_round == [0.2, 0.1] and rows["fixed-4"].goodput_per_s == 3 / 20
    assert rows["deadline"].goodput_per_s_by_round == [0.2, 0.0] and rows["deadline"].goodput_per_s == 2 / 20
    assert rows["none"].requests == 2 * 4 and rows["none"].answered == 4 and rows["none"].past_deadline == 2
    assert report.capacity == {4: 4}  # the best fixed N by its pooled goodput
    assert rows["none"].refused == 4 and rows["none"].refused_burst == 2  # of four refusals, two with fewer than 4 in flight
    assert format_table(report).splitlines()[-4:] == [
        "goodput/s by round:",
        "  fixed-4      4 users  0.20, 0.10",
        "  none         4 users  0.10, 0.10",
        "  deadline     4 users  0.20, 0.00",
    ]


def test_rounds_are_one_or_more(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "admission", "--rounds", "0"])
    assert "--rounds: 0: must be 1 or more" in capsys.readouterr().err


def test_an_admission_margin_out_of_range_is_refused_in_one_line(monkeypatch):
    from telerag.config.settings import SettingsError, load_settings

    monkeypatch.setenv("TELERAG_SCHEDULER__ADMISSION_MARGIN", "1.5")
    with pytest.raises(SettingsError, match="admission_margin"):
        load_settings()


@pytest.mark.slow  # three servers on the tiny model: about a minute
def test_the_command_measures_every_policy_and_prints_a_table_and_one_json_line(tmp_path, capsys):
    embedder = tiny_embedder_dir(32, 0)
    serve = ["--model", str(save_tiny_lm(tmp_path / "lm")), "--embedder", str(embedder), "--device", "cpu",
             "--datastore", str(build_small_datastore(tmp_path / "ds", embedder))]  # fmt: skip
    argv = ["bench", "admission", "--modes", "deadline", "none", "fixed", "--fixed", "1", "--users", "3",
            "--bursts", "3", "--seconds", "3", "--max-tokens", "4", "--json", "--", *serve]  # fmt: skip
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1].split()[:3] == ["mode", "load", "requests"]
    report = json.loads(lines[-1])
    rows = {(r["mode"], r["burst"]): r for r in report["rows"]}
    assert set(rows) == {(mode, burst) for mode in ("fixed-1", "none", "deadline") for burst in (True, False)}
    assert report["capacity"] == {"3": 1}
    burst = rows[("fixed-1", True)]  # one in flight at most: of three sent at once, two refused, at the capacity
    assert burst["requests"] == 3 and burst["answered"] == 1 and burst["refused"] == 2 and burst["refused_burst"] == 0
    assert rows[("none", True)]["answered"] == 3 and rows[("none", False)]["refused"] == 0
    for row in report["rows"]:
        assert row["failures"] == 0 and row["answered"] > 0
        assert row["goodput_per_s"] <= row["answered_per_s"] + 1e-9
        assert row["refused_burst"] <= row["refused"]
