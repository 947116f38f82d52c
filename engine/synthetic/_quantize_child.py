"""Quantizes a GGUF file with llama.cpp's own quantizer, inside the venv ``llama-cpp-python``
was built in.

Run by path (``PYTHON _quantize_child.py SOURCE TARGET FTYPE``) with the Python that
``twostroke synthesize --llamacpp-python`` names; it imports nothing but the standard
library and ``llama_cpp``. ``FTYPE`` is llama.cpp's ``llama_ftype`` number (15: Q4_K_M).
Exit status 0 when ``TARGET`` was written; else the reason is the last line on stderr.
"""

from __future__ import annotations

import ctypes
import sys


def main(argv: list[str]) -> int:
    """Quantize ``argv[0]`` into ``argv[1]`` as type ``argv[2]``."""
    if len(argv) != 3:
        print("usage: _quantize_child.py SOURCE TARGET FTYPE", file=sys.stderr)
        return 2
    source, target, ftype = argv
    try:
        # Installed in the child's venv only, so the type checker of twostroke's cannot see it.
        import llama_cpp  # type: ignore[import-not-found, unused-ignore]
    except ImportError as error:
        print(f"llama_cpp is not importable here ({sys.executable}): {error}", file=sys.stderr)
        return 3
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(ftype)
    status = llama_cpp.llama_model_quantize(source.encode(), target.encode(), ctypes.byref(params))
    if status != 0:
        print(f"llama_model_quantize returned {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
