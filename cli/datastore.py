"""`telerag datastore build`: a datastore ingested from a JSONL corpus or the built-in Wikipedia
(`documents.ingestion`: a sample, then the rest written as documents, then retrained);
`telerag datastore scale`: a datastore and noisy replicas of it, a larger one (`benchmarks.scaled`);
`telerag datastore upgrade`: what a datastore written by an older telerag lacks, added beside its files;
`telerag datastore verify`: every byte of a datastore read against its checksums;
`telerag datastore info`: a datastore as its writes have left it (documents, log, list imbalance);
`telerag datastore compact|retrain`: a new generation of its files (in a directory, or a server's)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import time
from pathlib import Path

from telerag.retrieval.codecs import Codec
from telerag.retrieval.corpus import WIKIPEDIA_SOURCE, PassageShape, read_jsonl, read_wikipedia


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "build",
        help="ingest a corpus into a new datastore",
        description="Embeds a sample of the corpus's documents drawn at random and trains the IVF lists on it, writes "
        "the rest as documents are written (a block at a time, each durable once written), then trains the lists "
        "again on all of them.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--corpus", type=Path, help="JSONL file with id, title, text per line")
    source.add_argument("--wikipedia", action="store_true", help="the built-in English Wikipedia summaries")
    parser.add_argument("--out", type=Path, required=True, help="datastore directory to write")
    parser.add_argument("--embedder", default=None, help="sentence-transformers model path (default: packaged MiniLM)")
    parser.add_argument("--device", default="cpu", help="embedding device")
    parser.add_argument("--nlist", type=int, default=None, help="IVF lists (default: about 4*sqrt(passages))")
    default = PassageShape()
    parser.add_argument("--passage-words", type=int, default=default.words, help="words per passage")
    parser.add_argument(
        "--passage-overlap", type=int, default=default.overlap, help="words each passage repeats from the end of the one before"
    )
    parser.add_argument(
        "--title",
        action=argparse.BooleanOptionalAction,
        default=default.title,
        help="embed the article's title in front of each passage",
    )
    parser.add_argument("--codec", choices=[c.value for c in Codec], default=Codec.FP32.value)
    parser.add_argument("--batch-size", type=int, default=1024, help="passages per embedding call (and per block written)")
    parser.add_argument(
        "--sample-passages",
        type=int,
        help="passages of the documents drawn at random to train the first lists on (default: 512, documents.ingestion)",
    )
    parser.add_argument("--overwrite", action="store_true")
    parser.set_defaults(func=run)

    upgrade = subparsers.add_parser(
        "upgrade",
        help="add the list statistics exact early stop needs (list_stats.npy) to a datastore written without them",
        description="Adds list_stats.npy beside the datastore's files and lists it in its manifest; rewrites and "
        "deletes nothing else (but the record of the files that passed their checksums, which any open keeps). A "
        "datastore that has them already is left as it is.",
    )
    upgrade.add_argument("path", type=Path, help="the datastore directory")
    upgrade.add_argument(
        "--no-verify-checksums",
        dest="verify_checksums",
        action="store_false",
        help="skip reading every file against its checksum first",
    )
    upgrade.set_defaults(func=run_upgrade)

    info = subparsers.add_parser(
        "info",
        help="a datastore as it is now: documents, passages, its log of writes, and how even its lists are",
        description="Reads the datastore and replays its log of writes, read-only (a server may hold it meanwhile).",
    )
    info.add_argument("path", type=Path, help="the datastore directory")
    info.add_argument("--json", action="store_true", help="one JSON object")
    info.set_defaults(func=run_info)

    _register_verify(subparsers)
    _register_scale(subparsers)

    for name, what in (
        ("compact", "fold the documents written since into new files (the same results; writes go on meanwhile)"),
        ("retrain", "new centroids, every passage assigned again (results change; writes go on meanwhile)"),
    ):
        rebuild = subparsers.add_parser(name, help=what, description=what[0].upper() + what[1:] + ".")
        rebuild.add_argument("path", type=Path, nargs="?", help="the datastore directory, which no server may hold")
        rebuild.add_argument("--url", help="a running server's (instead of a directory), e.g. http://127.0.0.1:8000")
        rebuild.add_argument("--api-key", default=os.environ.get("TELERAG_API_KEY"), help="the server's (env TELERAG_API_KEY)")
        if name == "retrain":
            rebuild.add_argument("--nlist", type=int, help="lists of the new generation (default: about 4*sqrt(passages))")
        rebuild.set_defaults(func=run_rebuild, kind=name, nlist=None)


def run_rebuild(args: argparse.Namespace) -> int:
    if (args.path is None) == (args.url is None):
        raise SystemExit(f"telerag datastore {args.kind}: give a datastore directory or --url, one of them")
    if args.url:
        done = _rebuild_on_server(args.url, args.api_key, args.kind, args.nlist)
        print(
            f"generation {done['generation']}: {done['passages']} passages, {done['carried']} writes carried, {done['seconds']} s"
        )
        return 0
    from telerag.retrieval.live import opened

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with opened(args.path, verify_checksums=False, writable=True) as live:
        result = live.retrain(nlist=args.nlist, progress=True) if args.kind == "retrain" else live.compact(progress=True)
    print(f"generation {result.generation}: {result.passages} passages in {result.seconds:.1f} s")
    return 0


def _rebuild_on_server(url: str, api_key: str | None, kind: str, nlist: int | None) -> dict:
    """Ask the server for a compaction or retrain, and wait for it to end."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=60) as client:
        started = client.post(f"/v1/datastore/{kind}", json={"nlist": nlist} if kind == "retrain" else None)
        if started.status_code != 202:
            raise SystemExit(f"telerag datastore {kind}: {started.status_code} {started.text[:300]}")
        while (rebuild := client.get("/v1/datastore").json()["rebuild"])["state"] == "running":
            time.sleep(0.5)
    if rebuild["state"] != "done":
        raise SystemExit(f"telerag datastore {kind}: failed: {rebuild['error']}")
    return rebuild


