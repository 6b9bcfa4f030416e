"""OpenAI's file search: uploaded files (`file_store`), vector stores of them (`vector_stores`, what
each says of itself in `vector_store_records`, its passages in `vector_store_index`), the
attribute filters of a search (`attribute_filters`), and the retriever a request's `file_search`
tool runs its pipeline on (`store_retriever`). Above the pipelines, whose retriever contract it
implements; errors are `errors`'."""
