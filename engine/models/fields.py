"""Reading a configuration's fields (a parsed ``config.json``, a GGUF file's key/values):
present, counts that are ints >= 1, a head's width, end-of-sequence ids; each refusal a
``ValueError`` naming the field and the value."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["count", "head_dim_of", "require", "token_ids"]


def require(data: Mapping[str, Any], name: str) -> Any:
    if data.get(name) is None:
        raise ValueError(f"the configuration lacks {name!r}")
    return data[name]


def count(data: Mapping[str, Any], name: str, *, default: int | None = None) -> int:
    """A count the configuration is divided by or allocated from: an int >= 1 (``default``
    where the key is absent or null), checked before it is used."""
    value = data.get(name)
    if value is None and default is not None:
        return default
    if value is None:
        raise ValueError(f"the configuration lacks {name!r}")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def head_dim_of(
    data: Mapping[str, Any], name: str, hidden_size: int, num_heads: int, hidden_name: str
) -> int:
    """The width of a head: ``name`` where the configuration gives it, else the residual
    stream's width shared among the heads, which must then divide it."""
    if data.get(name) is not None:
        return count(data, name)
    if hidden_size % num_heads:
        raise ValueError(
            f"{hidden_name} must be a multiple of the head count without {name!r}, got "
            f"{hidden_size} and {num_heads} heads"
        )
    return hidden_size // num_heads


def token_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list | tuple):
        return tuple(int(item) for item in value)
    raise ValueError(f"eos_token_id must be an int or a list of ints, got {value!r}")
