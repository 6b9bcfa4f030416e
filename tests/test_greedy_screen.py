"""The greedy screen of the output layer (`engines.transformers.greedy_screen`): greedy rows keep
their argmax, every other row its whole float32 logits, and the engine answers as without it."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from telerag.engines.transformers import greedy_screen as screen_module
from telerag.engines.transformers.greedy_screen import GreedyScreen, greedy_screen_for
from telerag.engines.types import SamplingParams
from tests.tiny_models import tiny_engine


def test_greedy_rows_keep_their_argmax_and_the_other_rows_their_whole_logits():
    """Random weights of uneven row norms, states at several scales, and near ties made on
    purpose (the best two tokens a hair apart): a screened row's choice is the full layer's, or
    in a near tie the other of the two (as any two float32 matmuls may round it); its finite
    scores are few, each the float32 dot product; the other rows are the plain matmul."""
    torch.manual_seed(0)
    weight = torch.randn(5000, 64) * torch.rand(5000, 1) * 3
    hidden = torch.randn(24, 64) * torch.tensor([0.1, 1.0, 30.0]).repeat(8)[:, None]
    top2 = torch.mm(weight, hidden.T).T.topk(2).indices
    ties = range(0, 24, 3)
    for i in ties:  # the second best moved to within a millionth of the best
        a, b = weight[top2[i, 0]], weight[top2[i, 1]]
        weight[top2[i, 1]] = b + (a - b) * (1 - 1e-6)
    screened = torch.arange(24) % 2 == 0
    logits = GreedyScreen(weight).logits(hidden, screened)
    full = torch.mm(weight, hidden.T).T
    chosen, best = logits.argmax(dim=1), full.argmax(dim=1)
    for row in range(24):
        if row in ties:
            assert chosen[row] in full[row].topk(2).indices
        else:
            assert chosen[row] == best[row]
    assert torch.equal(logits[~screened], full[~screened])
    for row in torch.nonzero(screened).flatten().tolist():
        finite = torch.nonzero(torch.isfinite(logits[row])).flatten()
        assert 1 <= len(finite) < 50
        torch.testing.assert_close(logits[row, finite], torch.mv(weight[finite], hidden[row]), rtol=0, atol=0)


async def test_an_engine_with_the_screen_answers_as_without_it():
    """Greedy answers the same; rows that sample or want log-probabilities get the whole layer."""
    plain, screened = tiny_engine(seed=0), tiny_engine(seed=0)
    screened.greedy_screen = GreedyScreen(screened.model.get_output_embeddings().weight.detach())
    prompts = ["the nile is the longest river in africa", "who wrote hamlet", "paris"]
    try:
        for params in (
            SamplingParams(max_tokens=12),
            SamplingParams(max_tokens=8, logprobs=True),
            SamplingParams(max_tokens=8, temperature=1.5),
        ):
            want = await plain.generate(prompts, params)
            got = await screened.generate(prompts, params)
            assert [g.token_ids for g in got] == [g.token_ids for g in want]
            assert [g.logprobs for g in got] == [g.logprobs for g in want]
    finally:
        await asyncio.gather(plain.close(), screened.close())


def _model(vocab: int, softcap: float | None) -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, final_logit_softcapping=softcap,
    )  # fmt: skip
    return Gemma3ForCausalLM(config).eval()


def test_the_screen_is_used_only_where_it_pays_and_is_sound(monkeypatch):
    """A CPU with AMX, a float32 layer of a large vocabulary, and logits that are the last state
    times that layer: Gemma 3 gets one; a small vocabulary, a CPU without AMX, or a model that
    changes its logits after the layer (Gemma 2's soft-capping) gets none."""
    monkeypatch.setattr("telerag.engines.transformers.checkpoints.cpu_has_amx", lambda: True)
    cpu = torch.device("cpu")
    assert isinstance(greedy_screen_for(_model(screen_module.SCREENED_VOCAB, None), cpu), GreedyScreen)
    assert greedy_screen_for(_model(1000, None), cpu) is None
    assert greedy_screen_for(_model(screen_module.SCREENED_VOCAB, 5.0), cpu) is None
    monkeypatch.setattr("telerag.engines.transformers.checkpoints.cpu_has_amx", lambda: False)
    assert greedy_screen_for(_model(screen_module.SCREENED_VOCAB, None), cpu) is None


@pytest.mark.parametrize("rows", [1, 8])
def test_no_row_screened_is_the_plain_layer(rows):
    torch.manual_seed(1)
    weight, hidden = torch.randn(300, 16), torch.randn(rows, 16)
    logits = GreedyScreen(weight).logits(hidden, torch.zeros(rows, dtype=torch.bool))
    assert torch.equal(logits, torch.mm(weight, hidden.T).T)
