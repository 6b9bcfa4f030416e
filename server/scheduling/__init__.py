"""Scheduling the work of admitted requests: retrieval batched across requests
(`retrieval_batching`). Which requests are admitted at all is `server.admission`'s."""
