"""OpenAI's filters on a vector store's files' attributes (a search's `filters`): a comparison of
one attribute with a value, or an `and` / `or` of filters. A search with a filter is exact over
the passages of the files it matches (`VectorStoreIndex.search`).

A comparison whose attribute the file lacks, or whose value is of another kind than the
attribute's (a number against a text, an order asked of a boolean), does not hold; so a file
without the attribute matches neither `eq` nor `ne` of it, as a SQL `NULL` would not.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

AttributeValue = str | float | bool
Attributes = Mapping[str, AttributeValue]  # a file's attributes, as OpenAI's API takes them

ComparisonOp = Literal["eq", "ne", "gt", "gte", "lt", "lte", "in", "nin"]
CompoundOp = Literal["and", "or"]

_ORDERS: dict[str, Callable[[Any, Any], bool]] = {
    "gt": operator.gt,
    "gte": operator.ge,
    "lt": operator.lt,
    "lte": operator.le,
}


def _kind(value: AttributeValue) -> type:
    """What a value compares with: a bool only with bools, an int with a float."""
    return bool if isinstance(value, bool) else str if isinstance(value, str) else float


@dataclass(frozen=True)
class Comparison:
    """`key` compared with `value` (a list for `in` and `nin`, a single value otherwise)."""

    op: ComparisonOp
    key: str
    value: AttributeValue | tuple[str | float, ...]

    def holds(self, attributes: Attributes) -> bool:
        if self.key not in attributes:
            return False
        have = attributes[self.key]
        if isinstance(self.value, tuple):
            found = any(_kind(have) is _kind(v) and have == v for v in self.value)
            return found if self.op == "in" else not found
        if _kind(have) is not _kind(self.value):
            return False
        if self.op == "eq":
            return have == self.value
        if self.op == "ne":
            return have != self.value
        if isinstance(have, bool):  # no order among booleans
            return False
        return _ORDERS[self.op](have, self.value)


@dataclass(frozen=True)
class Compound:
    """All (`and`) or any (`or`) of `filters`."""

    op: CompoundOp
    filters: tuple[AttributeFilter, ...]

    def holds(self, attributes: Attributes) -> bool:
        combine = all if self.op == "and" else any
        return combine(f.holds(attributes) for f in self.filters)


AttributeFilter = Comparison | Compound
