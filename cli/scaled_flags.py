"""The flags of the benchmarks that run whole requests on an LLM of choice over the datastore
scaled up (`bench e2e`, `bench pipelining`), and what they make."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch comes with them: imported when a command runs
    from telerag.benchmarks.e2e import LLMChoice
    from telerag.benchmarks.scaled import DatastoreScale


def add_scaled_flags(parser: argparse.ArgumentParser) -> None:
    """--tiny / --random-weights (the LLM) and --scale-vectors, --nlist, --replica-noise, --seed."""
    parser.add_argument("--tiny", action="store_true", help="a tiny random LLM (seconds; its text is noise): for CI")
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="with --model DIR: DIR's architecture (config.json, tokenizer) with random weights, built in "
        "process on the engine's device: timing at a model's real size, nothing loaded",
    )
    scale = parser.add_argument_group(
        "datastore scale (noisy replicas of the datastore's vectors, mapped to their passages, made in memory on the "
        "retrieval device: vectors x dim x 4 bytes of RAM, pinned on CUDA)"
    )
    scale.add_argument("--scale-vectors", type=int, help="scale the datastore up to this many vectors")
    scale.add_argument("--nlist", type=int, help="IVF lists of the scaled datastore (default 4*sqrt(n))")
    scale.add_argument("--replica-noise", type=float, default=0.5, help="replica = normalise(v + noise*g/sqrt(dim))")
    scale.add_argument("--seed", type=int, default=0)


def llm_choice(args: argparse.Namespace) -> LLMChoice:
    """The LLM the flags name (refused in one line where they contradict each other)."""
    from telerag.benchmarks.e2e import LLMChoice

    if args.tiny and args.model:
        raise SystemExit("--tiny and --model exclude each other")
    if args.random_weights and not args.model:
        raise SystemExit("--random-weights needs --model DIR (a config.json and a tokenizer)")
    return LLMChoice.TINY if args.tiny else LLMChoice.RANDOM_WEIGHTS if args.random_weights else LLMChoice.CONFIGURED


def datastore_scale(args: argparse.Namespace) -> DatastoreScale | None:
    """The scale the flags ask for; None: the datastore as it is."""
    from telerag.benchmarks.scaled import DatastoreScale

    if args.nlist and not args.scale_vectors:
        raise SystemExit("--nlist sets the lists of a scaled datastore: give --scale-vectors too")
    if not args.scale_vectors:
        return None
    return DatastoreScale(vectors=args.scale_vectors, nlist=args.nlist, noise=args.replica_noise, seed=args.seed)
