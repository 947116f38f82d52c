"""The model every system in a benchmark runs, and its weights in each system's format.

A comparison is fair only if every system computes with the same weights in the same dtype.
twostroke loads the GGUF shipped in a package and dequantizes it; the Hugging Face peers load
the same file through ``transformers`` with ``GgufConfig(dequantize=True)`` (recent
``transformers`` otherwise keep GGUF weights packed and compute with 4-bit kernels, which is
another arithmetic); vLLM-CPU cannot read GGUF reliably, so it gets a Hugging Face directory
that the first Hugging Face load writes with ``save_pretrained`` inside the run's folder.
llama.cpp reads the GGUF itself, quantized.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import attrs

from twostroke.states.validators import int_at_least

__all__ = ["DTYPES", "ModelSpec", "ensure_hf_dir", "load_hf_model", "save_hf_dir"]

#: The dtypes a benchmark may ask for, by the name every peer understands; ``"auto"`` (the
#: default) stands for the one twostroke's engine would pick on this machine's CPU.
DTYPES = ("bfloat16", "float16", "float32")

_HF_DIR_MARKER = "twostroke-source.txt"


def _resolve_auto(dtype: str) -> str:
    import torch

    from twostroke.engine.models.plan import DTYPES, resolve_dtype

    if dtype in DTYPES:
        return dtype
    return str(resolve_dtype(dtype, torch.device("cpu"))).removeprefix("torch.")


@attrs.frozen
class ModelSpec:
    """Which weights, in which dtype, on how many threads, with which folder for the run.

    Attributes:
        name: The model as twostroke takes it (``"smollm2"``, a directory, a GGUF file).
        source: The GGUF file or Hugging Face directory it resolves to.
        dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"``; ``"auto"`` is resolved when
            the spec is made, to what :func:`twostroke.gpu.dtype.default_dtype` picks for
            the CPU (bfloat16 only where the CPU computes it natively), so every system of
            the run computes in that one dtype and the report names it.
        threads: CPU threads each system may use.
        exact: twostroke computes float32 exactly as transformers does, as the engine does
            for an explicit ``dtype="float32"``. ``False`` (the default, and what
            :meth:`resolve` makes of ``dtype="auto"``): as the engine's ``dtype="auto"``,
            float32 weights packed for oneDNN (see
            :func:`~twostroke.engine.models.forms.can_pack`).
        work_dir: The run's folder: converted weights, vLLM's caches, logs, results.
        seed: For systems that take one (sampling is greedy; this fixes anything else).
    """

    name: str
    source: Path = attrs.field(converter=Path)
    dtype: str = attrs.field(default="auto", converter=_resolve_auto)
    threads: int = attrs.field(default=2, validator=int_at_least(1))
    exact: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    work_dir: Path = attrs.field(converter=Path, default=Path("bench-results"))
    seed: int = 0

    @dtype.validator
    def _check_dtype(self, attribute: object, value: str) -> None:
        if value not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {', '.join(DTYPES)}, got {value!r}")

    @classmethod
    def resolve(
        cls,
        model: str,
        *,
        work_dir: str | os.PathLike[str],
        dtype: str = "auto",
        threads: int = 2,
        seed: int = 0,
        llamacpp_python: str | os.PathLike[str] | None = None,
    ) -> ModelSpec:
        """The spec of a model name or path, resolved as twostroke resolves it; a
        ``synthetic:SHAPE[:TYPE]`` name is a random-weight model of a real architecture at
        its real size, made once and kept in the artifact cache
        (:func:`~twostroke.engine.synthetic.cached.synthetic_named`; ``llamacpp_python``
        quantizes its ``q4_k_m`` type).

        Raises:
            ModelLoadError: the name's package is not installed, or the path does not exist.
            ValueError: a synthetic name that names no shape or type.
        """
        from twostroke.engine.checkpoints.source import resolve_model
        from twostroke.engine.models.plan import exact_asked
        from twostroke.engine.synthetic.cached import synthetic_named

        synthetic = synthetic_named(model, llamacpp_python=llamacpp_python)
        return cls(
            name=model,
            source=resolve_model(model) if synthetic is None else synthetic,
            dtype=dtype,
            threads=threads,
            exact=exact_asked(dtype),
            work_dir=Path(work_dir),
            seed=seed,
        )

    @property
    def engine_model(self) -> str:
        """The model as the engine opens it: its name, which the engine resolves itself
        (``"smollm2"``, ``"toy"``, a path), or the file a ``synthetic:`` name was made into
        (a name only the bench knows)."""
        from twostroke.engine.synthetic.cached import SYNTHETIC_PREFIX

        return str(self.source) if self.name.startswith(SYNTHETIC_PREFIX) else self.name

    @property
    def is_gguf(self) -> bool:
        """Whether the source is a GGUF file (else a Hugging Face directory)."""
        return self.source.is_file()

    @property
    def hf_dir(self) -> Path:
        """Where the Hugging Face copy of a GGUF model is written, inside the run's folder."""
        if not self.is_gguf:
            return self.source
        return self.work_dir / f"hf-{self.source.stem}-{self.dtype}"


