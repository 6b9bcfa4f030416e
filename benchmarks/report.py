"""The plain report several benchmarks print: one `name  value` line per field, names aligned."""

from __future__ import annotations

from collections.abc import Mapping


def key_value_table(fields: Mapping[str, object], *, float_format: str = ".3f", width: int | None = None) -> str:
    """Floats in `float_format`, anything else as `str` gives it; `width` is the name column
    (default: the longest name), for lines that continue another table."""
    width = width if width is not None else max(len(name) for name in fields)
    return "\n".join(
        f"{name:<{width}}  {value:{float_format}}" if isinstance(value, float) else f"{name:<{width}}  {value}"
        for name, value in fields.items()
    )
