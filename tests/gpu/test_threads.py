"""torch_threads sets torch's intra-op thread count for a block and always restores it."""

from __future__ import annotations

import re

import pytest
import torch

from twostroke.gpu.threads import torch_threads


def test_sets_and_restores() -> None:
    before = torch.get_num_threads()
    with torch_threads(1) as inside:
        assert inside == torch.get_num_threads() == 1
        with torch_threads(2):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_restores_when_the_block_raises() -> None:
    before = torch.get_num_threads()
    with pytest.raises(KeyError), torch_threads(1):
        raise KeyError("boom")
    assert torch.get_num_threads() == before


def test_none_leaves_the_count() -> None:
    before = torch.get_num_threads()
    with torch_threads(None) as inside:
        assert inside == before
    assert torch.get_num_threads() == before


@pytest.mark.parametrize(
    ("threads", "error", "message"),
    [
        (0, ValueError, "threads must be >= 1, got 0"),
        (1.0, TypeError, "threads must be an int, got float 1.0"),
        (True, TypeError, "threads must be an int, got bool True"),
    ],
)
def test_bad_counts(threads: object, error: type[Exception], message: str) -> None:
    before = torch.get_num_threads()
    with pytest.raises(error, match=f"^{re.escape(message)}$"), torch_threads(threads):  # type: ignore[arg-type]
        pass
    assert torch.get_num_threads() == before
