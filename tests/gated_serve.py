"""`telerag serve` with gates that a test opens by creating a file, so it can look at a server
in the middle of its load or of a request:

    python -m tests.gated_serve [--import-gate FILE] [--checksum-gate FILE] [--search-gate FILE] serve ARGS...

`--import-gate`: the import of `telerag.server.process.runtime` (what brings torch) holds until FILE
exists. `--checksum-gate`: the load's checksum pass holds before `vectors.npy` (the other files are
already counted in its progress) until FILE exists (a datastore whose files passed before is not
read: give a copy). `--search-gate`: every search holds until
FILE exists (a request is then in flight for as long as the test wants). Only this test
launcher patches the server; the server itself has no test hooks.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def wait_for(gate: Path) -> None:
    while not gate.exists():
        time.sleep(0.02)


class ImportGate:
    """A meta-path finder that holds one module's import until the gate exists, then lets the
    usual finders import it."""

    def __init__(self, module: str, gate: Path) -> None:
        self.module, self.gate = module, gate

    def find_spec(self, name, path=None, target=None):
        if name == self.module:
            wait_for(self.gate)
        return None


def main(argv: list[str]) -> int:
    import telerag.pipelines.retriever as retriever
    import telerag.retrieval.checksums as checksums
    import telerag.retrieval.datastore as datastore

    while argv and argv[0].startswith("--"):
        option, gate = argv.pop(0), Path(argv.pop(0))
        if option == "--import-gate":
            sys.meta_path.insert(0, ImportGate("telerag.server.process.runtime", gate))
        elif option == "--checksum-gate":
            sha256 = checksums.file_sha256

            def gated_sha256(path, bar=None, _gate=gate, _sha256=sha256):
                if path.name == datastore.VECTORS:
                    wait_for(_gate)
                return _sha256(path, bar)

            checksums.file_sha256 = gated_sha256
        elif option == "--search-gate":
            os.environ["TELERAG_SERVER__WARM_UP"] = "false"  # the warm-up's search would wait at the gate
            search = retriever.DirectRetriever._search_batch

            def gated_search(self, requests, _gate=gate, _search=search):
                wait_for(_gate)
                return _search(self, requests)

            retriever.DirectRetriever._search_batch = gated_search
        else:
            raise SystemExit(f"unknown option {option}")
    from telerag.cli.main import main as telerag  # after the gates: the import gate must see its module

    return telerag(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
