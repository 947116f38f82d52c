"""llama.cpp's logits and greedy tokens on a GGUF file, for ``scripts/weight_quality.py``.

Run by path with the Python of the venv ``llama-cpp-python`` is built in
(``PYTHON _llamacpp_perplexity.py LOGITS.npy``, a JSON job on stdin); it imports nothing but
the standard library, numpy and ``llama_cpp``. The job names the file (``path``), the token
ids of the held-out text (``heldout``), the prompts' token ids (``prompts``), the greedy
tokens to make for each (``max_tokens``) and the threads (``threads``). The token ids are
given, never re-tokenized by llama.cpp, so both engines score the same sequence.

Writes the held-out text's logits at every position (float32, tokens x vocabulary) to
``LOGITS.npy`` and prints ``{"tokens": [[...], ...], "version": "..."}`` on stdout. Exit
status 0 on success; else the reason is the last line on stderr.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    """Evaluate the job on stdin; the held-out logits go to ``argv[0]``."""
    if len(argv) != 1:
        print("usage: _llamacpp_perplexity.py LOGITS.npy < job.json", file=sys.stderr)
        return 2
    try:
        # Installed in the child's venv only, so the type checker of twostroke's cannot see it.
        import llama_cpp  # type: ignore[import-not-found, unused-ignore]
        import numpy
    except ImportError as error:
        print(f"llama_cpp is not importable here ({sys.executable}): {error}", file=sys.stderr)
        return 3
    job = json.load(sys.stdin)
    heldout: list[int] = job["heldout"]
    prompts: list[list[int]] = job["prompts"]
    max_tokens: int = job["max_tokens"]
    longest = max([len(heldout), *(len(ids) + max_tokens for ids in prompts)])
    # llama.cpp's other defaults (a float16 KV cache, its own batch size) are kept: the
    # figures are meant to be what its users get from the file.
    model = llama_cpp.Llama(
        model_path=job["path"],
        n_ctx=longest,
        logits_all=True,
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        verbose=False,
    )
    model.eval(heldout)
    numpy.save(argv[0], numpy.asarray(model.scores[: len(heldout)], dtype=numpy.float32))
    tokens = []
    for ids in prompts:
        model.reset()
        model.eval(ids)
        made: list[int] = []
        while True:
            # EOS ignored, as the engine's greedy run is asked (ignore_eos=True).
            made.append(int(numpy.argmax(model.scores[model.n_tokens - 1])))
            if len(made) == max_tokens:
                break
            model.eval(made[-1:])
        tokens.append(made)
    json.dump({"tokens": tokens, "version": llama_cpp.__version__}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