def _register_verify(subparsers: argparse._SubParsersAction) -> None:
    verify = subparsers.add_parser(
        "verify",
        help="read every byte of a datastore against its checksums",
        description="Reads each file of the datastore's current generation in full against the checksum in its manifest, "
        "whatever earlier opens recorded, and records those that pass (a server's start-up reads only the files that "
        "changed since they last passed). Writes nothing else; a server may hold the datastore meanwhile. Exits 1 at "
        "the first file that is missing, truncated or does not match.",
    )
    verify.add_argument("path", type=Path, help="the datastore directory")
    verify.add_argument("--json", action="store_true", help="one JSON object")
    verify.set_defaults(func=run_verify)


def run_verify(args: argparse.Namespace) -> int:
    from telerag.retrieval.datastore import verify_datastore

    verified = verify_datastore(args.path, progress=not args.json)
    if args.json:
        print(json.dumps(dataclasses.asdict(verified)))
    else:
        size = f"{verified.bytes_read / 1e9:.2f} GB"
        print(f"{args.path}: generation {verified.generation}, {verified.files} files ({size}) match their checksums")
    return 0


def run_info(args: argparse.Namespace) -> int:
    from telerag.documents.ingestion import IngestionRecord
    from telerag.retrieval.live import opened

    record = IngestionRecord.read(args.path)
    with opened(args.path, verify_checksums=False) as live:
        manifest, stats = live.manifest, live.stats()
        sizes = live.snapshot().list_sizes()
    facts = {
        "generation": stats.generation,
        "embedder": manifest.embedder,
        "dim": manifest.dim,
        "codec": manifest.codec,
        "nlist": manifest.nlist,
        "documents": stats.documents,
        "passages": stats.passages,
        "lsn": stats.lsn,
        "wal_bytes": stats.wal_bytes,
        "delta_rows": stats.delta_rows,
        "tombstones": stats.tombstones,
        "list_imbalance": round(stats.imbalance, 3),
        "largest_list": int(sizes.max()) if len(sizes) else 0,
        "empty_lists": int((sizes == 0).sum()),
        "ingestion": "none" if record is None else "done" if record.done else f"{record.written} of {record.documents} documents",
    }
    if args.json:
        print(json.dumps(facts))
    else:
        for key, value in facts.items():
            print(f"{key:<16}{value}")
    return 0


