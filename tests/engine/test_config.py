"""EngineConfig rejects every bad value with a message naming the field and the rule."""

from __future__ import annotations

from typing import Any

import pytest

from twostroke.engine import EngineConfig


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"block_size": 0}, ValueError, "block_size must be >= 1, got 0"),
        ({"num_blocks": "8"}, TypeError, "num_blocks must be an int, got str '8'"),
        ({"max_num_batched_tokens": 0}, ValueError, "max_num_batched_tokens must be >= 1, got 0"),
        ({"max_num_seqs": True}, TypeError, "max_num_seqs must be an int, got bool True"),
        ({"max_model_len": 1}, ValueError, "max_model_len must be >= 2, got 1"),
        ({"pipeline_depth": 3}, ValueError, "pipeline_depth must be one of 1, 2, got 3"),
        (
            {"shutdown": "later"},
            ValueError,
            "shutdown must be one of 'drain', 'cancel', got 'later'",
        ),
        (
            {"dtype": "fp8"},
            ValueError,
            "dtype must be one of 'auto', 'float32', 'bfloat16', 'float16'",
        ),
        ({"torch_threads": 0}, ValueError, "torch_threads must be >= 1, got 0"),
        ({"kv_cache_memory": 1.5}, ValueError, r"as a fraction must be in \(0, 1\), got 1.5"),
        ({"kv_cache_memory": 0}, ValueError, "in bytes must be >= 1, got 0"),
        ({"kv_cache_memory": "1G"}, TypeError, "must be bytes \\(int\\) or a fraction \\(float\\)"),
        ({"colour": "red"}, TypeError, "unexpected keyword argument 'colour'"),
    ],
)
def test_bad_config(options: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        EngineConfig(**options)


def test_defaults() -> None:
    config = EngineConfig()
    assert (config.pipeline_depth, config.shutdown, config.dtype) == (2, "drain", "auto")
