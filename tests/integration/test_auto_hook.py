"""The zero-code block: ``fp4offload-auto.pth`` routes a plain ``deepspeed.initialize`` through fp4offload.

The launcher tests start tests/scripts/plain_deepspeed_script.py, a script that never imports fp4offload, with the
real launchers (``deepspeed``, ``torchrun``, ``accelerate launch``, the Trainer's ``--deepspeed``) on the
CPU accelerator; the block in its JSON is applied by the start-up hook alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.dist import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "plain_deepspeed_script.py"
PACKED_B_PER_PARAM = 1.1328125  # m NVFP4 + sqrt(v) ufp4, one fp32 scale per 1024 each (docs/design.md 3.10)


def _python(code: str, **env) -> dict:
    """Run ``code`` in a fresh interpreter (site-packages as installed); it prints one JSON object."""
    full = {k: v for k, v in os.environ.items() if k != "FP4OFFLOAD_AUTO"}
    full.update(DS_ACCELERATOR="cpu", **env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120,
                         cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_STARTUP = """
import json, sys
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "deepspeed", "fp4offload", "numpy",
                                                          "_fp4offload_auto"))
print(json.dumps({"heavy": heavy, "finders": [getattr(f, "__name__", type(f).__name__) for f in sys.meta_path]}))
"""


def test_startup_hook_is_installed_and_imports_nothing():
    r = _python(_STARTUP)
    assert r["finders"][0] == "Fp4offloadAutoFinder", "fp4offload-auto.pth did not run: the install lacks it"
    assert r["heavy"] == [], r["heavy"]  # not torch, deepspeed, numpy, fp4offload, not even the hook's module


@pytest.mark.parametrize("off", ["0", "off", "False", " no ", "None "])
def test_fp4offload_auto_off_leaves_the_import_system_alone(off):
    r = _python(_STARTUP, FP4OFFLOAD_AUTO=off)
    assert "Fp4offloadAutoFinder" not in r["finders"] and r["heavy"] == []


_IMPORT = """
import importlib.util, json, sys
importlib.util.find_spec("deepspeed")  # how Accelerate and transformers probe for it, before importing
import deepspeed
from deepspeed import initialize
h = sys.modules["_fp4offload_auto"]
real = getattr(deepspeed.initialize, "__wrapped__", None)
out = {"state": h.state, "wrapped": getattr(deepspeed.initialize, "_fp4offload_hook", False),
       "from_import": initialize is deepspeed.initialize, "finder_left": h.waiting(),
       "real_is_deepspeeds": getattr(real, "__module__", "") == "deepspeed",
       "fp4offload_imported": "fp4offload" in sys.modules}
