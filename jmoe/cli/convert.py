"""Convert a Hugging Face MoE checkpoint (safetensors) to an Orbax checkpoint that jmoe restores fast.

python -m jmoe.convert HF_DIR OUT_DIR [--dtype bfloat16|float32] [--expert-dtype int4 ...] [--overwrite]
"""

from __future__ import annotations

import argparse
import sys

from jmoe.checkpoint.convert import convert_checkpoint
from jmoe.cli.common import add_expert_dtype_args, run_cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jmoe.convert", description=__doc__.splitlines()[0])
    p.add_argument("hf_dir", metavar="HF_DIR", help="Hugging Face model directory (config.json, *.safetensors)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="output directory for the Orbax checkpoint")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="parameter dtype to store (default: the dtype in config.json)")
    add_expert_dtype_args(p)
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it is not empty")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        out = convert_checkpoint(args.hf_dir, args.out_dir, dtype=args.dtype, expert_dtype=args.expert_dtype,
                                 expert_group_size=args.expert_group_size, overwrite=args.overwrite,
                                 progress=not args.quiet)
        print(f"wrote {out}")
        return 0

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
