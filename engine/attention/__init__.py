"""Attention over the paged KV cache: a step's layout (metadata), the operations, the cache."""
