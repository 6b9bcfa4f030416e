"""The HTTP APIs' typed requests and responses, one module per API (`rag`, `openai`, `responses`,
`embeddings`, `files`, `vector_stores`, `vector_store_files`, `documents`, `ops`), what they share
(`common`, `result_stats`, `conversation`); their routes are in `server/routes/`."""
