"""The server on a Ray cluster (`telerag serve --ray`): the Serve applications (`applications`:
the ingress in front of inference replicas, and the retrieval tier's shards), the replicas'
runtime (`replicas`), the request router that sends a request where its clusters are cached
(`routing`'s rule, `router`'s Serve class) and the Serve config file (`serve_config`). Ray is
imported only in this package."""
