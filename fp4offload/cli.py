"""The `fp4offload` command: plan | doctor | bench | inspect."""

from __future__ import annotations

import argparse
import json
import sys


def _doctor(args) -> int:
    from .doctor import render, report

    r = report(args.config)
    print(json.dumps(r, indent=2) if args.json else render(r))
    return 0


def _inspect(args) -> int:
    from .formats.container import read_container

    meta, tensors = read_container(args.path)
    out = {"meta": meta, "tensors": {k: {"dtype": str(v.dtype).replace("torch.", ""), "shape": list(v.shape)}
                                     for k, v in tensors.items()}}
    print(json.dumps(out, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fp4offload", description="4-bit offload of optimizer states, activations and "
                                "weight shards for DeepSpeed and FSDP2.")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="what this machine offers: GPUs, codec backends, DeepSpeed ops")
    d.add_argument("--json", action="store_true", help="one JSON object instead of text")
    d.add_argument("--config", metavar="DS_CONFIG.json",
                   help="resolve the host settings of this DeepSpeed config's block "
                        "(default: environment and defaults)")
    d.set_defaults(func=_doctor)
    i = sub.add_parser("inspect", help="print the header of a file fp4offload wrote (PackedTensor, state tier)")
    i.add_argument("path")
    i.set_defaults(func=_inspect)
    try:
        from .planner.cli_plan import add_bench_parser, add_plan_parser
    except ImportError:
        pass
    else:
        add_plan_parser(sub)
        add_bench_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except Exception as e:  # errors of ours carry their own advice
        from .errors import FP4OffloadError

        if isinstance(e, FP4OffloadError):
            print(f"fp4offload: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
