"""The `fp4offload` command: plan | doctor | bench | inspect | export-adamw."""

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


def _export_adamw(args) -> int:
    import torch

    from ._optim.export import adamw_state_dict

    if os.path.abspath(args.input) == os.path.abspath(args.output):
        raise ConfigError("export-adamw OUT", args.output, "a file other than IN", "IN is kept as it was")
    try:
        saved = torch.load(args.input, map_location="cpu", weights_only=True)
    except OSError:
        raise
    except Exception as e:  # not a torch file, or damaged: torch's unpickler raises whatever the bytes lead it to
        first = (str(e).splitlines() or [""])[0][:200]
        raise ConfigError("export-adamw IN", args.input, "a file torch.save wrote (FP4AdamW's state_dict())",
                          f"it does not load ({type(e).__name__}: {first})") from None
    out = adamw_state_dict(saved, drop_masters=args.drop_masters)
    tmp = f"{args.output}.tmp-{os.getpid()}"
    try:
        torch.save(out, tmp)
        os.replace(tmp, args.output)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    n = sum(1 for e in out["state"].values() if isinstance(e, dict))
    print(f"fp4offload: {n} parameter states as torch AdamW's (fp32 exp_avg, exp_avg_sq): {args.output} "
          f"({os.path.getsize(args.output) / 2**20:.1f} MiB, from {os.path.getsize(args.input) / 2**20:.1f} MiB)")
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
    e = sub.add_parser("export-adamw", help="convert a saved FP4AdamW state dict to torch AdamW's (fp32 states)")
    e.add_argument("input", metavar="IN", help="what torch.save wrote of FP4AdamW.state_dict() (optimizer.pt)")
    e.add_argument("output", metavar="OUT", help="where torch AdamW's state dict goes")
    e.add_argument("--drop-masters", action="store_true",
                   help="drop the fp32 or split masters kept beside bf16 parameters (torch AdamW keeps none)")
    e.set_defaults(func=_export_adamw)
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
