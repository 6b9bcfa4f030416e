"""The cluster cache's free-row bookkeeping against a plain model of it: a flag per row."""

from __future__ import annotations

import random

import numpy as np

from telerag.retrieval.extents import FreeRows


def test_free_rows_agree_with_a_flag_per_row_through_random_takes_and_returns():
    """Whatever the order of takes and returns: every row handed out was free, the smallest extent
    that fits is the one taken when one fits (else the largest first), neighbours merge, and the
    totals and the checks the cache asks (`fits`, `around`) say what the flags say."""
    rng = random.Random(0)
    capacity = 500
    free_rows = FreeRows(capacity)
    free = np.ones(capacity, dtype=bool)
    held: list[list[tuple[int, int]]] = []
    for _ in range(3000):
        extents = free_rows.extents()
        runs = _runs(free)
        assert extents == runs and free_rows.total == int(free.sum())
        want = rng.randint(1, 60)
        assert free_rows.fits(want) == any(length >= want for _, length in runs)
        if held and (rng.random() < 0.45 or want > free_rows.total):
            for start, length in held.pop(rng.randrange(len(held))):
                before = free_rows.around(start, length)
                free[start : start + length] = True
                free_rows.give_back(start, length)
                assert before == next(n for s, n in free_rows.extents() if s <= start < s + n)
            continue
        pieces = free_rows.allocate(want)
        assert sum(n for _, n in pieces) == want
        fitting = [(n, s) for s, n in runs if n >= want]
        if fitting:
            assert pieces == [(min(fitting)[1], want)]
        else:
            assert [n for _, n in pieces[:-1]] == sorted((n for _, n in runs), reverse=True)[: len(pieces) - 1]
        for start, length in pieces:
            assert free[start : start + length].all()
            free[start : start + length] = False
        held.append(pieces)


def _runs(free: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of each run of free rows."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], free.astype(np.int8), [0]))))
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2], strict=True)]
