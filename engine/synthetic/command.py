"""``twostroke synthesize``: write a random-weight model of a real architecture at its real
configuration (:mod:`twostroke.engine.synthetic`).

* ``twostroke synthesize --list`` prints the shapes, one a line, with their sizes;
* ``twostroke synthesize SHAPE --format hf --out DIR`` writes a model folder into ``DIR``;
* ``twostroke synthesize SHAPE --format gguf [--type f16|q8_0|q4_k_m] --out DIR`` writes
  ``DIR/SHAPE-TYPE.gguf`` (``q4_k_m`` through ``--llamacpp-python PY``'s llama.cpp);
* ``SHAPE@N`` (``qwen3-30b-a3b@12``) is the shape's first ``N`` layers, each as the real
  model's, for a model whose whole depth does not fit the disk.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from twostroke.engine.synthetic.gguf_file import GGUF_TYPES, QuantizerUnavailable, write_gguf
from twostroke.engine.synthetic.hf import HF_DTYPES, write_hf
from twostroke.engine.synthetic.shapes import SHAPES, TEST_SHAPES, Shape, shape_named
from twostroke.engine.synthetic.weights import tensor_specs

__all__ = ["add_synthesize_arguments", "synthesize_command"]


def add_synthesize_arguments(parser: argparse.ArgumentParser) -> None:
    """``twostroke synthesize``'s arguments (and its parser's ``error``, for the command's
    usage errors)."""
    parser.set_defaults(synthesize_usage_error=parser.error)
    parser.add_argument(
        "shape",
        nargs="?",
        metavar="SHAPE",
        help="a shape --list prints; SHAPE@N is its first N layers",
    )
    parser.add_argument("--list", action="store_true", help="print the shapes and exit")
    parser.add_argument("--format", choices=["hf", "gguf"], default=None, help="required")
    parser.add_argument(
        "--type",
        choices=GGUF_TYPES,
        default=GGUF_TYPES[0],
        help="a GGUF file's weight type (q4_k_m needs --llamacpp-python)",
    )
    parser.add_argument(
        "--dtype", choices=HF_DTYPES, default=HF_DTYPES[0], help="an hf folder's weight dtype"
    )
    parser.add_argument("--out", type=Path, default=None, metavar="DIR", help="required")
    parser.add_argument("--seed", type=int, default=0, help="the weights' seed")
    parser.add_argument(
        "--llamacpp-python",
        default=None,
        metavar="PY",
        help="the Python of a venv with llama-cpp-python, whose quantizer makes q4_k_m "
        "(.venv-llamacpp/bin/python)",
    )


def synthesize_command(args: argparse.Namespace) -> int:
    """Run ``twostroke synthesize``; its exit status.

    Usage errors (no shape, an unknown one, a missing ``--format`` or ``--out``) exit
    through the subcommand parser's ``error``, with status 2.
    """
    usage_error: Callable[[str], NoReturn] = args.synthesize_usage_error
    if args.list:
        for shape in (*SHAPES.values(), *TEST_SHAPES.values()):
            print(_describe(shape))
        return 0
    if args.shape is None:
        usage_error("the following arguments are required: SHAPE (or --list)")
    if args.format is None or args.out is None:
        usage_error("the following arguments are required: --format, --out")
    if not 0 <= args.seed < 2**31:
        usage_error(f"argument --seed: must be in [0, 2**31), got {args.seed}")
    try:
        shape = shape_named(args.shape)
    except ValueError as error:
        usage_error(f"argument SHAPE: {error}")
    try:
        if args.format == "hf":
            write_hf(shape, args.out, dtype=args.dtype, seed=args.seed)
            written = args.out
        else:
            args.out.mkdir(parents=True, exist_ok=True)
            written = args.out / f"{shape.name}-{args.type}.gguf"
            write_gguf(
                shape,
                written,
                type=args.type,
                seed=args.seed,
                llamacpp_python=args.llamacpp_python,
            )
    except QuantizerUnavailable as error:
        print(f"twostroke synthesize: error: {error}", file=sys.stderr)
        return 2
    print(written)
    return 0


def _describe(shape: Shape) -> str:
    parameters = sum(spec.numel for spec in tensor_specs(shape))
    # A token reads its router's top k experts of each layer, not the others.
    idle = shape.num_experts - shape.experts_per_token
    active = parameters - idle * shape.num_layers * 3 * shape.hidden_size * (
        shape.expert_intermediate_size
    )
    mixture = (
        f" ({active / 1e9:.2f} B active, top {shape.experts_per_token} of "
        f"{shape.num_experts} experts)"
        if shape.num_experts
        else ""
    )
    return (
        f"{shape.name:<14} {shape.family:<8} {parameters / 1e9:5.2f} B parameters{mixture}, "
        f"{shape.num_layers} layers, hidden {shape.hidden_size} ({shape.source})"
    )
