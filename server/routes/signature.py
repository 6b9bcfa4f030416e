"""Module-level endpoints with this app's types in their signatures."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Coroutine
from typing import Any

Endpoint = Callable[..., Coroutine[Any, Any, Any]]


def typed(endpoint: Endpoint, **annotations: Any) -> Endpoint:
    """`endpoint` with the parameters named in `annotations` retyped, as FastAPI should see it.

    FastAPI takes a route's body model and dependencies from its endpoint's signature, but an
    app's request models (they carry its limits) and its authentication are known only when
    `create_app` builds it. Rather than define the routes as closures inside a function, each
    is a module-level function typed with the base model (e.g. `QueryRequest`), registered as a
    thin wrapper whose `__signature__` (PEP 362: what `inspect.signature`, so FastAPI, reads)
    names this app's types instead. The call itself is passed through unchanged."""
    signature = inspect.signature(endpoint, eval_str=True)
    if unknown := annotations.keys() - signature.parameters.keys():
        raise TypeError(f"{endpoint.__name__} has no parameter {sorted(unknown)}")

    @functools.wraps(endpoint)
    async def endpoint_of_this_app(*args: Any, **kwargs: Any) -> Any:
        return await endpoint(*args, **kwargs)

    parameters = [p.replace(annotation=annotations.get(p.name, p.annotation)) for p in signature.parameters.values()]
    endpoint_of_this_app.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    return endpoint_of_this_app
