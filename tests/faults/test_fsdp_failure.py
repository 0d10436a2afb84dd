"""A rank that fails does not leave the others waiting forever under fp4offload.fsdp.

The process group is created with a short timeout (5 s); one rank fails in the middle of training
(raises, or stops answering); the other must leave its next collective with an error that says what
failed and what to look for, within that timeout, rather than hang.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

from helpers.dist import RanksFailed, run_ranks

pytestmark = pytest.mark.distributed

PG_TIMEOUT = 5.0


def _worker(rank, world, tmp, mode):
    import fp4offload.fsdp as ff
    from helpers.fsdp import OddModel

    policy = ff.Policy(weights={"keep_bf16": []}, optimizer_states=None)
    model = ff.apply(OddModel(), policy)
    opt = ff.optimizer(model, policy, lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    for step in range(4):
        if rank == 1 and step == 2:
            if mode == "raise":
                raise RuntimeError("deliberate failure on rank 1")
            time.sleep(60)  # stops answering, process alive
        tok = torch.randint(0, 37, (2, 9), generator=g)
        loss = nn.functional.cross_entropy(model(tok[:, :-1]).float().reshape(-1, 37), tok[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return "finished"


@pytest.mark.parametrize("mode", ["raise", "hang"])
@pytest.mark.slow
def test_failed_rank_does_not_hang_the_others(mode):
    t0 = time.monotonic()
    with pytest.raises(RanksFailed) as e:
        run_ranks(_worker, 2, args=(mode,), timeout=90, pg_timeout=PG_TIMEOUT, grace=5)
    elapsed = time.monotonic() - t0
    errors = e.value.errors
    assert 0 not in e.value.results  # rank 0 did not finish training as if nothing happened
    if mode == "raise":
        assert "deliberate failure on rank 1" in errors[1]
    else:
        assert "killed" in errors[1]  # it never answered; run_ranks ended it after the grace period
    msg = errors[0]
    assert "CollectiveError" in msg and "fp4offload.fsdp" in msg, msg
    assert "Another rank most likely failed" in msg and "timeout" in msg, msg
    assert elapsed < 75, elapsed  # spawn + import + the 5 s collective timeout, not the 60 s sleep
