"""OpenVINO GenAI as a benchmark peer, in a child process.

OpenVINO GenAI is the other CPU engine with continuous batching over a paged KV cache (and a
prefix cache, off by default): its ``ContinuousBatchingPipeline`` reads the model's GGUF file
itself, with no conversion step (it converts the weights to its own forms at load). The
bench's greedy check shows whether the row computes the same model: on SmolLM2's Q4_1 file it
re-encodes the blocks as its own int4 with an integer zero point per group, so its greedy
outputs leave the file's early (docs/performance.md). The report names the file's format
beside the row (:func:`~twostroke.engine.bench.llamacpp_peer.gguf_weights`).

``make bench-peers`` installs ``openvino-genai`` into a venv of its own (``.venv-openvino``;
``make test``'s venv never has it), and ``make bench`` passes its Python as
``--openvino-python``; without that option, the bench's own Python is used when it can import
``openvino_genai``. Either way it runs in a child process
(:mod:`~twostroke.engine.bench.child`, script ``_openvino_child.py``), apart from torch's thread
pools and OpenMP runtime (OpenVINO brings its own, TBB).
"""

from __future__ import annotations

from pathlib import Path

import attrs

from twostroke.engine.bench.llamacpp_peer import (
    BATCHED_PROTOCOL,
    BatchedGGUFPeer,
    batched_job_document,
)

__all__ = ["CHILD_SCRIPT", "PROTOCOL", "VERSION", "OpenVinoDriver", "job_document"]

#: The script the child process runs, by path.
CHILD_SCRIPT = Path(__file__).with_name("_openvino_child.py")

#: The version of the JSON job and result documents (the child's ``PROTOCOL``).
PROTOCOL = BATCHED_PROTOCOL

#: The job the child runs (:func:`~twostroke.engine.bench.llamacpp_peer.batched_job_document`).
job_document = batched_job_document

#: The ``openvino-genai`` release ``make bench-peers`` installs.
VERSION = "2026.4.1"


@attrs.define(eq=False, kw_only=True)
class OpenVinoDriver(BatchedGGUFPeer):
    """OpenVINO GenAI's continuous batching on the model's GGUF file, greedy, in a child
    process.

    Attributes:
        python: The Python of a venv with ``openvino-genai`` (``--openvino-python``);
            ``None``: this one, if it can import ``openvino_genai``.
        max_num_seqs: The most requests its scheduler runs at once (the bench's
            ``--max-num-seqs``, as twostroke's): an int >= 1, else ``TypeError`` or
            ``ValueError``.
        timeout, child_script, env: As :class:`~twostroke.engine.bench.child.ChildPeer`'s
            (tests substitute a fake ``openvino_genai`` through ``env``, not the script).
    """

    system = "OpenVINO GenAI"
    module = "openvino_genai"
    option = "--openvino-python"
    setup_hint = (
        "install it with `make bench-peers` (.venv-openvino), then pass "
        "--openvino-python .venv-openvino/bin/python"
    )
    script = CHILD_SCRIPT
    installed_as = "openvino-genai"
    not_gguf = "OpenVINO GenAI is run on a GGUF file here; {source} is not one"
    not_constrained = "JSON schemas and tools are not run through OpenVINO GenAI here"
    weights_note = "converted by OpenVINO GenAI at load"

    work_folder = "openvino"

    name: str = attrs.field(default="openvino-genai", init=False)
