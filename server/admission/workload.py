"""What a request is expected to ask of the engine, in *work units*: per LLM call, its output
tokens plus the prompt tokens the engine prefilled at `PREFILL_WEIGHT` each (a prompt token is
processed in parallel and costs a fraction of a generated one; one whose KV the prefix cache held
costs next to nothing). Admission measures the engine's rate in the same units
(`admission_model.ServiceRate`), from the work each request was served (`ServedWork`). Measured
alone on the embedded default (each pipeline 3 times, `max_tokens` 64), a request's work per
second of its time was 10.5-13.2 units counting only prefilled tokens (one 4-token answer: 18.9),
but 11.5-37 counting cached ones too: FLARE's, Self-RAG's and Iter-RetGen's later calls find
their documents cached, and counted as prefilled they were costed up to 3x their time.

A request's expected work comes from what its pipeline's requests were served lately, not from
its limits: RAG answers are a few dozen tokens while `max_tokens` is often 1024, and a multi-call
pipeline's later prompts carry its drafts and documents. Each pipeline keeps its last
`PROFILE_WINDOW` completed requests; a new request's estimate is the `COST_QUANTILE` of their
work as it would be for it: each one's prompts scaled by how much longer this request's prompt
is (its query and `top_k` passages), and the output of each call that writes answer text
(`StageRole.GENERATE`) cut at this request's `max_tokens`. Until a pipeline has
`PROFILE_MIN_SAMPLES`, the few it has stand in with a spread of at least `FEW_SAMPLES_SPREAD`
(the server's warm-up measures one of every pipeline), and before any, a stated prior: every
call the pipeline may make, each with the prompt estimate and an output of `PRIOR_CALL_TOKENS`
(`max_tokens` at most). Either is tentative: not enough to refuse a request that would run
alone (`admission`), which is how its pipeline gets measured. An answer that its
limit or the server's deadline cut short says only that it would have run at least that long:
for a request with a larger limit it counts as running to that limit. Requests that sample above `HOT_TEMPERATURE` are
measured apart. A request that runs longer than its estimate is the error model's business
(`admission_model.EstimateError`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from telerag.pipelines.types import RagResult, StageRole

TOKENS_PER_WORD = 1.5  # prompt tokens per word of a passage (English BPE; its title and separators included)
DEFAULT_PASSAGE_WORDS = 100  # a datastore's passage length when its manifest does not say (the builder's default)
PREFILL_WEIGHT = 0.03  # cost of a prompt token relative to a generated one. Measured alone on the embedded default (two
# cores): a 344-token prompt and a 5-token answer in 1.9 s, answers decoding at 7.9 tokens/s, so about 0.03 (the
# simulated engine of tests/test_admission_load.py: 0.02). At 0.1 the rate, measured mostly on short answers, made
# long ones look cheap: a 256-token answer was admitted at an estimate of 14.5 s and took 35 s
PROFILE_WINDOW = 50  # completed requests of a pipeline its estimates are made from
PROFILE_MIN_SAMPLES = 5  # below this many, the estimate is tentative
FEW_SAMPLES_SPREAD = 1.0  # below PROFILE_MIN_SAMPLES, the quantile is taken as at least (1 + this) x the mean: one
# request says little of how the next varies (naive's answers on the embedded default: 4-80 tokens)
COST_QUANTILE = 0.9  # of the recent requests' work: one in ten runs longer, which the error model then sees
PRIOR_CALL_TOKENS = 64  # output of each call of a pipeline not measured yet (its answers' `max_tokens` at most)
HOT_TEMPERATURE = 1.0  # above it sampling flattens the model's distribution and answers seldom end before their
# limit (schemathesis's naive request at 2.0 ran to its max_tokens for 42.5 s, admitted at the length of greedy
# answers): such requests are measured apart, each call's output `max_tokens` until they are


@dataclass(frozen=True)
class RequestCost:
    """What one request is expected to ask of the engine: `work` units in all (the mean of its
    pipeline's recent requests), of which `prefill_work` is its first call's prompt (prefilled
    before it shares the engine); `spread` more at the `COST_QUANTILE` (see `work_among`)."""

    work: float
    prefill_work: float = 0.0
    spread: float = 0.0
    tentative: bool = False  # the prior's guess or a few requests' measure: never a reason to refuse a request that
    # would run alone (how else would its pipeline be measured?)

    def work_among(self, sharing: int) -> float:
        """Its work as counted when `sharing` requests share the server with it (itself included):
        the mean plus its spread over the square root of `sharing`. Alone, the quantile; among n,
        its share of the quantile of their sum (n independent lengths spread sqrt(n) times as
        much as one, not n times), so a burst is not costed as if every answer were long."""
        return self.work + self.spread / math.sqrt(max(sharing, 1))


@dataclass(frozen=True)
class CallOutput:
    tokens: int
    answer: bool  # it wrote answer text: its output is bounded by the request's max_tokens
    cut: bool = False  # it ended at its token limit or the run's deadline, not of itself


@dataclass(frozen=True)
class ServedWork:
    """The work a completed request was served, from its trace: the prompt tokens its LLM calls
    had prefilled (not those the engine's prefix cache held) and each call's output."""

    prefilled_tokens: int
    outputs: tuple[CallOutput, ...]

    @classmethod
    def of(cls, result: RagResult) -> ServedWork:
        calls = [s for s in result.steps if s.kind == "llm"]
        return cls(
            prefilled_tokens=result.prompt_tokens - result.cached_tokens,
            outputs=tuple(
                CallOutput(s.tokens_out, s.stage.role is StageRole.GENERATE, s.cut or s.stopped_at_deadline) for s in calls
            ),
        )

    @property
    def work(self) -> float:
        return PREFILL_WEIGHT * self.prefilled_tokens + sum(o.tokens for o in self.outputs)

    def work_for(self, prompt_scale: float, max_tokens: int) -> float:
        """Its work had its prompts been `prompt_scale` times as long and its answer calls limited
        to `max_tokens`: an answer its own limit cut runs to that one (how much longer it would
        have gone is not known)."""
        output = sum(_answer_tokens(o, max_tokens) if o.answer else o.tokens for o in self.outputs)
        return PREFILL_WEIGHT * self.prefilled_tokens * prompt_scale + output


def _answer_tokens(output: CallOutput, max_tokens: int) -> int:
    return max_tokens if output.cut else min(output.tokens, max_tokens)


@dataclass
class _Served:
    prompt_estimate: int  # the prompt tokens `Workload.estimate` was given for it
    served: ServedWork


@dataclass
class Workload:
    """Each pipeline's recent completed requests, and the costs estimated from them."""

    window: int = PROFILE_WINDOW
    min_samples: int = PROFILE_MIN_SAMPLES
    quantile: float = COST_QUANTILE
    _recent: dict[tuple[str, bool], deque[_Served]] = field(default_factory=dict)  # by pipeline, and hot or not

    def estimate(
        self, pipeline: str, llm_calls: int, prompt_tokens: int, max_tokens: int, temperature: float = 0.0
    ) -> RequestCost:
        """The expected cost of a request of `pipeline` (which makes at most `llm_calls` calls)
        whose answer prompt is about `prompt_tokens` long (its query and passages), with
        `max_tokens` and `temperature`: the mean and the `quantile` of its recent requests' work
        (as `work_for` it) at temperatures like its own, so never more than its own `max_tokens`
        allows for its answers."""
        prefill = PREFILL_WEIGHT * prompt_tokens
        hot = temperature > HOT_TEMPERATURE
        recent = self._recent.get((pipeline, hot), ())
        if hot and len(recent) < self.min_samples:  # not a guess: sampled hot, answers run to their limit
            return RequestCost(work=llm_calls * (prefill + max_tokens), prefill_work=prefill)
        if not recent:
            output = min(max_tokens, PRIOR_CALL_TOKENS)
            return RequestCost(work=llm_calls * (prefill + output), prefill_work=prefill, tentative=True)
        works = [r.served.work_for(prompt_tokens / max(r.prompt_estimate, 1), max_tokens) for r in recent]
        mean = sum(works) / len(works)
        # interpolated between the two nearest (numpy's default): of few values, not simply their largest
        spread = max(0.0, float(np.quantile(works, self.quantile)) - mean)
        if len(recent) < self.min_samples:
            return RequestCost(work=mean, prefill_work=prefill, spread=max(spread, FEW_SAMPLES_SPREAD * mean), tentative=True)
        return RequestCost(work=mean, prefill_work=prefill, spread=spread)

    def recent(self) -> dict[tuple[str, bool], list[tuple[int, ServedWork]]]:
        """By pipeline and whether hot: its recent requests' prompt estimates and what they were
        served, oldest first (what `restore` takes back)."""
        return {key: [(r.prompt_estimate, r.served) for r in recent] for key, recent in self._recent.items()}

    def restore(self, recent: Mapping[tuple[str, bool], Sequence[tuple[int, ServedWork]]]) -> None:
        """Take back what `recent` gave (a calibration kept across a restart), after what it holds."""
        for key, requests in recent.items():
            self._recent.setdefault(key, deque(maxlen=self.window)).extend(_Served(p, s) for p, s in requests)

    def observe(self, pipeline: str, prompt_tokens: int, served: ServedWork, temperature: float = 0.0) -> None:
        """A request of `pipeline` at `temperature`, estimated with `prompt_tokens`, completed
        having been served `served`."""
        recent = self._recent.setdefault((pipeline, temperature > HOT_TEMPERATURE), deque(maxlen=self.window))
        recent.append(_Served(prompt_tokens, served))
