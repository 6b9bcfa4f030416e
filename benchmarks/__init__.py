"""The benchmarks behind `telerag bench ...`, one module each: `retrieval` (faiss against prefetch and
cooperative search), `kernels` (the Triton scan's variants), `generate` (the transformers engine
against `model.generate`), `server_overhead` (HTTP against in-process), `e2e` (whole requests in
three modes, with `scaled`, `random_llm` and `plots`), `overlap`, `quality` and `soak`.

They sit above the server: they may import `telerag.server`, `telerag.pipelines` and
`telerag.retrieval`, through their public interfaces only, and nothing there imports them but the
thin commands in `server/commands/bench_*.py`, which parse the flags and print the reports."""
