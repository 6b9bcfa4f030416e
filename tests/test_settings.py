"""The settings' one source: `config/default.yaml` is generated from the models in
`server/settings.py`, and the manual's table (docs/configuration.md) names every setting; a value a setting cannot take
is refused in one line naming it, from the file, the environment or a flag, and `null` means
None in all three."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from telerag.cli.main import main
from telerag.server.settings import DEFAULT_CONFIG, Settings, SettingsError, defaults_yaml, load_settings

ROOT = Path(__file__).resolve().parents[1]


def every_setting() -> list[str]:
    return [f"{section}.{key}" for section, field in Settings.model_fields.items() for key in field.annotation.model_fields]


def test_the_default_file_is_generated_from_the_settings():
    assert DEFAULT_CONFIG.read_text(encoding="utf-8") == defaults_yaml(), (
        "config/default.yaml differs from server/settings.py: regenerate it with `telerag config defaults > config/default.yaml`"
    )


def test_the_default_file_holds_exactly_the_defaults(monkeypatch, tmp_path):
    """Loaded, the file changes nothing; and every setting is in it (the one that depends on the
    machine as a comment)."""
    monkeypatch.setenv("TELERAG_CONFIG", str(tmp_path / "none.yaml"))  # no file at all
    bare = Settings()
    assert load_settings(DEFAULT_CONFIG) == bare
    written = yaml.safe_load(DEFAULT_CONFIG.read_text(encoding="utf-8"))
    listed = {f"{section}.{key}" for section, keys in written.items() for key in keys}
    commented, section = set(), None
    for line in DEFAULT_CONFIG.read_text(encoding="utf-8").splitlines():
        if match := re.match(r"^(\w+):$", line):
            section = match.group(1)
        elif match := re.match(r"^  # (\w+):", line):
            commented.add(f"{section}.{match.group(1)}")
    assert listed | commented == set(every_setting()) and commented == {"retrieval.datastore", "files.dir", "vector_stores.dir"}


def test_the_manual_documents_every_setting():
    manual = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    table = manual[manual.index("## Configuration") : manual.index("## Number type on the CPU")]
    documented: set[str] = set()
    for row in re.findall(r"^\| (`[^|]*) \|", table, re.M):
        names = re.findall(r"`([\w.*]+)`", row)
        section = names[0].split(".")[0]
        for name in names:
            documented.add(name if "." in name else f"{section}.{name}")
    wildcards = {name.removesuffix(".*") for name in documented if name.endswith(".*")}
    missing = [s for s in every_setting() if s not in documented and s.split(".")[0] not in wildcards]
    assert not missing, f"the configuration table (docs/configuration.md) lacks {missing}"


@pytest.mark.parametrize(
    ("source", "key"), [("file", "admission_deadline_s"), ("environment", "admission_deadline_s"), ("flag", "nprobe")]
)
def test_null_means_none_from_every_source(source, key, tmp_path, monkeypatch):
    config = tmp_path / "c.yaml"
    config.write_text("scheduler:\n  admission_deadline_s: 10\nretrieval:\n  nprobe: 7\n")
    if source == "file":
        config.write_text("scheduler:\n  admission_deadline_s: null\n")
    elif source == "environment":
        monkeypatch.setenv("TELERAG_SCHEDULER__ADMISSION_DEADLINE_S", "null")
    settings = load_settings(config, {"retrieval": {"nprobe": None}} if source == "flag" else None)
    assert (settings.retrieval.nprobe if key == "nprobe" else settings.scheduler.admission_deadline_s) is None


def test_a_null_flag_is_read_as_none_and_an_absent_one_as_not_given(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("retrieval:\n  nprobe: 7\n")
    assert main(["config", "show", "--config", str(config), "--nprobe", "null"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["retrieval"]["nprobe"] is None
    assert main(["config", "show", "--config", str(config)]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["retrieval"]["nprobe"] == 7


@pytest.mark.parametrize(
    ("setup", "argv", "message"),
    [
        (
            {"TELERAG_SCHEDULER__ADMISSION_DEADLINE_S": "soon"},
            [],
            "scheduler.admission_deadline_s: Input should be a valid number",
        ),
        ({"TELERAG_SCHEDULER__ADMISSION_DEADLINE_S": "-1"}, [], "scheduler.admission_deadline_s: Input should be greater than 0"),
        ({"TELERAG_SCHEDULER__MAX_CONCURENCY": "4"}, [], "TELERAG_SCHEDULER__MAX_CONCURENCY: no such setting in scheduler"),
        ({"TELERAG_SHEDULER__MAX_QUEUE": "4"}, [], "TELERAG_SHEDULER__MAX_QUEUE: no such settings section"),
        ({}, ["--nprobe", "0"], "retrieval.nprobe: Input should be greater than or equal to 1 (got 0)"),
        ({"file": "engine:\n  kind: vllm\n"}, [], "engine.kind: Input should be 'transformers' or 'sglang' (got 'vllm')"),
        ({"file": "engine:\n  knd: sglang\n"}, [], "engine.knd: no such setting (known: kind, model_path"),
        ({"file": "engine: [1, 2\n"}, [], "is not valid YAML"),
        ({"file": "server:\n  protect_docs: true\n"}, [], "server.protect_docs needs an API key"),
    ],
)
def test_an_invalid_setting_is_one_line_naming_it(setup, argv, message, tmp_path, monkeypatch, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(setup.pop("file", ""))
    for name, value in setup.items():
        monkeypatch.setenv(name, value)
    assert main(["config", "show", "--config", str(config), *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("telerag config: ") and message in err and err.count("\n") == 1, err
    with pytest.raises(SettingsError):
        load_settings(config, {"retrieval": {"nprobe": 0}} if argv else None)