def _register_scale(subparsers: argparse._SubParsersAction) -> None:
    scale = subparsers.add_parser(
        "scale",
        help="a datastore's vectors and noisy replicas of them, a larger datastore of its own (for larger-than-memory runs)",
        description="Writes SOURCE scaled to --vectors vectors: its own and noisy replicas of them, each replica's "
        "passage a copy of its source's, in --nlist lists trained on them. Made a window of rows at a time and written "
        "in one pass, so the datastore may be larger than memory (serve it with --host-cache-mb).",
    )
    scale.add_argument("source", type=Path, help="the datastore to scale (fp32, with passages)")
    scale.add_argument("--out", type=Path, required=True, help="datastore directory to write")
    scale.add_argument("--vectors", type=int, required=True, help="vectors of the scaled datastore")
    scale.add_argument("--nlist", type=int, default=None, help="IVF lists (default: about 4*sqrt(vectors))")
    scale.add_argument("--noise", type=float, default=0.5, help="a replica is normalise(v + noise*g/sqrt(dim))")
    scale.add_argument("--seed", type=int, default=0)
    scale.add_argument("--codec", choices=[c.value for c in Codec], default=Codec.FP32.value)
    scale.add_argument("--window-mb", type=int, default=4096, help="float32 rows made and held at once while writing")
    scale.add_argument("--overwrite", action="store_true")
    scale.set_defaults(func=run_scale)


def run_scale(args: argparse.Namespace) -> int:
    from telerag.benchmarks.scaled import DatastoreScale, write_scaled_datastore
    from telerag.retrieval.datastore import Datastore

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.window_mb < 1:
        raise SystemExit("telerag datastore scale: --window-mb must be at least 1")
    base = Datastore.load(args.source)
    try:
        scale = DatastoreScale(args.vectors, args.nlist, args.noise, args.seed)
        path = write_scaled_datastore(
            base, scale, args.out, codec=Codec(args.codec), window_bytes=args.window_mb << 20, overwrite=args.overwrite
        )
    finally:
        base.close()
    print(f"datastore written to {path}")
    return 0


def run_upgrade(args: argparse.Namespace) -> int:
    from telerag.retrieval.datastore_writer import add_list_stats

    if add_list_stats(args.path, verify_checksums=args.verify_checksums, progress=True):
        print(f"{args.path}: list statistics added (list_stats.npy); nothing else changed")
    else:
        print(f"{args.path}: has its list statistics already; nothing changed")
    return 0


def run(args: argparse.Namespace) -> int:
    from telerag.documents.ingestion import SAMPLE_PASSAGES, IngestionRecord, corpus_documents, ingest, write_seed
    from telerag.pipelines.embedder import Embedder

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    shape = PassageShape(words=args.passage_words, overlap=args.passage_overlap, title=args.title)  # checked before loading
    sample_passages = SAMPLE_PASSAGES if args.sample_passages is None else args.sample_passages
    if args.batch_size < 1 or sample_passages < 1:
        raise SystemExit("telerag datastore build: --batch-size and --sample-passages must be at least 1")
    embedder = Embedder(args.embedder, device=args.device) if args.embedder else Embedder.embedded_default(device=args.device)
    documents = corpus_documents(read_jsonl(args.corpus) if args.corpus else read_wikipedia())
    path = write_seed(
        args.out,
        documents,
        embedder.encode,
        embedder=embedder.name,
        source=str(args.corpus.resolve()) if args.corpus else WIKIPEDIA_SOURCE,
        shape=shape,
        codec=Codec(args.codec),
        nlist=args.nlist,
        sample_passages=sample_passages,
        batch_size=args.batch_size,
        overwrite=args.overwrite,
    )
    record = IngestionRecord.read(path)
    if record is not None and not record.done:
        ingest(path, documents, embedder.encode, record, block_passages=args.batch_size)
    print(f"datastore written to {path}")
    return 0
