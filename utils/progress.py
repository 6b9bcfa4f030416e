"""Progress of the long steps (checksums, a datastore build, pinning the host copy): a tqdm bar
on the terminal, and the same counts reported to whoever is watching.

A server that listens while it loads shows how far its load is (`/ready`): it installs an
observer with `observe_progress` around the load, and every `ProgressBar` made in that context
(worker threads started with a copy of it included) reports to it, whether or not its terminal
bar is shown.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Generic, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


@dataclass(frozen=True)
class StepProgress:
    """How far one step is: `done` of `total` `unit`s (total None: unknown)."""

    step: str
    done: float
    total: float | None
    unit: str

    @property
    def fraction(self) -> float | None:
        return None if not self.total else min(1.0, self.done / self.total)


ProgressObserver = Callable[[StepProgress], None]

_observer: ContextVar[ProgressObserver | None] = ContextVar("telerag_progress_observer", default=None)


@contextlib.contextmanager
def observe_progress(observer: ProgressObserver) -> Iterator[None]:
    """Report every ProgressBar made in this context to `observer` (called from the bar's thread)."""
    token = _observer.set(observer)
    try:
        yield
    finally:
        _observer.reset(token)


class ProgressBar(Generic[T]):
    """A tqdm bar (hidden with `disable`) that also reports its counts to the context's observer."""

    def __init__(
        self,
        iterable: Iterable[T] | None = None,
        *,
        desc: str,
        total: float | None = None,
        unit: str = "it",
        unit_scale: bool = False,
        disable: bool = False,
    ) -> None:
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self._iterable = iterable
        self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, disable=disable)
        self._observer = _observer.get()
        self.desc, self.total, self.unit, self.done = desc, total, unit, 0.0
        self._report()

    def update(self, n: float = 1) -> None:
        self.done += n
        self._bar.update(n)
        self._report()

    def __iter__(self) -> Iterator[T]:
        if self._iterable is None:
            raise TypeError("this ProgressBar was made without an iterable")
        try:
            for item in self._iterable:
                yield item
                self.update()
        finally:
            self.close()

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> ProgressBar[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _report(self) -> None:
        if self._observer is not None:
            self._observer(StepProgress(self.desc, self.done, self.total, self.unit))