import fp4offload.deepspeed as fds
fds.install()  # by hand, on top of the hook: must not wrap the wrapper
from fp4offload._deepspeed import engine as ids
out["install_original_is_real"] = ids._original_initialize() is real
out["auto"] = ids.auto_status()
fds.uninstall()
out["after_uninstall_is_wrapper"] = getattr(deepspeed.initialize, "_fp4offload_hook", False)
print(json.dumps(out))
"""


def test_importing_deepspeed_wraps_initialize_once_after_a_find_spec_probe():
    r = _python(_IMPORT)
    assert r["state"] == "patched" and r["wrapped"] and r["from_import"] and r["real_is_deepspeeds"]
    assert not r["finder_left"]
    assert not r["fp4offload_imported"]  # only the first initialize call imports fp4offload
    assert r["install_original_is_real"]
    assert r["auto"]["active"] and r["auto"]["state"] == "patched"
    assert r["after_uninstall_is_wrapper"]


def test_config_without_the_block_reaches_deepspeed_untouched(monkeypatch):
    import deepspeed

    if not getattr(deepspeed.initialize, "_fp4offload_hook", False):
        pytest.fail("deepspeed.initialize in this process is not the start-up hook's wrapper")
    seen = {}

    def spy(**kwargs):
        seen.update(kwargs)
        return "engine", None, None, None

    monkeypatch.setattr(deepspeed.initialize, "__wrapped__", spy)
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    model = object()
    assert deepspeed.initialize(model=model, config=cfg)[0] == "engine"
    assert seen["config"] is cfg and cfg == {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    assert seen["model"] is model and seen["optimizer"] is None


@pytest.mark.slow  # three doctor processes: ~13 s
def test_doctor_reports_the_hook():
    env = {k: v for k, v in os.environ.items() if k != "FP4OFFLOAD_AUTO"}
    for value, want in ((None, "active, patched"), ("0", "inactive, disabled"), ("of", None)):
        e = dict(env, DS_ACCELERATOR="cpu", **({"FP4OFFLOAD_AUTO": value} if value else {}))
        out = subprocess.run([sys.executable, "-m", "fp4offload.cli", "doctor", "--json"], capture_output=True,
                             text=True, env=e, timeout=300)
        if want is None:  # a typo is refused in one line naming the variable, not silently taken as on
            lines = out.stderr.strip().splitlines()
            assert out.returncode == 2 and len(lines) == 1 and "FP4OFFLOAD_AUTO='of'" in lines[0], out.stderr
            continue
        assert out.returncode == 0, out.stderr[-2000:]
        auto = json.loads(out.stdout)["deepspeed"]["auto"]
        assert f"{'active' if auto['active'] else 'inactive'}, {auto['state']}" == want


# ------------------------------------------------------------------------------------------------
# the real launchers


def _ds_config(tmp_path: Path, *, trainer: bool = False) -> Path:
    cfg = json.loads((ROOT / "configs" / "deepspeed_zero2_offload_cpu.json").read_text())
    cfg["fp4offload"] = {"optimizer_states": cfg["fp4offload"]["optimizer_states"]}
    cfg["zero_optimization"]["offload_optimizer"]["pin_memory"] = False
    cfg["train_micro_batch_size_per_gpu"] = 2
    if trainer:  # the Trainer fills these from its own arguments
        cfg.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto", gradient_clipping="auto")
        cfg["optimizer"]["params"] = {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}
    path = tmp_path / ("ds_trainer.json" if trainer else "ds.json")
    path.write_text(json.dumps(cfg))
    return path


def _launch(argv: list[str], port: int, tmp_path: Path, out: Path, timeout: float = 300, **env) -> dict:
    """Run a launcher command line as its own process group; kill the whole group if it outlives ``timeout``."""
    full = {k: v for k, v in os.environ.items() if k != "FP4OFFLOAD_AUTO"}
    full.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **env)
    full.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/fp4offload/torch_extensions"))
    log = tmp_path / f"{out.stem}.log"
    with open(log, "w") as f:
        p = subprocess.Popen(argv, cwd=str(ROOT), env=full, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            # DeepSpeed's CPU shared-memory all-reduce names its /dev/shm files by uid, address and port
            for shm in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
                shm.unlink(missing_ok=True)
    if p.returncode != 0 or not out.exists():
        raise AssertionError(f"{argv[0]} exited {p.returncode}:\n" + log.read_text()[-6000:])
    return json.loads(out.read_text())


def _torchrun_trainer(tmp_path: Path, config: Path, out: Path, *, ranks: int, steps: int) -> dict:
    """The Hugging Face Trainer under torchrun with ``--deepspeed config`` (the script's trainer mode)."""
    port = free_port()
    return _launch([_which("torchrun"), "--nproc_per_node", str(ranks), "--master_port", str(port), str(SCRIPT),
                    "--mode", "trainer", "--out", str(out), "--output_dir", str(tmp_path / "o"), "--deepspeed",
                    str(config), "--max_steps", str(steps), "--per_device_train_batch_size", "2", "--bf16", "true",
                    "--use_cpu", "true", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
                    "--dataloader_num_workers", "0", "--learning_rate", "3e-4"], port, tmp_path, out)


def _which(name: str) -> str:
    path = Path(sys.executable).with_name(name)
    return str(path) if path.exists() else name


def _assert_block(r: dict) -> None:
    assert r["inner"] == "FP4AdamW" and r["has_block"]
    assert not r["fp4offload_imported_before_initialize"]
    assert abs(r["state_B_per_param"] - PACKED_B_PER_PARAM) < 0.01, r["state_B_per_param"]
    assert all(x == x for x in r["losses"]) and r["losses"][-1] < r["losses"][0]


@pytest.mark.slow
@pytest.mark.distributed
def test_deepspeed_launcher_two_ranks_gets_the_block_and_auto_off_is_plain_deepspeed(tmp_path):
    cfg = _ds_config(tmp_path)
    args = [str(SCRIPT), "--mode", "engine", "--steps", "4", "--deepspeed_config", str(cfg)]
    port = free_port()
    on = _launch([_which("deepspeed"), "--num_gpus", "2", "--master_port", str(port), *args, "--out",
                  str(tmp_path / "on.json")], port, tmp_path, tmp_path / "on.json")
    _assert_block(on)
    assert on["world_size"] == 2
    port = free_port()
    off = _launch([_which("torchrun"), "--nproc_per_node", "1", "--master_port", str(port), *args, "--out",
                   str(tmp_path / "off.json")], port, tmp_path, tmp_path / "off.json", FP4OFFLOAD_AUTO="0")
    assert off["inner"] == "DeepSpeedCPUAdam" and not off["has_block"] and not off["fp4offload_imported_after"]
    assert off["state_B_per_param"] == 8.0  # fp32 m and v
    # the optimizer's state bytes per parameter drop as the block promises (8 / 1.13)
    assert off["state_B_per_param"] / on["state_B_per_param"] > 7.0
    # same model, same first batch on rank 0: the first loss is the same number before any step
    assert abs(on["losses"][0] - off["losses"][0]) < 1e-6


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_with_auto_train_the_block_rank_0_chose(tmp_path):
    cfg = json.loads(_ds_config(tmp_path).read_text())
    cfg["fp4offload"] = {"auto": True}
    path = tmp_path / "ds_auto.json"
    path.write_text(json.dumps(cfg))
    port = free_port()
    out = tmp_path / "auto.json"
    r = _launch([_which("deepspeed"), "--num_gpus", "2", "--master_port", str(port), str(SCRIPT), "--mode", "engine",
                 "--steps", "4", "--deepspeed_config", str(path), "--out", str(out)], port, tmp_path, out)
    _assert_block(r)
    assert r["world_size"] == 2
    lines = [x for x in (tmp_path / "auto.log").read_text().splitlines() if "fp4offload: auto: chose" in x]
    assert len(lines) == 1 and "fp32 master, NVFP4 states in host RAM" in lines[0], lines  # one line, rank 0's


@pytest.mark.slow
@pytest.mark.distributed
def test_hf_trainer_on_two_ranks_trains_with_the_documented_auto_form(tmp_path):
    """The Trainer (through Accelerate) fills every "auto" string itself, so the documented spelling of automatic
    selection is the object form: it must pass the Trainer on 2 ranks, choose once on rank 0 and say so, and
    say once that the optimizer was replaced."""
    cfg = json.loads(_ds_config(tmp_path, trainer=True).read_text())
    cfg["fp4offload"] = {"auto": True}
    path = tmp_path / "ds_trainer_auto.json"
    path.write_text(json.dumps(cfg))
    r = _torchrun_trainer(tmp_path, path, tmp_path / "trainer_auto.json", ranks=2, steps=3)
    assert r["inner"] == "FP4AdamW" and r["has_block"] and r["world_size"] == 2
    assert len(r["losses"]) == 3
    log = (tmp_path / "trainer_auto.log").read_text().splitlines()
    chose = [x for x in log if "fp4offload: auto: chose" in x]
    assert len(chose) == 1 and "fp32 master, NVFP4 states in host RAM" in chose[0], chose
    replaced = [x for x in log if "fp4offload: replaced " in x]  # DeepSpeed's AdamW, from the JSON
    assert len(replaced) == 1 and "FP4AdamW" in replaced[0], replaced


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_hf_trainer_deepspeed_flag_gets_the_block_with_no_fp4offload_import(tmp_path):
    cfg = _ds_config(tmp_path, trainer=True)
    r = _torchrun_trainer(tmp_path, cfg, tmp_path / "trainer.json", ranks=1, steps=4)
    assert r["inner"] == "FP4AdamW" and r["has_block"] and not r["fp4offload_imported_before_initialize"]
    assert abs(r["state_B_per_param"] - PACKED_B_PER_PARAM) < 0.01
    assert len(r["losses"]) == 4


@pytest.mark.slow
@pytest.mark.distributed
def test_accelerate_launch_with_a_deepspeed_config_file_gets_the_block(tmp_path):
    """The documented automatic form passes Accelerate's DeepSpeed plugin too, and chooses the fp32 master here."""
    cfg = _ds_config(tmp_path)
    doc = json.loads(cfg.read_text())
    doc["fp4offload"] = {"auto": True}
    cfg.write_text(json.dumps(doc))
    acc = tmp_path / "accelerate.yaml"
    acc.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
                   f"  deepspeed_config_file: {cfg}\n  zero3_init_flag: false\nnum_machines: 1\nnum_processes: 1\n"
                   "machine_rank: 0\nuse_cpu: true\n")
    out = tmp_path / "acc.json"
    port = free_port()
    r = _launch([_which("accelerate"), "launch", "--config_file", str(acc), "--main_process_port", str(port),
                 str(SCRIPT), "--mode", "accelerate", "--steps", "4", "--out", str(out)], port, tmp_path, out)
    _assert_block(r)
    chose = [x for x in (tmp_path / "acc.log").read_text().splitlines() if "fp4offload: auto: chose" in x]
    assert len(chose) == 1 and "fp32 master, NVFP4 states in host RAM" in chose[0], chose


def test_the_pth_line_and_the_switch_parser_agree_on_the_off_words():
    from fp4offload._switches import OFF_WORDS

    line = (ROOT / "fp4offload-auto.pth").read_text()
    assert line.count("\n") == 1 and line.startswith("import ")  # site runs one line at a time
    assert repr(OFF_WORDS).replace("'", '"') in line
