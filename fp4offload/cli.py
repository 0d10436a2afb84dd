"""The `fp4offload` command: plan | doctor | bench | inspect."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys

from .errors import ConfigError, FP4OffloadError


def _doctor(args) -> int:
    from ._doctor import render, report

    r = report(args.config)
    print(json.dumps(r, indent=2) if args.json else render(r))
    return 0


def _inspect(args) -> int:
    from .formats.container import verify_container
    from ._jsonfile import file_kind

    path = args.path
    if not path or "\0" in path:
        raise ConfigError("inspect FILE", path, "a path to a file fp4offload wrote")
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError("inspect FILE", path, "a file fp4offload wrote", e.strerror or str(e)) from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError("inspect FILE", path, "a regular file fp4offload wrote",
                          f"it is {file_kind(st.st_mode)}; it is not read")
    meta, tensors = verify_container(path)  # checks every checksum, reading the file in bounded chunks
    out = {"meta": meta, "tensors": {k: {"dtype": v["dtype"], "shape": v["shape"]} for k, v in tensors.items()}}
    print(json.dumps(out, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fp4offload", description="4-bit offload of optimizer states, activations and "
                                "weight shards for DeepSpeed and FSDP2.")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="what this machine offers: GPUs, codec backends, DeepSpeed ops")
    d.add_argument("--json", action="store_true", help="one JSON object instead of text")
    d.add_argument("--config", metavar="DS_CONFIG.json",
                   help="show the settings in effect with this DeepSpeed config's block: each from its "
                        "FP4OFFLOAD_* variable, the block's JSON key, or the default (without it: variables and "
                        "defaults)")
    d.set_defaults(func=_doctor)
    i = sub.add_parser("inspect", help="print the header of a file fp4offload wrote (PackedTensor, state tier)")
    i.add_argument("path")
    i.set_defaults(func=_inspect)
    try:
        from ._planner.cli_plan import add_bench_parser, add_plan_parser
    except ImportError:
        pass
    else:
        add_plan_parser(sub)
        add_bench_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    No traceback reaches the user for anything a user can cause: errors of fp4offload (ConfigError,
    CorruptionError, CapacityError, ...) and OSErrors print one line, ``fp4offload: error: ...``, and return 2;
    Ctrl-C returns 130. Usage errors are argparse's (exit 2, naming the flag)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except FP4OffloadError as e:  # errors of ours carry their own advice
        print(f"fp4offload: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the filesystem said no (full, read-only, gone): name the file and the reason
        where = f"{e.filename}: " if e.filename else ""
        print(f"fp4offload: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fp4offload: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
