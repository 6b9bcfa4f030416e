"""A datastore's documents through their life: files converted to text (`conversion`), cut into
passages, embedded and written to a live datastore (`writer`), a corpus ingested into a new one
(`ingestion`), and the datastore compacted or retrained while it serves (`rebuilds`). Below the
pipelines, which search what is written here; errors are `errors`'."""
