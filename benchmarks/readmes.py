"""A second corpus for `telerag bench quality`, of another kind than Wikipedia's summaries: the
READMEs of packages installed beside the server (their long descriptions in the environment's
package metadata), which are full of identifiers (function, class and option names) a small
embedding model has never seen. `config/questions_readmes.txt` asks about them by identifier,
each question tagged with the package whose README answers it. Built from what is installed, so
nothing is downloaded and nobody's README is copied into the repository; versions may differ
between machines, so a run names its environment's versions in its JSON line.
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path

README_PACKAGES = (  # the corpus: the questions' packages and others beside them
    "accelerate", "aiohttp", "annotated-types", "anyio", "attrs", "bidict", "charset-normalizer", "cloudpickle",
    "ConfigArgParse", "distro", "faiss-cpu", "fastapi", "frozenlist", "fsspec", "h11", "httpcore", "httpx",
    "huggingface_hub", "idna", "jiter", "joblib", "jsonschema", "locust", "markdown-it-py", "msgpack", "multidict",
    "networkx", "numpy", "openai", "orjson", "pathspec", "pillow", "platformdirs", "propcache", "psutil", "pydantic",
    "pyparsing", "pytest", "python-dateutil", "python-dotenv", "python-multipart", "ray", "regex", "requests", "rich",
    "schemathesis", "scikit-learn", "sentence-transformers", "smart_open", "sortedcontainers", "starlette", "sympy",
    "threadpoolctl", "tiktoken", "tokenizers", "tqdm", "transformers", "typer", "urllib3", "uvicorn",
    "websocket-client", "websockets", "wrapt", "xxhash", "yarl",
)  # fmt: skip


@dataclass(frozen=True)
class Readme:
    package: str
    version: str
    text: str

    @property
    def words(self) -> int:
        return len(self.text.split())


def installed_readmes(packages: tuple[str, ...] = README_PACKAGES) -> tuple[list[Readme], list[str]]:
    """The READMEs of `packages` installed here, and the names of those missing (or with none)."""
    found, missing = [], []
    for name in packages:
        try:
            metadata = importlib.metadata.distribution(name).metadata
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
            continue
        text = (metadata.get("Description") or metadata.get_payload() or "").strip()  # type: ignore[attr-defined]
        if text:
            found.append(Readme(name, metadata["Version"], text))
        else:
            missing.append(name)
    return found, missing


def write_corpus(readmes: list[Readme], out: Path) -> None:
    """`readmes` as a JSONL corpus (`telerag datastore build --corpus`): each package one article,
    its title the package's name, which the questions' tags name."""
    with out.open("w", encoding="utf-8") as handle:
        for readme in readmes:
            handle.write(json.dumps({"id": readme.package, "title": readme.package, "text": readme.text}) + "\n")
