"""Which module implements each architecture a checkpoint names: :func:`model_class`.

One entry per HF ``architectures`` name
(:data:`~twostroke.engine.models.config.SUPPORTED_ARCHITECTURES`, which a configuration is checked
against); a GGUF file's ``general.architecture`` is mapped to one of them when its configuration is
read (:meth:`~twostroke.engine.models.config.ModelConfig.from_gguf_metadata`).
"""

from __future__ import annotations

import types
from collections.abc import Mapping

from twostroke.engine.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from twostroke.engine.models.decoder import CausalLM, CheckpointNames
from twostroke.engine.models.gemma2 import Gemma2ForCausalLM
from twostroke.engine.models.gemma3 import Gemma3ForCausalLM
from twostroke.engine.models.granite import GraniteForCausalLM
from twostroke.engine.models.llama import LlamaForCausalLM
from twostroke.engine.models.mixtral import MixtralForCausalLM
from twostroke.engine.models.olmo2 import Olmo2ForCausalLM
from twostroke.engine.models.olmoe import OlmoeForCausalLM
from twostroke.engine.models.phi3 import Phi3ForCausalLM
from twostroke.engine.models.qwen3 import Qwen3ForCausalLM
from twostroke.engine.models.qwen3_moe import Qwen3MoeForCausalLM
from twostroke.engine.models.smollm3 import SmolLM3ForCausalLM

__all__ = ["ARCHITECTURES", "checkpoint_names", "model_class"]

#: Each supported HF architecture's model class.
ARCHITECTURES: Mapping[str, type[CausalLM]] = types.MappingProxyType(
    {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": LlamaForCausalLM,
        "Qwen3ForCausalLM": Qwen3ForCausalLM,
        "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
        "GraniteForCausalLM": GraniteForCausalLM,
        "Olmo2ForCausalLM": Olmo2ForCausalLM,
        "Phi3ForCausalLM": Phi3ForCausalLM,
        "Gemma2ForCausalLM": Gemma2ForCausalLM,
        "Gemma3ForCausalLM": Gemma3ForCausalLM,
        "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
        "MixtralForCausalLM": MixtralForCausalLM,
        "OlmoeForCausalLM": OlmoeForCausalLM,
    }
)
assert set(ARCHITECTURES) == set(SUPPORTED_ARCHITECTURES)


def model_class(config: ModelConfig) -> type[CausalLM]:
    """The class that implements ``config``'s architecture."""
    return ARCHITECTURES[config.architecture]


def checkpoint_names(config: ModelConfig) -> CheckpointNames:
    """``config``'s architecture's table of checkpoint names."""
    return model_class(config).names
