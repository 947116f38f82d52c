"""Checkpoints: a model's files on disk (GGUF, safetensors) become named tensors and a model."""
