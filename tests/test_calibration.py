"""Admission's measurements kept across a restart (`server/admission/calibration.py`): a server
that finds its own starts from them, deciding as the one that measured them did, and warms up
with one request; one of another configuration, or a file it cannot read, measures itself again."""

from __future__ import annotations

import json

import pytest

from telerag.config.settings import Settings
from telerag.server.admission.calibration import Calibration, calibration_path, load_calibration, save_calibration
from telerag.server.admission.model import EstimateError, Measured, ServiceRate
from telerag.server.admission.workload import CallOutput, ServedWork, Workload
from tests.fakes import Reply, ScriptedEngine
from tests.test_admission import app_client

SERVED = ServedWork(400, (CallOutput(30, False), CallOutput(64, True, cut=True)))


async def warmed_service(engine, **sections):
    client, app = app_client(engine, **sections)
    async with client:
        await app.state.service.warm_up()
    return app.state.service


async def test_a_restored_server_decides_as_the_one_that_measured(tmp_path):
    service = await warmed_service(ScriptedEngine(lambda prompt: Reply("a short answer.")))
    service.workload.observe("hyde", 300, SERVED, temperature=1.5)  # a hot request: measured apart
    path = tmp_path / "admission.json"
    save_calibration(path, service.calibration())

    client, app = app_client(ScriptedEngine(lambda prompt: Reply("a short answer.")))
    restored = app.state.service
    async with client:
        assert restored.restore_calibration(path)
    before, after = service.admission, restored.admission
    assert after.rate.rates() == before.rate.rates() and set(before.rate.rates().measured) >= {1, 8}
    for n in range(1, 20):
        assert after.estimate_factor() == before.estimate_factor() and after.error.factor(n) == before.error.factor(n)
    for name, pipeline in service.pipelines.items():
        for temperature in (0.0, 1.5):
            want = service.workload.estimate(name, pipeline.llm_calls, 400, 64, temperature)
            assert restored.workload.estimate(name, pipeline.llm_calls, 400, 64, temperature) == want, (name, temperature)
    assert restored.workload.recent() == service.workload.recent()


async def test_with_its_measurements_kept_the_warm_up_is_one_request():
    engine = ScriptedEngine(lambda prompt: Reply("a short answer."))
    client, app = app_client(engine)
    async with client:
        await app.state.service.warm_up(measured=True)
    assert len(engine.prompts) == 1  # naive's one answer: the path set up, nothing measured for its own sake
    full = ScriptedEngine(lambda prompt: Reply("a short answer."))
    client, app = app_client(full)
    async with client:
        await app.state.service.warm_up()
    assert len(full.prompts) > 16  # the burst and every pipeline


def test_a_file_that_cannot_be_read_is_set_aside_and_nothing_is_restored(tmp_path):
    path = tmp_path / "admission.json"
    workload, measured = Workload(), Measured(ServiceRate(), EstimateError())
    for text in ("{not json", json.dumps({"version": 0}), json.dumps({"version": 1, "workload": [{"pipeline": "naive"}]})):
        path.write_text(text)
        assert load_calibration(path, workload, measured) is None
        assert not path.exists() and path.with_suffix(".unread").read_text() == text
    assert workload.recent() == {} and measured.rate.work == {} and measured.error.ratios == {}
    assert load_calibration(tmp_path / "none.json", workload, measured) is None  # none kept yet


def test_a_fixed_limits_calibration_keeps_the_workload_alone(tmp_path):
    workload = Workload()
    workload.observe("naive", 350, SERVED)
    path = tmp_path / "fixed.json"
    save_calibration(path, Calibration(workload, None))
    again = Workload()
    assert load_calibration(path, again, None) is not None and again.recent() == workload.recent()


@pytest.mark.parametrize(
    "change",
    [
        {"engine": {"dtype": "bfloat16"}},
        {"engine": {"model_path": "/models/other"}},
        {"scheduler": {"max_concurrency": 8}},
        {"scheduler": {"admission": "fixed"}},
    ],
)
def test_each_configuration_has_a_file_of_its_own(tmp_path, change):
    same = calibration_path(tmp_path, Settings(), "gemma")
    assert calibration_path(tmp_path, Settings(server={"port": 9000}), "gemma") == same  # what measures nothing: the same
    assert calibration_path(tmp_path, Settings(**change), "gemma") != same
    assert calibration_path(tmp_path, Settings(), "llama") != same
