"""Benchmarks that drive the whole server stack (pipelines, scheduler, retriever) in-process:
`e2e` (`telerag bench e2e`) and what it needs, a datastore scaled up from a real one (`scaled`)."""
