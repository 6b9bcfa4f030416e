"""`telerag bench e2e`: whole RAG requests in the modes cpu, lookahead, resident and primed, side by side
(see `benchmarks.e2e`); optionally over the datastore scaled up (`benchmarks.scaled`)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from telerag.cli.runtime_flags import add_runtime_flags, nullable, overrides
from telerag.cli.scaled_flags import add_scaled_flags, datastore_scale, llm_choice
from telerag.config.settings import ENGINE_KIND_ALIASES, load_settings, packaged_config
from telerag.pipelines.questions import read_questions
from telerag.pipelines.registry import pipeline_names

MODE_NAMES = ("cpu", "lookahead", "resident", "primed")  # benchmarks.e2e.Mode's, without importing torch to parse flags


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "e2e", help="whole requests through pipelines, scheduler and retriever: cpu vs lookahead vs all-resident"
    )
    parser.add_argument("--pipelines", default="all", help="comma-separated names, or all (default)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8], help="concurrent requests (default 1 4 8)")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODE_NAMES,
        default=list(MODE_NAMES[:3]),
        help="default cpu lookahead resident; primed: each request's lists read into the cache before it, the bound "
        "for a datastore larger than memory (batch 1); cpu is always run (the others are compared with it)",
    )
    parser.add_argument("--requests", type=int, default=16, help="measured requests per pipeline, batch and mode")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured requests before each measured run")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=None, help="documents per search (default: the config's)")
    parser.add_argument("--questions", type=Path, default=packaged_config("questions_wiki_en.txt"))
    parser.add_argument("--engine", choices=["transformers", "sglang", *ENGINE_KIND_ALIASES])
    parser.add_argument("--cache-mb", type=nullable(float), help="the lookahead mode's cluster cache (default: the config's)")
    parser.add_argument(
        "--prefetch-budget-mb", type=nullable(float), help="one fixed budget (default: B x each pipeline's t_LLM)"
    )
    parser.add_argument(
        "--prefetch-reach",
        type=nullable(float),
        help="how far down q_in's ranking a prefetch reads, x nprobe (retrieval.prefetch_reach; null: 1.5 from disk, else all)",
    )
    parser.add_argument(
        "--cpu-threads",
        type=int,
        help="faiss threads of the CPU half (retrieval.cpu_threads; fewer leave cores to the thread driving the LLM)",
    )
    add_scaled_flags(parser)
    parser.add_argument("--plot-dir", type=Path, help="write latency_breakdown.png and throughput.png here")
    parser.add_argument("--json", action="store_true", help='print one JSON line last: {"rows": [...], ...}')
    add_runtime_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from telerag.benchmarks.e2e import E2EConfig, format_table, run_configured_e2e
    from telerag.benchmarks.e2e_modes import Mode

    llm, scale = llm_choice(args), datastore_scale(args)
    if args.plot_dir is not None and importlib.util.find_spec("matplotlib") is None:  # before minutes of measuring
        raise SystemExit("--plot-dir needs matplotlib (pip install telerag[bench]); or leave --plot-dir out")
    names = pipeline_names(args.pipelines)
    settings = load_settings(args.config, overrides(args))
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    config = E2EConfig(
        pipelines=names,
        questions=tuple(q.text for q in read_questions(args.questions)),
        batches=tuple(args.batch),
        requests=args.requests,
        max_tokens=args.max_tokens,
        top_k=args.top_k or settings.retrieval.top_k,
        warmup=args.warmup,
        batch_window_ms=settings.scheduler.batch_window_ms,
        max_batch=settings.scheduler.max_batch,
        modes=tuple(Mode(m) for m in {"cpu", *args.modes}),
    )
    report = run_configured_e2e(settings, config, llm=llm, scale=scale, log=logging.getLogger("telerag.bench.e2e").info)
    print(format_table(report))
    plots = []
    if args.plot_dir is not None:
        from telerag.benchmarks.plots import write_plots

        plots = [str(p) for p in write_plots(report.rows, args.plot_dir)]
        print("plots: " + ", ".join(plots))
    if args.json:
        print(
            json.dumps(
                {
                    "llm": report.llm,
                    "datastore": asdict(report.datastore),
                    "requests": config.requests,
                    "max_tokens": config.max_tokens,
                    "top_k": config.top_k,
                    "plots": plots,
                    "rows": [asdict(r) for r in report.rows],
                }
            )
        )
    return 0
