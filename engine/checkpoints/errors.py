"""The checkpoint floor's errors: a model that cannot be found or loaded, and a GGUF file's
weight in a type its blocks are not computed in. Their own module, so that every reader of
the floor (the checkpoint reader, the hub cache's) raises the one class."""

from __future__ import annotations

import os

from twostroke.engine.checkpoints.gguf import BLOCK_TYPES
from twostroke.states.errors import EngineError

__all__ = ["BlockTypeUnsupported", "ModelLoadError"]


class ModelLoadError(EngineError):
    """A model cannot be found or loaded.

    Attributes:
        path: The file or directory (or the name) at fault.
        problem: What is wrong with it.
    """

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class BlockTypeUnsupported(ModelLoadError):
    """``quantization="gguf"`` (or ``"gguf_f32"``, named as ``asked``) asked for a GGUF
    file's weights as stored, and one of them is
    in a type twostroke does not compute as stored (it is never dequantized silently).

    Attributes:
        tensor: The file's name for the tensor.
        block_type: Its type's name (``"Q4_K"``).
    """

    def __init__(
        self, path: str | os.PathLike[str], tensor: str, block_type: str, asked: str = "gguf"
    ) -> None:
        self.tensor = tensor
        self.block_type = block_type
        super().__init__(
            path,
            f"tensor {tensor!r} is {block_type}, which quantization={asked!r} does not compute "
            f"as stored (it computes {', '.join(BLOCK_TYPES)}); quantization=None "
            "dequantizes the file",
        )
