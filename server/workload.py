"""What a request is expected to ask of the engine, in *work units*: per LLM call, its output
tokens plus its prompt tokens at `PREFILL_WEIGHT` each (a prompt token is processed in parallel
and costs a fraction of a generated one). Admission measures the engine's rate in the same units
(`admission_model.ServiceRate`), from the work each request was served (`ServedWork`).

A request's expected work comes from what its pipeline's requests were served lately, not from
its limits: RAG answers are a few dozen tokens while `max_tokens` is often 1024, and a multi-call
pipeline's later prompts carry its drafts and documents. Each pipeline keeps its last
`PROFILE_WINDOW` completed requests; a new request's estimate is the `COST_QUANTILE` of their
work as it would be for it: each one's prompts scaled by how much longer this request's prompt
is (its query and `top_k` passages), and the output of each call that writes answer text
(`StageRole.GENERATE`) cut at this request's `max_tokens`. Until a pipeline has
`PROFILE_MIN_SAMPLES`, a stated prior stands in: every call the pipeline may make, each with the
prompt estimate and an output of `PRIOR_CALL_TOKENS` (`max_tokens` at most). A request that runs
longer than its estimate is the error model's business (`admission_model.EstimateError`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from telerag.pipelines.types import RagResult, StageRole

TOKENS_PER_WORD = 1.5  # prompt tokens per word of a passage (English BPE; its title and separators included)
DEFAULT_PASSAGE_WORDS = 100  # a datastore's passage length when its manifest does not say (the builder's default)
PREFILL_WEIGHT = 0.1  # cost of a prompt token relative to a generated one
PROFILE_WINDOW = 50  # completed requests of a pipeline its estimates are made from
PROFILE_MIN_SAMPLES = 5  # below this many, the prior stands in
COST_QUANTILE = 0.9  # of the recent requests' work: one in ten runs longer, which the error model then sees
PRIOR_CALL_TOKENS = 64  # output of each call of a pipeline not measured yet (its answers' `max_tokens` at most)


@dataclass(frozen=True)
class RequestCost:
    """What one request is expected to ask of the engine: `work` units in all (the mean of its
    pipeline's recent requests), of which `prefill_work` is its first call's prompt (prefilled
    before it shares the engine); `spread` more at the `COST_QUANTILE` (see `work_among`)."""

    work: float
    prefill_work: float = 0.0
    spread: float = 0.0

    def work_among(self, sharing: int) -> float:
        """Its work as counted when `sharing` requests share the server with it (itself included):
        the mean plus its spread over the square root of `sharing`. Alone, the quantile; among n,
        its share of the quantile of their sum (n independent lengths spread sqrt(n) times as
        much as one, not n times), so a burst is not costed as if every answer were long."""
        return self.work + self.spread / math.sqrt(max(sharing, 1))

    @classmethod
    def bounded(cls, prompt_tokens: int, max_tokens: int, llm_calls: int) -> RequestCost:
        """The most a request can ask: `llm_calls` calls, each with `prompt_tokens` and all of
        its `max_tokens`."""
        prefill = PREFILL_WEIGHT * prompt_tokens
        return cls(work=llm_calls * (max_tokens + prefill), prefill_work=prefill)


@dataclass(frozen=True)
class CallOutput:
    tokens: int
    answer: bool  # it wrote answer text: its output is bounded by the request's max_tokens


@dataclass(frozen=True)
class ServedWork:
    """The work a completed request was served, from its trace: each LLM call's prompt and output."""

    prompt_tokens: int
    outputs: tuple[CallOutput, ...]

    @classmethod
    def of(cls, result: RagResult) -> ServedWork:
        calls = [s for s in result.steps if s.kind == "llm"]
        return cls(
            prompt_tokens=sum(s.tokens_in for s in calls),
            outputs=tuple(CallOutput(s.tokens_out, s.stage.role is StageRole.GENERATE) for s in calls),
        )

    @property
    def work(self) -> float:
        return PREFILL_WEIGHT * self.prompt_tokens + sum(o.tokens for o in self.outputs)

    def work_for(self, prompt_scale: float, max_tokens: int) -> float:
        """Its work had its prompts been `prompt_scale` times as long and its answer calls cut at `max_tokens`."""
        output = sum(min(o.tokens, max_tokens) if o.answer else o.tokens for o in self.outputs)
        return PREFILL_WEIGHT * self.prompt_tokens * prompt_scale + output


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
    _recent: dict[str, deque[_Served]] = field(default_factory=dict)

    def estimate(self, pipeline: str, llm_calls: int, prompt_tokens: int, max_tokens: int) -> RequestCost:
        """The expected cost of a request of `pipeline` (which makes at most `llm_calls` calls)
        whose answer prompt is about `prompt_tokens` long (its query and passages), with
        `max_tokens`: the mean and the `quantile` of its recent requests' work (as `work_for` it),
        so never more than its own `max_tokens` allows for its answers."""
        prefill = PREFILL_WEIGHT * prompt_tokens
        recent = self._recent.get(pipeline, ())
        if len(recent) < self.min_samples:
            return RequestCost(work=llm_calls * (prefill + min(max_tokens, PRIOR_CALL_TOKENS)), prefill_work=prefill)
        works = sorted(r.served.work_for(prompt_tokens / max(r.prompt_estimate, 1), max_tokens) for r in recent)
        mean = sum(works) / len(works)
        return RequestCost(work=mean, prefill_work=prefill, spread=max(0.0, _quantile(works, self.quantile) - mean))

    def observe(self, pipeline: str, prompt_tokens: int, served: ServedWork) -> None:
        """A request of `pipeline`, estimated with `prompt_tokens`, completed having been served `served`."""
        recent = self._recent.setdefault(pipeline, deque(maxlen=self.window))
        recent.append(_Served(prompt_tokens, served))


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The `q` quantile of sorted values, interpolated between the two nearest (numpy's default):
    of few values, not simply their largest."""
    position = q * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)
