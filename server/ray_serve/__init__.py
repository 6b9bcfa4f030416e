"""The server on a Ray cluster (`telerag serve --ray`): the Serve applications (`applications`:
the ingress in front of inference replicas, and the retrieval tier's shards), the replicas'
runtime (`replicas`), the request router that sends a request where its clusters are cached
(`routing`'s rule, `router`'s Serve class), the retrieval tier's shards and their caller
(`tier`), the documents written through the ingress (`writes`) and the Serve config file
(`serve_config`). Ray is imported only in this package (and by the benchmarks that start it)."""
