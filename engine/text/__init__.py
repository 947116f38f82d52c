"""Text in and out: tokenizers, prompts as callers pass them, incremental detokenization."""
