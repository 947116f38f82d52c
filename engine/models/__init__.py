"""Llama-family models over the paged KV cache, and loading them from disk."""
