"""The transformers engine (`engine.TransformersEngine`: any local causal LM, on the CPU or a GPU)
and its parts: the model read from disk (`checkpoints`), the running batch in one KV cache
(`batching`), what its worker keeps per caller and per prompt (`decoding`), the KV of prompt
prefixes (`prefix_cache`) and of each document (`document_kv`, TurboRAG), the output layer of a
greedy step screened in bfloat16 (`greedy_screen`), and linear layers laid out for CPU decoding
(`skinny_linear`)."""
