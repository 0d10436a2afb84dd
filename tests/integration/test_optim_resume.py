"""Resume: train, save, kill the process, load in a new one, continue: the losses equal an uninterrupted run's."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

WORKER = textwrap.dedent('''
    import json, os, signal, sys
    import torch
    from fp4offload import FP4AdamW
    from fp4offload._optim import StateFormat
    mode, path, n1, n2 = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    opt = FP4AdamW(model.parameters(), lr=3e-3, state_format=StateFormat(m_rounding="stochastic", seed=11))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)

    def step(i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(32, 64, generator=g)
        loss = (model(x) - x.flip(1)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        return loss.item()

    if mode == "first":
        for i in range(n1):
            step(i)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, path)
        os.kill(os.getpid(), signal.SIGKILL)  # no clean exit
    elif mode == "second":
        ck = torch.load(path, weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        print(json.dumps([step(i) for i in range(n1, n1 + n2)]))
    else:
        losses = [step(i) for i in range(n1 + n2)]
        print(json.dumps(losses[n1:]))
''')


def _run(args, tmp_path):
    return subprocess.run([sys.executable, "-c", WORKER, *args], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])


@pytest.mark.slow
def test_resume_in_new_process_repeats_losses_exactly(tmp_path):
    ck = str(tmp_path / "ck.pt")
    first = _run(["first", ck, "5", "4"], tmp_path)
    assert first.returncode == -9, first.stderr  # killed after saving
    second = _run(["second", ck, "5", "4"], tmp_path)
    assert second.returncode == 0, second.stderr
    whole = _run(["whole", ck, "5", "4"], tmp_path)
    assert whole.returncode == 0, whole.stderr
    resumed, straight = json.loads(second.stdout), json.loads(whole.stdout)
    assert len(resumed) == 4 and resumed == straight
