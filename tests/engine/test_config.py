"""EngineConfig rejects every bad value with a message naming the field and the rule."""

from __future__ import annotations

import re
from typing import Any

import attrs
import pytest

from twostroke.engine import EngineConfig


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"block_size": 0}, ValueError, "block_size must be >= 1, got 0"),
        ({"block_size": None}, TypeError, "block_size must be an int, got NoneType None"),
        ({"block_size": 16.0}, TypeError, "block_size must be an int, got float 16.0"),
        ({"num_blocks": "8"}, TypeError, "num_blocks must be an int, got str '8'"),
        ({"num_blocks": 0}, ValueError, "num_blocks must be >= 1, got 0"),
        ({"max_num_batched_tokens": 0}, ValueError, "max_num_batched_tokens must be >= 1, got 0"),
        (
            {"max_num_batched_tokens": None},
            TypeError,
            "max_num_batched_tokens must be an int, got NoneType None",
        ),
        ({"max_num_seqs": True}, TypeError, "max_num_seqs must be an int, got bool True"),
        ({"max_num_seqs": None}, TypeError, "max_num_seqs must be an int, got NoneType None"),
        ({"max_model_len": 1}, ValueError, "max_model_len must be >= 2, got 1"),
        (
            {"max_waiting_requests": 0},
            ValueError,
            "max_waiting_requests must be >= 1 (or None for no limit), got 0",
        ),
        ({"max_model_len": 2.5}, TypeError, "max_model_len must be an int, got float 2.5"),
        (
            {"pipeline_depth": 3},
            ValueError,
            "pipeline_depth must be 1 (serial) or 2 (lookahead), got 3",
        ),
        (
            {"pipeline_depth": None},
            TypeError,
            "pipeline_depth must be an int: 1 (serial) or 2 (lookahead), got NoneType None",
        ),
        (
            {"pipeline_depth": 1.0},
            TypeError,
            "pipeline_depth must be an int: 1 (serial) or 2 (lookahead), got float 1.0",
        ),
        (
            {"pipeline_depth": True},
            TypeError,
            "pipeline_depth must be an int: 1 (serial) or 2 (lookahead), got bool True",
        ),
        (
            {"shutdown": "later"},
            ValueError,
            "shutdown must be one of 'drain', 'cancel', got 'later'",
        ),
        (
            {"shutdown": None},
            TypeError,
            "shutdown must be a str: one of 'drain', 'cancel', got NoneType None",
        ),
        (
            {"dtype": "fp8"},
            ValueError,
            "dtype must be one of 'auto', 'float32', 'bfloat16', 'float16', got 'fp8'",
        ),
        (
            {"dtype": None},
            TypeError,
            "dtype must be a str: one of 'auto', 'float32', 'bfloat16', 'float16', "
            "got NoneType None",
        ),
        ({"torch_threads": 0}, ValueError, "torch_threads must be >= 1, got 0"),
        ({"torch_threads": "2"}, TypeError, "torch_threads must be an int, got str '2'"),
        (
            {"enable_prefix_caching": 1},
            TypeError,
            "enable_prefix_caching must be a bool, got int 1",
        ),
        (
            {"kv_cache_memory": 1.5},
            ValueError,
            "kv_cache_memory as a fraction must be in (0, 1), got 1.5",
        ),
        (
            {"kv_cache_memory": float("nan")},
            ValueError,
            "kv_cache_memory as a fraction must be in (0, 1), got nan",
        ),
        ({"kv_cache_memory": 0}, ValueError, "kv_cache_memory in bytes must be >= 1, got 0"),
        (
            {"kv_cache_memory": "1G"},
            TypeError,
            "kv_cache_memory must be bytes (int) or a fraction (float), got str '1G'",
        ),
        (
            {"kv_cache_memory": True},
            TypeError,
            "kv_cache_memory must be bytes (int) or a fraction (float), got bool True",
        ),
    ],
)
def test_bad_config(options: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        EngineConfig(**options)


def test_unknown_option() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        EngineConfig(colour="red")  # type: ignore[call-arg]


@pytest.mark.parametrize("field", [field.name for field in attrs.fields(EngineConfig)])
def test_every_field_rejects_a_wrong_type(field: str) -> None:
    """The audit of issue 8: no field takes a value of the wrong type (``None`` or a list)."""
    optional = {field.name for field in attrs.fields(EngineConfig) if field.default is None}
    optional.add("quantization")  # default "auto"; None is vLLM's "weights in the dtype"
    if field not in optional:
        with pytest.raises(TypeError, match=f"^{field} must be "):
            EngineConfig(**{field: None})
    with pytest.raises(TypeError, match=f"^{field} must be "):
        EngineConfig(**{field: [1]})


def test_defaults() -> None:
    config = EngineConfig()
    assert (config.pipeline_depth, config.shutdown, config.dtype) == (2, "drain", "auto")
    assert config.enable_prefix_caching is True
