"""benchmarks/node_table.py: the step-time model of the node table."""

from __future__ import annotations

import pytest

from benchmarks import node_table as nt


def test_a_core_pays_the_larger_of_compute_and_its_share_of_the_bandwidth():
    assert nt.predict(100, 500.0, 1.0, 20.0) == (1.0, 4.0)  # 5 GB/s per core: 20 B take 4 ns
    x = {"ns": {"avx512": (1.0, 0.5), "avx2": (1.0, 0.5)}, "fp4_bytes": 18.0, "ds_bytes": 28.0,
         "fp4_arm_insns": 40.0, "ds_arm_insns": 8.0}
    rows = nt.table(x, 4.0, 2.5, [("bw-starved", 100, 100.0, "avx512"), ("compute-starved", 1, 1000.0, "neon")])
    starved, fast = rows.splitlines()[2:]
    # memory bound both: the ratio is the bytes' ratio, 28 / 18
    assert starved.endswith(f"| {28 / 18:.2f}x |") and "memory" in starved
    # compute bound both: 4 ns (40 / (4 x 2.5)) against 0.8 ns
    assert fast.endswith(f"| {0.8 / 4.0:.2f}x |") and "compute" in fast


def test_a_node_flag_must_name_its_path():
    with pytest.raises(SystemExit):
        nt.main(["--node", "box:64:300"])
