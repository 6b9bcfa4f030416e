"""`telerag bench generate --tiny`: the four methods on the same requests, the table and the JSON
line it promises, and the engine's greedy tokens equal to `model.generate`'s."""

from __future__ import annotations

import json

import pytest

from telerag.cli.main import main
from telerag.engines.transformers.greedy_screen import GreedyScreen


def test_the_command_prints_every_method_and_one_json_line(capsys):
    assert main(["bench", "generate", "--tiny", "--prompts", "3", "--max-tokens", "4", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    methods = ("generate_1by1", "generate_batch", "engine_1by1", "engine_concurrent")
    assert [line.split()[0] for line in lines[2:6]] == list(methods)
    report = json.loads(lines[-1])
    assert report["model"] == "tiny-gemma3" and report["requests"] == 3 and report["max_tokens"] == 4
    assert list(report["methods"]) == list(methods)
    assert all(report["methods"][m]["tokens"] > 0 for m in methods)
    assert report["same_tokens_as_generate"] == dict.fromkeys(methods[1:], 3)
    assert set(report["speedup_tokens_per_s"]) == {
        "engine_concurrent_vs_generate_1by1",
        "engine_concurrent_vs_generate_batch",
        "engine_1by1_vs_generate_1by1",
    }


def test_number_types_side_by_side_each_named_and_compared_with_the_first(capsys):
    """`--dtype float32 bfloat16`: the four methods in each type, the second's named after it,
    every one compared with float32's `generate_1by1`, and the engine's speed in each type over
    the first's in the JSON; two names for one type are refused in one line."""
    assert (
        main(["bench", "generate", "--tiny", "--prompts", "2", "--max-tokens", "3", "--dtype", "float32", "bfloat16", "--json"])
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert "in float32, bfloat16" in lines[0]
    methods = ["generate_1by1", "generate_batch", "engine_1by1", "engine_concurrent"]
    named = methods + [f"{m}/bfloat16" for m in methods]
    assert [line.split()[0] for line in lines[2:10]] == named
    report = json.loads(lines[-1])
    assert report["dtypes"] == ["float32", "bfloat16"] and list(report["methods"]) == named
    assert set(report["same_tokens_as_generate"]) == set(named[1:])
    assert report["speedup_tokens_per_s"]["engine_concurrent/bfloat16_vs_engine_concurrent"] > 0
    assert "engine_concurrent/bfloat16_vs_generate_1by1/bfloat16" in report["speedup_tokens_per_s"]
    assert main(["bench", "generate", "--tiny", "--dtype", "auto", "float32"]) == 2
    assert "a type twice" in capsys.readouterr().err


def test_an_engine_with_a_greedy_screen_is_also_measured_without_it(capsys, monkeypatch: pytest.MonkeyPatch):
    """Where the engine screens its output layer (a float32 model on an AMX CPU; here given one
    whatever the CPU), a fifth method serves the same requests concurrently with the screen off:
    the same tokens, and the screen's gain in the JSON."""
    monkeypatch.setattr(
        "telerag.engines.transformers.engine.greedy_screen_for",
        lambda model, device: GreedyScreen(model.get_output_embeddings().weight.detach()),
    )
    assert main(["bench", "generate", "--tiny", "--prompts", "3", "--max-tokens", "4", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[6].split()[0] == "engine_concurrent_unscreened"
    report = json.loads(lines[-1])
    assert list(report["methods"])[-2:] == ["engine_concurrent", "engine_concurrent_unscreened"]
    assert report["same_tokens_as_generate"]["engine_concurrent_unscreened"] == 3
    assert report["same_tokens_as_generate"]["engine_concurrent"] == 3
    assert report["speedup_tokens_per_s"]["engine_concurrent_vs_engine_concurrent_unscreened"] > 0
