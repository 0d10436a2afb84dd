"""Under a launcher, an fp4offload error is one line for the job, not a traceback on every rank
(fp4offload/_oneline.py)."""

from __future__ import annotations

import sys

import pytest
from helpers.dist import free_port, run_group

SCRIPT = """
import fp4offload
fp4offload.ActivationPolicy(format="int3")   # every rank stops on the same ConfigError
"""


def _run(tmp_path, monitor_s: float = 0.1, **env):
    """torchrun over SCRIPT on 2 ranks; ``monitor_s``: how often torchrun looks at its ranks (at the first look after
    one failed it stops the others, so a rank slower to start may be stopped before it reaches the error)."""
    script = tmp_path / "bad_config.py"
    script.write_text(SCRIPT)
    log = tmp_path / "log.txt"
    rc = run_group([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                    str(free_port()), "--monitor-interval", str(monitor_s), str(script)], log, 120, cwd=tmp_path,
                   TMPDIR=str(tmp_path), **env)
    return rc, log.read_text()


@pytest.mark.distributed
def test_a_config_error_on_every_rank_is_one_line(tmp_path):
    rc, out = _run(tmp_path)
    assert rc != 0
    lines = [x for x in out.splitlines() if "fp4offload: ConfigError:" in x]
    assert len(lines) == 1 and "format='int3'" in lines[0], out[-3000:]
    assert "raise ConfigError" not in out and "FP4OFFLOAD_TRACEBACK=1" in out  # no rank's traceback


@pytest.mark.distributed
def test_the_switch_brings_every_ranks_traceback_back(tmp_path):
    rc, out = _run(tmp_path, monitor_s=5, FP4OFFLOAD_TRACEBACK="1")  # both ranks reach the error first
    assert rc != 0 and out.count("fp4offload.errors.ConfigError") >= 2, out[-3000:]