def load_hf_model(spec: ModelSpec) -> Any:
    """The model as a dense ``transformers`` model in the spec's dtype, on the CPU.

    A GGUF source is dequantized (same values twostroke computes with), or read back from
    its Hugging Face copy when the run's folder holds a current one (as twostroke reads its
    artifact cache instead of converting again). Callers pass the model to
    :func:`save_hf_dir` afterwards (outside their start-up timing), so vLLM can read the same
    weights.

    Raises:
        ImportError: ``transformers`` (or ``accelerate``, which GGUF loading needs) is missing.
    """
    import torch
    import transformers

    # transformers is only partly typed; the model is used through Any.
    auto: Any = transformers.AutoModelForCausalLM
    dtype = getattr(torch, spec.dtype)
    if spec.is_gguf and _hf_dir_is_current(spec):
        model = auto.from_pretrained(spec.hf_dir, dtype=dtype)
    elif spec.is_gguf:
        # Versions without GgufConfig always dequantize; newer ones must be asked to.
        gguf_config: Any = getattr(transformers, "GgufConfig", None)
        options = (
            {} if gguf_config is None else {"quantization_config": gguf_config(dequantize=True)}
        )
        model = auto.from_pretrained(
            spec.source.parent, gguf_file=spec.source.name, dtype=dtype, **options
        )
    else:
        model = auto.from_pretrained(spec.source, dtype=dtype)
    model.eval()
    return model


def ensure_hf_dir(spec: ModelSpec) -> tuple[Path, float]:
    """The Hugging Face directory of the spec's model, written now if it is missing.

    Returns:
        The directory, and the seconds spent writing it (0 when it was there).
    """
    if _hf_dir_is_current(spec):
        return spec.hf_dir, 0.0
    started = time.perf_counter()
    model = load_hf_model(spec)
    save_hf_dir(spec, model)
    del model
    return spec.hf_dir, time.perf_counter() - started


def _source_identity(spec: ModelSpec) -> str:
    stat = spec.source.stat()
    return f"{spec.source.resolve()} {stat.st_size} {stat.st_mtime_ns} {spec.dtype}\n"


def _hf_dir_is_current(spec: ModelSpec) -> bool:
    if not spec.is_gguf:
        return True
    marker = spec.hf_dir / _HF_DIR_MARKER
    try:
        return marker.read_text() == _source_identity(spec)
    except OSError:
        return False


def save_hf_dir(spec: ModelSpec, model: Any) -> None:
    """Write a GGUF model's Hugging Face copy at :attr:`ModelSpec.hf_dir`, unless it is there.

    Weights, config and tokenizer first, a marker naming the source last, so a copy cut short
    is written again next time.
    """
    if _hf_dir_is_current(spec):
        return
    from transformers import AutoTokenizer

    spec.hf_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(spec.hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(spec.source.parent, gguf_file=spec.source.name)
    tokenizer.save_pretrained(spec.hf_dir)
    (spec.hf_dir / _HF_DIR_MARKER).write_text(_source_identity(spec))
