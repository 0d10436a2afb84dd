"""Fuzz of the command line: every generated bad input ends in a one-line error naming the flag or key, or in a
correct result; never a traceback, a hang, a silently wrong plan or a lost file.

Cases are generated (itertools over subcommands x flags x values, and over files of every bad kind: a FIFO, a
directory, /dev/zero, non-UTF-8 bytes, repeated keys, a file over the size bound, JSON nested too deeply, a
symlink loop, NUL bytes, NaN and Infinity, huge numbers), run in this process through ``fp4offload.cli.main``
with a timer that turns a hang into a failure. A run that returns 0 or 1 (a plan, or "nothing fits") counts as a
result and must print strict, finite JSON and write strict JSON (no NaN). Two cases run the real console
entry in a subprocess. ``outcomes()`` is importable, so the same cases can be counted against another tree.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


DS_STRATEGY, FSDP_STRATEGY = "zero3-opt-cpu-fp4", "fsdp2-cpu"
TINY = "hidden=64,layers=2,heads=4,kv_heads=2,ffn=128,vocab=1000"
HUGE_FILE = 64 << 20  # a sparse file past any input-size bound


class _Hang(Exception):
    pass


@dataclass
class Case:
    id: str
    argv: list
    needle: str  # the flag or key a clean error must name
    expect: str = "error"  # "error": must be refused; "either": a correct result or a clean error; "result": valid
    intact: Callable[[], bool] | None = None  # False when the run destroyed something it should not have
    out_files: tuple = ()  # files a successful run wrote: must be strict JSON (or YAML) with finite numbers
    limit: float = 20.0


@dataclass
class Outcome:
    case: Case
    kind: str  # clean | correct | unclear | traceback | hang | silent | lost
    detail: str = ""
    seconds: float = 0.0
    rc: object = None
    err: str = field(default="", repr=False)


def _strict(text: str) -> object:
    def bad(c):
        raise ValueError(f"non-finite number {c} in JSON")
    return json.loads(text, parse_constant=bad)


def _finite(x) -> bool:
    if isinstance(x, float):
        return math.isfinite(x)
    if isinstance(x, dict):
        return all(_finite(v) for v in x.values())
    if isinstance(x, list):
        return all(_finite(v) for v in x)
    return True


def run_case(case: Case) -> Outcome:
    from fp4offload.cli import main

    out, err = io.StringIO(), io.StringIO()

    def on_alarm(*_):
        raise _Hang()

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, case.limit)
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(list(case.argv))
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except _Hang:
        return Outcome(case, "hang", f"no answer in {case.limit:.0f} s", time.perf_counter() - t0)
    except BaseException as e:  # what a user would see as a traceback
        return Outcome(case, "traceback", f"{type(e).__name__}: {str(e)[:200]}", time.perf_counter() - t0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    dt = time.perf_counter() - t0
    o, e = out.getvalue(), err.getvalue()
    if case.intact is not None and not case.intact():
        return Outcome(case, "lost", "a file that was there before is gone or changed", dt, rc, e)
    if "Traceback" in e:
        return Outcome(case, "traceback", e.strip().splitlines()[-1][:200], dt, rc, e)
    if rc in (0, 1):  # a result
        try:
            if "--format" in case.argv and case.argv[case.argv.index("--format") + 1] == "json" and o.strip():
                if not _finite(_strict(o)):
                    raise ValueError("non-finite number in the JSON output")
            for f in case.out_files:
                p = Path(f)
                if p.is_file():
                    if "fsdp" not in case.argv:
                        _strict(p.read_text())
                    else:
                        import yaml

                        if not _finite(yaml.safe_load(p.read_text())):
                            raise ValueError(f"{p} holds a non-finite number")
        except ValueError as exc:
            return Outcome(case, "silent", f"rc {rc}: {exc}", dt, rc, e)
        if case.expect == "error":
            return Outcome(case, "silent", f"accepted (rc {rc})", dt, rc, e)
        return Outcome(case, "correct", f"rc {rc}", dt, rc, e)
    if case.expect == "result":  # a valid input refused
        return Outcome(case, "unclear", f"valid input refused (rc {rc}): {e.strip()[-200:]!r}", dt, rc, e)
    lines = [ln for ln in e.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    ours = last.startswith("fp4offload") and (len(lines) == 1 or lines[0].startswith("usage:"))
    if not ours or case.needle.lower() not in last.lower():
        return Outcome(case, "unclear", f"rc {rc}: {last[:200]!r}", dt, rc, e)
    return Outcome(case, "clean", last[:200], dt, rc, e)


# ---------------------------------------------------------------------------------------------
# the generated cases


def _files(d: Path) -> dict[str, str]:
    """Bad input files of every kind (name -> path)."""
    d.mkdir(parents=True, exist_ok=True)
    f = {}
    f["fifo"] = str(d / "fifo.json")
    os.mkfifo(f["fifo"])
    f["directory"] = str(d / "adir")
    os.mkdir(f["directory"])
    f["dev-zero"] = "/dev/zero"
    f["missing"] = str(d / "missing.json")
    f["empty"] = str(d / "empty.json")
    Path(f["empty"]).write_bytes(b"")
    f["non-utf8"] = str(d / "latin1.json")
    Path(f["non-utf8"]).write_bytes('{"name": "caf\u00e9"}'.encode("latin-1"))
    f["huge"] = str(d / "huge.json")
    with open(f["huge"], "wb") as h:
        h.write(b"{")
        h.truncate(HUGE_FILE)
    f["deep"] = str(d / "deep.json")
    Path(f["deep"]).write_text("[" * 200_000 + "]" * 200_000)
    f["loop"] = str(d / "loop.json")
    os.symlink(f["loop"], f["loop"])
    f["array"] = str(d / "array.json")
    Path(f["array"]).write_text("[1, 2, 3]")
    f["nul"] = str(d / "a\0b.json")
    return f


def _llama(**kw):
    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000, "tie_word_embeddings": False,
           "head_dim": 16}
    cfg.update(kw)
    return cfg


def _moe(**kw):
    cfg = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000, "head_dim": 16,
           "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
           "mlp_only_layers": []}
    cfg.update(kw)
    return cfg


_HF_VALUES = [float("nan"), float("inf"), -1, 0, 1e30, 10 ** 30, "32", True, None, [], 1.5, 1_000_000]
_HF_INT_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
                "head_dim")
_MOE_INT_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


def _hf_expect(key: str, v) -> str:
    """What a Hugging Face config value must do: "error", or "either" (a correct plan or a clean error)."""
    if v is None and key in ("head_dim", "num_key_value_heads", "decoder_sparse_step", "mlp_only_layers"):
        return "either"  # absent: the default applies
    if isinstance(v, bool) or not isinstance(v, int):
        return "error"
    if v < 1:
        return "either" if key == "num_key_value_heads" and v == 0 else "error"
    return "either"  # large integers: a plan, or refused as past any real model


def generate(tmp: Path) -> list[Case]:
    """Every case, built in (and writing only under) ``tmp``."""
    from fp4offload._planner.readings import HostReading, Readings

    tmp.mkdir(parents=True, exist_ok=True)
    readings = tmp / "node.json"
    Readings(host=HostReading(ram_total=512 << 30, ram_available=480 << 30, cores_physical=32,
                              cores_logical=64)).save(readings)
    bad = _files(tmp / "bad")
    base = ["plan", "--gpu", "h100-80gb", "--gpus", "8", "--readings", str(readings), "--strategy", DS_STRATEGY,
            "--strategy", FSDP_STRATEGY, "--format", "json"]
    cases: list[Case] = []
    n = iter(range(1 << 30))

    def out(suffix=".json") -> str:
        return str(tmp / f"out{next(n)}{suffix}")

    # plan: numeric flags x values
    bad_float = ["nan", "inf", "-inf", "-1", "0", "-0.0", "1e400", "abc", "", "0x10"]
    far_float = ["1e-300", "1e300", "1e15"]
    for flag in ("--host-ram-gb", "--nvme-gb", "--mfu", "--lr"):
        for v in bad_float + far_float:
            o = out()
            cases.append(Case(f"plan {flag} {v!r}", base + [flag, v, "--emit", "deepspeed", o], flag,
                              "error" if v in bad_float or (flag == "--mfu" and float(v) > 1) else "either",
                              out_files=(o,)))
    for flag, v in (("--host-ram-gb", "512"), ("--nvme-gb", "3000"), ("--mfu", "0.4"), ("--lr", "3e-4"),
                    ("--gpus", "4"), ("--nodes", "2"), ("--host-cores", "48"), ("--micro-batch", "2"),
                    ("--seq-len", "2048"), ("--grad-accum", "8")):
        o = out()
        cases.append(Case(f"plan {flag} {v} (valid)", base + [flag, v, "--emit", "deepspeed", o], flag, "result",
                          out_files=(o,)))
    for flag in ("--gpus", "--nodes", "--host-cores", "--micro-batch", "--seq-len", "--grad-accum"):
        for v in ["-1", "0", "1.5", "abc", "", "1e3", "9" * 30, "100000000"]:
            cases.append(Case(f"plan {flag} {v!r}", base + [flag, v], flag,
                              "error" if v in ("-1", "0", "1.5", "abc", "", "1e3") else "either"))

    # plan --model dims: one key at a time
    dims = dict(p.split("=") for p in TINY.split(","))
    for key in dims:
        for v in ["0", "-1", "1e30", "1" + "0" * 30, "nan", "abc", ""]:
            d = dict(dims, **{key: v})
            text = ",".join(f"{k}={x}" for k, x in d.items())
            cases.append(Case(f"plan --model {key}={v}", base + ["--model", text], key,
                              "either" if (key == "kv_heads" and v == "0") else "error"))
    cases.append(Case("plan --model dims (valid)", base + ["--model", TINY], "--model", "result"))
    cases.append(Case("plan --model layers at the bound", base + ["--model", TINY.replace("layers=2", "layers=10000")],
                      "layers", "result"))
    for layers in ("100000", "1000000", "100000000", "1" + "0" * 30):
        cases.append(Case(f"plan --model layers={layers}",
                          base + ["--model", TINY.replace("layers=2", f"layers={layers}")], "layers", "either"))

    # plan --model config.json: one key at a time, dense and MoE
    hf = tmp / "hf"
    hf.mkdir()
    for make, keys in ((_llama, _HF_INT_KEYS + ("num_key_value_heads",)), (_moe, _MOE_INT_KEYS)):
        for key in keys:
            for i, v in enumerate(_HF_VALUES):
                p = hf / f"{make.__name__}-{key}-{i}.json"
                p.write_text(json.dumps(make(**{key: v})))
                cases.append(Case(f"plan --model {make.__name__[1:]} {key}={v!r}", base + ["--model", str(p)], key,
                                  _hf_expect(key, v)))
    for make in (_llama, _moe):
        p = hf / f"{make.__name__}-valid.json"
        p.write_text(json.dumps(make()))
        cases.append(Case(f"plan --model {make.__name__[1:]} (valid)", base + ["--model", str(p)], "--model",
                          "result"))
    p = hf / "llama4-interleaved-10000.json"  # the most runs of blocks a model can have, at the layer bound
    p.write_text(json.dumps({"model_type": "llama4_text", "hidden_size": 64, "num_hidden_layers": 10000,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 32,
                             "intermediate_size_mlp": 128, "vocab_size": 1000, "head_dim": 16, "num_local_experts": 4,
                             "num_experts_per_tok": 1, "interleave_moe_layer_step": 2}))
    cases.append(Case("plan --model interleaved MoE at the layer bound", base + ["--model", str(p)], "--model",
                      "result"))
    for key, v in (("tie_word_embeddings", float("nan")), ("tie_word_embeddings", "yes"), ("model_type", 7),
                   ("model_type", None), ("mlp_only_layers", "abc"), ("mlp_only_layers", [1e30]),
                   ("decoder_sparse_step", "x"), ("decoder_sparse_step", float("nan"))):
        p = hf / f"odd-{key}-{next(n)}.json"
        p.write_text(json.dumps((_moe if "layers" in key or "sparse" in key else _llama)(**{key: v})))
        cases.append(Case(f"plan --model {key}={v!r}", base + ["--model", str(p)], key,
                          "either" if key == "model_type" and v is None else "error"))
    p = hf / "layers-1e30.json"
    p.write_text('{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1e30, "num_attention_heads": 4, '
                 '"intermediate_size": 128, "vocab_size": 1000}')
    cases.append(Case("plan --model num_hidden_layers 1e30", base + ["--model", str(p)], "num_hidden_layers"))

    # repeated keys, one per reader
    dup = tmp / "dup"
    dup.mkdir()
    (dup / "config.json").write_text('{"model_type": "llama", "hidden_size": 64, "hidden_size": 4096, '
                                     '"num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, '
                                     '"vocab_size": 1000}')
    rd = json.loads(readings.read_text())
    (dup / "readings.json").write_text(json.dumps(rd).replace('"host": {', '"host": {"ram_total": 1, ', 1))
    (dup / "ds.json").write_text('{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": '
                                 '{"lr": 1e-4, "lr": 1e4}}}')
    files_by_flag = {
        "--model": (lambda f: base + ["--model", f], "--model", str(dup / "config.json"), "hidden_size"),
        "--readings": (lambda f: ["plan", "--gpu", "h100-80gb", "--readings", f, "--model", TINY], "--readings",
                       str(dup / "readings.json"), "host.ram_total"),
        "--check": (lambda f: ["plan", "--check", f, "--model", TINY], "--check", str(dup / "ds.json"),
                    "optimizer.params.lr"),
        "--config": (lambda f: ["doctor", "--json", "--config", f], "--config", str(dup / "ds.json"),
                     "optimizer.params.lr"),
    }
    for flag, (argv, needle, dupfile, dupkey) in files_by_flag.items():
        for kind, path in bad.items():
            if flag == "--model" and kind == "missing":
                continue  # a missing path is read as a preset name (its error names --model: covered below)
            expect = "either" if (flag == "--model" and kind == "directory") else "error"
            cases.append(Case(f"{flag} {kind}", argv(path), needle, expect, limit=20.0))
        cases.append(Case(f"{flag} repeated key", argv(dupfile), dupkey))
    cases.append(Case("plan --model missing", base + ["--model", bad["missing"]], "--model"))

    # inspect: every bad kind, and a container whose (checksummed) header repeats a key
    for kind, path in bad.items():
        cases.append(Case(f"inspect {kind}", ["inspect", path], path if kind != "nul" else "inspect"))
    cdup = tmp / "dup.fp4"
    _dup_container(cdup)
    cases.append(Case("inspect repeated header key", ["inspect", str(cdup)], "format"))

    # the strategy catalogue: one bad x.yaml in an otherwise empty folder
    for kind in ("fifo", "directory", "non-utf8", "huge", "dev-zero", "repeated key", "loop"):
        d = tmp / f"strategies-{next(n)}"
        d.mkdir()
        y = d / "x.yaml"
        if kind == "fifo":
            os.mkfifo(y)
        elif kind == "directory":
            y.mkdir()
        elif kind == "non-utf8":
            y.write_bytes("name: caf\u00e9\n".encode("latin-1"))
        elif kind == "huge":
            with open(y, "wb") as h:
                h.truncate(HUGE_FILE)
        elif kind == "dev-zero":
            os.symlink("/dev/zero", y)
        elif kind == "loop":
            os.symlink(y, y)
        else:
            y.write_text("name: x\nname: y\n")
        cases.append(Case(f"plan --strategies {kind}", ["plan", "--gpu", "h100-80gb", "--model", TINY, "--readings",
                                                        str(readings), "--strategies", str(d)], "x.yaml"))

    # output paths
    a_file = tmp / "regular.txt"
    a_file.write_text("keep me\n")
    fifo_out = tmp / "out.fifo"
    os.mkfifo(fifo_out)
    outdir = tmp / "outdir"
    outdir.mkdir()
    sentinel = tmp / "sentinel.json"
    sentinel.write_text('{"keep": true}\n')
    link = tmp / "link.json"
    os.symlink(sentinel, link)
    targets = {"a directory": (str(outdir), lambda: outdir.is_dir(), "error"),
               "under /proc": ("/proc/fp4offload-fuzz/out.json", None, "error"),
               "/proc/self": ("/proc/self/fp4offload.json", None, "error"),
               "under a regular file": (str(a_file / "out.json"), lambda: a_file.read_text() == "keep me\n", "error"),
               "a FIFO": (str(fifo_out), lambda: stat.S_ISFIFO(os.lstat(fifo_out).st_mode), "error"),
               "a NUL byte": (str(tmp / "o\0ut.json"), None, "error"),
               "empty": ("", None, "error"),
               "a symlink": (str(link), lambda: sentinel.read_text() == '{"keep": true}\n', "either")}
    bench = ["bench", "--seconds", "0.02", "--numel", "1024", "--format", "json"]
    for what, (target, intact, expect) in targets.items():
        for flag, argv in (("--emit", base + ["--emit", "deepspeed", target]),
                           ("--emit", base + ["--emit", "fsdp", target]),
                           ("--save-readings", base + ["--save-readings", target]),
                           ("--out", bench + ["--out", target])):
            if argv[0] == "bench" and expect != "error":
                continue  # a real benchmark run (torch.optim imports torch._dynamo: seconds); test_planner_cli runs it
            cases.append(Case(f"{' '.join(argv[:1] + argv[-3:-1])} -> {what}", argv, flag, expect, intact,
                              out_files=(target,) if expect == "either" else ()))
    # --nvme-path: a directory that must exist
    for what, p in (("missing", str(tmp / "no-such-dir")), ("a file", str(a_file)), ("/proc", "/proc"),
                    ("/dev/null", "/dev/null"), ("a NUL byte", "x\0y"), ("empty", ""), ("relative", "rel/dir")):
        # with --readings (as here) the path is the other node's: absent here is fine, relative is not
        cases.append(Case(f"plan --nvme-path {what}", base + ["--nvme-path", p], "--nvme-path",
                          "either" if what == "missing" else "error"))
        cases.append(Case(f"bench --nvme-path {what}", bench + ["--out", out(), "--nvme-path", p], "--nvme-path"))
    nv = tmp / "nvme"
    nv.mkdir()
    cases.append(Case("plan --nvme-path (valid, no readings)", ["plan", "--gpu", "h100-80gb", "--model", TINY,
                                                                "--strategy", DS_STRATEGY, "--format", "json",
                                                                "--nvme-path", str(nv)], "--nvme-path", "result"))

    # bench numbers
    for flag, values in (("--seconds", ["nan", "inf", "-1", "0", "1e9", "abc"]),
                         ("--numel", ["-1", "0", "1" + "0" * 30, "1e9"]),
                         ("--nvme-mb", ["-1", "0", "1" + "0" * 30])):
        for v in values:
            argv = ["bench", "--format", "json", "--out", out()] + (["--seconds", "0.02"] if flag != "--seconds"
                                                                    else []) + (["--numel", "1024"] if flag != "--numel"
                                                                                else []) + [flag, v]
            cases.append(Case(f"bench {flag} {v!r}", argv, flag))
    return cases


def _dup_container(path: Path) -> None:
    """A PackedTensor file whose header names "format" twice, with a valid header checksum."""
    import struct
    import zlib

    import torch

    import fp4offload

    fp4offload.quantize(torch.randn(64), "nvfp4").save(path)
    raw = path.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[8:16])
    header = raw[20:20 + hlen]
    new = header.replace(b'"format": "nvfp4"', b'"format": "mxfp4", "format": "nvfp4"', 1)
    assert new != header
    path.write_bytes(raw[:8] + struct.pack("<QI", len(new), zlib.crc32(new)) + new + raw[20 + hlen:])


def outcomes(tmp: Path) -> list[Outcome]:
    return [run_case(c) for c in generate(tmp)]


def tally(res: list[Outcome]) -> dict[str, int]:
    kinds = ("clean", "correct", "unclear", "traceback", "hang", "silent", "lost")
    return {k: sum(r.kind == k for r in res) for k in kinds}


# ---------------------------------------------------------------------------------------------
# tests


def test_fuzz_cli(tmp_path):
    t0 = time.perf_counter()
    res = outcomes(tmp_path)
    counts = tally(res)
    slowest = max(res, key=lambda r: r.seconds)
    print(f"fuzz: {len(res)} cases in {time.perf_counter() - t0:.1f} s: {counts}; "
          f"slowest {slowest.seconds:.2f} s ({slowest.case.id})")
    bad = [f"{r.case.id}: {r.kind}: {r.detail}" for r in res if r.kind not in ("clean", "correct")]
    assert not bad, "\n".join(bad[:40])
    assert counts["clean"] > 300 and counts["correct"] > 20  # the generator really produced both kinds
    assert slowest.seconds < 5.0, slowest.case.id


def test_console_entry_has_no_traceback(tmp_path):
    """The installed entry point itself (a subprocess): a FIFO and a non-UTF-8 config end in one line, exit 2."""
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    latin = tmp_path / "latin1.json"
    latin.write_bytes(b'{"model_type": "llama", "_name_or_path": "caf\xe9"}')
    code = ("import sys; from fp4offload.cli import main; sys.argv[0] = 'fp4offload'; "
            "rc1 = main(['plan', '--gpu', 'h100-80gb', '--model', sys.argv[1]]); "
            "rc2 = main(['inspect', sys.argv[2]]); sys.exit(10 * rc1 + rc2)")
    p = subprocess.run([sys.executable, "-c", code, str(fifo), str(latin)], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 22 and "Traceback" not in p.stderr, p.stderr
    assert len(lines) == 2 and "--model" in lines[0] and "FIFO" in lines[0] and str(latin) in lines[1], lines
