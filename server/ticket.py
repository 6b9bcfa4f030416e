"""An admitted request as admission plans it (`Ticket`), and what each of its estimates was
made from (`Plan`), so that its finish can be compared with the estimate made again with the
work it really had (`admission.Admission._replanned_s`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from telerag.server.admission_model import Job, Rates
from telerag.server.workload import RequestCost


@dataclass(eq=False)
class Ticket:
    """An admitted request."""

    cost: RequestCost
    client: str | None
    admitted_at: float = 0.0
    estimated_s: float | None = None  # seconds from admission to the finish the model expects, unscaled, as
    # of the latest admission (which may have delayed it); None without a rate
    estimated_in_flight: int = 1  # the requests admitted (itself included) when it was last estimated
    plan: Plan | None = None  # what that estimate was made from (`Admission._replanned_s`)
    served: float | None = None  # the work it was served, once it completed
    calibrating: bool = False  # a request of the warm-up, estimated before the rates it ran at were measured
    running: bool = False
    finished: bool = False
    attention: dict[int, float] = field(default_factory=dict)  # seconds of the whole server it has had (an equal
    # share of the time it ran), by the number of requests running then

    def job(self, rates: Rates, work: float) -> Job:
        """What the model plans for it at `rates` if its whole work is `work`: a running one's
        prompt counts as prefilled once it has been served as much, not as soon as it runs."""
        had = rates.served(self.attention) if rates else 0.0
        left = max(work - had, 0.0)
        return Job(left, min(max(self.cost.prefill_work - had, 0.0), left), self.running)


@dataclass(frozen=True)
class Plan:
    """An estimate's inputs: at `at`, with `rates`, the admitted `tickets` and their `jobs` (in
    admission order), the estimated one the `index`th; so that when it ends its estimate can be
    made again with the work it and the others really had."""

    at: float
    rates: Rates
    tickets: tuple[Ticket, ...]
    jobs: tuple[Job, ...]
    index: int


def jobs_of(rates: Rates, tickets: list[Ticket]) -> tuple[Job, ...]:
    """The `tickets` as the model plans them, each at its share among them (`RequestCost.work_among`)."""
    return tuple(t.job(rates, t.cost.work_among(len(tickets))) for t in tickets)
