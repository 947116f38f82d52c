"""EngineConfig rejects every bad value with a message naming the field and the rule."""

from __future__ import annotations

import re
from typing import Any

import attrs
import pytest

from twostroke.engine import EngineConfig
from twostroke.engine.config import (
    LOOPBACK_HOST_NAMES,
    ServerConfig,
    parse_server_limit,
    server_flag_help,
    server_flag_metavar,
    without_port,
)


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
        (
            {"kv_cache_dtype": "fp8"},
            ValueError,
            "kv_cache_dtype must be one of 'auto', 'float32', 'bfloat16', 'float16', got 'fp8'",
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
        ({"mmap": 0}, TypeError, "mmap must be a bool, got int 0"),
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


# --- ServerConfig ---------------------------------------------------------------------------


def test_the_server_defaults() -> None:
    """The limits docs/serving.md explains (8 MiB, 128 choices, 16 batches of 64, ...)."""
    assert ServerConfig() == ServerConfig(
        max_body_bytes=8 * 2**20,
        max_choices=128,
        max_waiting_requests=1024,
        allowed_hosts=None,
        max_connections=512,
        header_timeout=10.0,
        body_timeout=60.0,
        shutdown_timeout=5.0,
        keepalive=15.0,
    )


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"max_body_bytes": 0}, ValueError, "max_body_bytes must be >= 1, got 0"),
        ({"max_body_bytes": True}, TypeError, "max_body_bytes must be an int, got bool True"),
        ({"max_choices": 2.0}, TypeError, "max_choices must be an int, got float 2.0"),
        ({"max_choices": None}, TypeError, "max_choices must be an int, got NoneType None"),
        ({"max_waiting_requests": 0}, ValueError, "max_waiting_requests must be >= 1, got 0"),
        (
            {"max_waiting_requests": "9"},
            TypeError,
            "max_waiting_requests must be an int, got str '9'",
        ),
        (
            {"allowed_hosts": "localhost"},
            TypeError,
            "allowed_hosts must be a list of host names, got str 'localhost'",
        ),
        (
            {"allowed_hosts": ["localhost:8000"]},
            ValueError,
            "allowed_hosts entries must be host names without a port, got 'localhost:8000'",
        ),
        ({"allowed_hosts": [7]}, TypeError, "allowed_hosts entries must be str, got int 7"),
        ({"max_connections": 0}, ValueError, "max_connections must be >= 1, got 0"),
        (
            {"header_timeout": 0},
            ValueError,
            "header_timeout must be > 0 seconds and finite, got 0",
        ),
        (
            {"header_timeout": float("inf")},
            ValueError,
            "header_timeout must be > 0 seconds and finite, got inf",
        ),
        (
            {"body_timeout": float("nan")},
            ValueError,
            "body_timeout must be > 0 seconds and finite, got nan",
        ),
        (
            {"body_timeout": "5"},
            TypeError,
            "body_timeout must be a number of seconds, got str '5'",
        ),
        (
            {"shutdown_timeout": -1},
            ValueError,
            "shutdown_timeout must be >= 0 seconds and finite, got -1",
        ),
        (
            {"shutdown_timeout": True},
            TypeError,
            "shutdown_timeout must be a number of seconds, got bool True",
        ),
        ({"keepalive": 0}, ValueError, "keepalive must be > 0 seconds and finite, got 0"),
    ],
)
def test_bad_server_config(options: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        ServerConfig(**options)


@pytest.mark.parametrize("field", [field.name for field in attrs.fields(ServerConfig)])
def test_every_server_field_rejects_a_wrong_type(field: str) -> None:
    optional = {field.name for field in attrs.fields(ServerConfig) if field.default is None}
    optional.add("max_waiting_requests")  # None: no limit but the engine's own
    if field not in optional:
        with pytest.raises(TypeError, match=f"^{field} must be "):
            ServerConfig(**{field: None})
    with pytest.raises(TypeError, match=f"^{field} "):
        ServerConfig(**{field: [1] if field != "allowed_hosts" else [1.5]})


def test_the_server_config_is_frozen_and_zero_grace_is_allowed() -> None:
    config = ServerConfig(shutdown_timeout=0, max_waiting_requests=None)
    assert (config.shutdown_timeout, config.max_waiting_requests) == (0, None)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.max_choices = 4  # type: ignore[misc]


def test_the_hosts_answered_are_the_loopback_names_and_the_address_bound() -> None:
    assert ServerConfig().hosts_answered() == LOOPBACK_HOST_NAMES
    assert ServerConfig().hosts_answered("10.0.0.5") == LOOPBACK_HOST_NAMES | {"10.0.0.5"}
    assert ServerConfig().hosts_answered("FE80::1") == LOOPBACK_HOST_NAMES | {"[fe80::1]"}
    assert ServerConfig().hosts_answered("[fe80::1]") == LOOPBACK_HOST_NAMES | {"[fe80::1]"}
    given = ServerConfig(allowed_hosts=["LLM.internal", "::1", "*"])
    assert given.allowed_hosts == frozenset({"llm.internal", "[::1]", "*"})
    assert given.hosts_answered("10.0.0.5") == given.allowed_hosts  # given: taken as it is
    assert without_port("[::1]:8000") == "[::1]"
    assert without_port("localhost:8000") == "localhost"
    assert without_port("fe80::1") == "fe80::1"  # not a port: an address without brackets


@pytest.mark.parametrize(
    ("name", "text", "value"),
    [
        ("max_body_bytes", "1024", 1024),
        ("max_waiting_requests", "64", 64),
        ("header_timeout", "2.5", 2.5),
        ("shutdown_timeout", "0", 0.0),
        ("allowed_hosts", "a.example,[::1]", frozenset({"a.example", "[::1]"})),
    ],
)
def test_a_limit_given_as_text(name: str, text: str, value: object) -> None:
    assert parse_server_limit(name, text) == value


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("max_connections", "many", "max_connections must be an int, got 'many'"),
        ("max_choices", "1.5", "max_choices must be an int, got '1.5'"),
        ("body_timeout", "10s", "body_timeout must be a number of seconds, got '10s'"),
        ("max_connections", "0", "max_connections must be >= 1, got 0"),
        ("allowed_hosts", "a,,b", "allowed_hosts entries must be host names without a port, "
         "got ''"),
    ],
)  # fmt: skip
def test_a_bad_limit_given_as_text(name: str, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        parse_server_limit(name, text)


def test_the_flag_help_is_the_doc_s_first_clause_and_the_default() -> None:
    assert server_flag_help("max_connections") == "connections served at once (default: 512)"
    assert server_flag_help("body_timeout") == (
        "seconds a request body may take after its headers (default: 60)"
    )
    assert server_flag_help("keepalive") == (
        "seconds of silence on a stream before a keep-alive comment (: keep-alive), so that "
        "proxies do not time the stream out (default: 15)"
    )
    assert server_flag_help("allowed_hosts").endswith("and the address the server binds)")
    assert server_flag_metavar("allowed_hosts") == "HOST,..."
