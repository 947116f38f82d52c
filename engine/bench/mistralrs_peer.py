"""mistral.rs (its Python package ``mistralrs``) as a benchmark peer, in a child process.

mistral.rs is a Rust engine (on candle) with a continuous-batching scheduler; its CPU wheel
on PyPI reads the model's GGUF file itself and computes with the weights as stored (candle's
quantized matrix products), so its row names the file's weight format
(:func:`~twostroke.engine.bench.llamacpp_peer.gguf_weights`). Its ``Runner`` runs at most
``max_seqs`` sequences at once; on the CPU its KV cache is not paged (its PagedAttention is
CUDA and Metal only) and it keeps it in float16. Its requests take text, not token ids: the
child sends each prompt's text in the model's own tokenizer under a chat template that adds
nothing, and says how many prompts tokenize back to other ids. It sends one prompt at a time
(see ``_mistralrs_child.py``): mistral.rs 0.9.5's ``Runner`` refuses a request sent while
another's prompt is in.

``make bench-peers`` installs ``mistralrs`` into a venv of its own (``.venv-mistralrs``;
``make test``'s venv never has it), and ``make bench`` passes its Python as
``--mistralrs-python``; without that option, the bench's own Python is used when it can import
``mistralrs``. Either way it runs in a child process (:mod:`~twostroke.engine.bench.child`,
script ``_mistralrs_child.py``), with rayon's pool (``RAYON_NUM_THREADS``) at the bench's
threads, apart from torch's thread pools and OpenMP runtime.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from twostroke.engine.bench.llamacpp_peer import (
    BATCHED_PROTOCOL,
    BatchedGGUFPeer,
    batched_job_document,
)
from twostroke.engine.bench.model import ModelSpec

__all__ = ["CHILD_SCRIPT", "PROTOCOL", "VERSION", "MistralRsDriver", "job_document"]

#: The script the child process runs, by path.
CHILD_SCRIPT = Path(__file__).with_name("_mistralrs_child.py")

#: The version of the JSON job and result documents (the child's ``PROTOCOL``).
PROTOCOL = BATCHED_PROTOCOL

#: The job the child runs (:func:`~twostroke.engine.bench.llamacpp_peer.batched_job_document`).
job_document = batched_job_document

#: The ``mistralrs`` release ``make bench-peers`` installs.
VERSION = "0.9.5"


@attrs.define(eq=False, kw_only=True)
class MistralRsDriver(BatchedGGUFPeer):
    """mistral.rs's ``Runner`` on the model's GGUF file, greedy, in a child process.

    Attributes:
        python: The Python of a venv with ``mistralrs`` (``--mistralrs-python``); ``None``:
            this one, if it can import ``mistralrs``.
        max_num_seqs: The most requests its scheduler runs at once (the bench's
            ``--max-num-seqs``, as twostroke's): an int >= 1, else ``TypeError`` or
            ``ValueError``.
        timeout, child_script, env: As :class:`~twostroke.engine.bench.child.ChildPeer`'s
            (tests substitute a fake ``mistralrs`` through ``env``, not the script).
    """

    system = "mistral.rs"
    module = "mistralrs"
    option = "--mistralrs-python"
    setup_hint = (
        "install it with `make bench-peers` (.venv-mistralrs), then pass "
        "--mistralrs-python .venv-mistralrs/bin/python"
    )
    script = CHILD_SCRIPT
    installed_as = "mistralrs"
    not_gguf = "mistral.rs is run on a GGUF file here; {source} is not one"
    not_constrained = "JSON schemas and tools are not run through mistral.rs here"
    weights_note = "computed as stored"

    work_folder = "mistralrs"

    name: str = attrs.field(default="mistral.rs", init=False)

    def run_variables(self, model: ModelSpec, folder: Path) -> dict[str, str]:
        """Rayon's pool, which runs mistral.rs's CPU kernels, at the bench's threads."""
        return {"RAYON_NUM_THREADS": str(model.threads)}
