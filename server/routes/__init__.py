"""The HTTP routes, one module per API: `rag` (ours), `openai` (OpenAI-compatible), `ops`
(health, readiness, metrics, documentation). Each module's `router` registers its module-level
endpoints with what `create_app` chose for this app (request models, access)."""
