"""FP4AdamW behaves as a torch optimizer: hooks, state-dict round trips, deepcopy / pickle, tensor lr, and clear
errors for torch AdamW options it does not have (everything torch's optimizer tests check that does not compare
exact AdamW numbers; the upstream run is described in the README's "Conformance" notes)."""

import copy
import itertools
import pickle

import pytest
import torch
from torch.optim.lr_scheduler import StepLR

from fp4offload import FP4AdamW
from fp4offload._optim import NvmeOptions, StateFormat, StepOptions
from fp4offload.errors import ConfigError
from fp4offload._optim.checks import UNSUPPORTED


def _params(seed=0, shapes=((48, 40), (40,), (3, 7))):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def _grads(params, i):
    g = torch.Generator().manual_seed(1000 + i)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _bits(params):
    return [p.detach().clone() for p in params]


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _sd_equal(a, b):
    """Two state dicts hold the same keys and values (tensors bit for bit)."""
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict))
    if isinstance(a, dict):
        assert set(a) == set(b), (set(a) ^ set(b))
        for k in a:
            _sd_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _sd_equal(x, y)
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert a == b


def _run(opt, params, steps, start=0):
    for i in range(start, start + steps):
        _grads(params, i)
        opt.step()


# ---- hooks ----------------------------------------------------------------------------------------------


def test_state_dict_pre_and_post_hooks_run_in_order_and_post_may_replace():
    ps = _params()
    opt = FP4AdamW(ps, state_format=StateFormat(min_numel=1))
    _run(opt, ps, 1)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: (calls.append("pre"), o.state.__setitem__("note", 7)))

    def post(o, sd):
        calls.append("post")
        assert sd["state"]["note"] == 7  # non-tensor state keys travel as they are, as in torch
        return {**sd, "by_post_hook": True}

    opt.register_state_dict_post_hook(post)
    sd = opt.state_dict()
    assert calls == ["pre", "post"] and sd["by_post_hook"] is True
    assert set(k for k in sd["state"] if isinstance(k, int)) == {0, 1, 2}


def test_load_state_dict_pre_hook_rewrites_and_post_hook_sees_loaded_state():
    ps = _params()
    opt = FP4AdamW(ps, lr=1e-3, state_format=StateFormat(min_numel=1))
    _run(opt, ps, 2)
    sd = opt.state_dict()
    fresh = FP4AdamW(_params(), lr=1e-3, state_format=StateFormat(min_numel=1))
    seen = []
    fresh.register_load_state_dict_pre_hook(lambda o, d: d["param_groups"][0].__setitem__("lr", 5e-4))

    def replace(o, d):  # prepended: runs first, returns a new dict the later hook then edits
        d = copy.deepcopy(d)
        d["param_groups"][0]["eps"] = 1e-6
        return d

    fresh.register_load_state_dict_pre_hook(replace, prepend=True)
    fresh.register_load_state_dict_post_hook(lambda o: seen.append(int(o.state[o.param_groups[0]["params"][0]]
                                                                         ["step"])))
    fresh.load_state_dict(sd)
    assert fresh.param_groups[0]["lr"] == 5e-4 and fresh.param_groups[0]["eps"] == 1e-6
    assert seen == [2]  # the post-hook runs after the entries are in
    assert sd["param_groups"][0]["lr"] == 1e-3  # the caller's dict is not changed


def test_step_pre_and_post_hooks():
    ps = _params()
    opt = FP4AdamW(ps, state_format=StateFormat(min_numel=1))
    log = []
    h1 = opt.register_step_pre_hook(lambda o, a, k: log.append(("pre", float(ps[0].detach()[0, 0]))))
    h2 = opt.register_step_post_hook(lambda o, a, k: log.append(("post", float(ps[0].detach()[0, 0]))))
    before = float(ps[0].detach()[0, 0])
    _run(opt, ps, 1)
    assert [t for t, _ in log] == ["pre", "post"] and log[0][1] == before and log[1][1] != before
    h1.remove()
    h2.remove()
    _run(opt, ps, 1, start=1)
    assert len(log) == 2


# ---- state dict round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("min_numel,state_device", [(1, "same"), (4096, "same"), (1, "nvme")])
def test_save_load_round_trip_continues_bit_for_bit(tmp_path, min_numel, state_device):
    kw = dict(lr=2e-3, state_format=StateFormat(min_numel=min_numel, seed=3), state_device=state_device)
    if state_device == "nvme":
        kw["nvme_path"], kw["nvme"] = tmp_path / "nvme", NvmeOptions(io="threads")
        kw["nvme_path"].mkdir()
    a = _params()
    opt_a = FP4AdamW(a, **kw)
    _run(opt_a, a, 3)
    torch.save(opt_a.state_dict(), tmp_path / "opt.pt")
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = FP4AdamW(b, **kw)
    saved = torch.load(tmp_path / "opt.pt", weights_only=True)
    kept = copy.deepcopy(saved)
    opt_b.load_state_dict(saved)
    _sd_equal(saved, kept)  # load_state_dict does not change its argument
    _sd_equal(opt_b.state_dict(), kept)  # and gives back exactly what was saved (no key added, e.g. differentiable)
    for i in range(3, 6):
        _grads(a, i)
        _grads(b, i)
        opt_a.step()
        opt_b.step()
        _same(a, b)
    _sd_equal(opt_a.state_dict(), opt_b.state_dict())
    opt_a.close()
    opt_b.close()


def test_state_dict_with_a_repeated_group_and_scalar_step():
    ps = _params()
    opt = FP4AdamW(ps, state_format=StateFormat(min_numel=1))
    _run(opt, ps, 2)
    sd = opt.state_dict()
    for e in sd["state"].values():  # an older torch saved step as a number: still loads and continues
        e["step"] = float(e["step"])
    opt.load_state_dict(sd)
    _run(opt, ps, 1, start=2)
    assert int(opt.state[ps[0]]["step"]) == 3
    opt.param_groups.extend(opt.param_groups)  # torch numbers a repeated parameter once
    sd2 = opt.state_dict()
    assert sd2["param_groups"][0]["params"] == sd2["param_groups"][1]["params"] == [0, 1, 2]


# ---- deepcopy and pickle --------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("state_device", ["same", "nvme"])
def test_copies_are_working_optimizers(tmp_path, how, state_device):
    kw = dict(state_format=StateFormat(min_numel=1, seed=5), state_device=state_device,
              step_options=StepOptions(skip_nonfinite=True, metrics_every=7,
                                       backend="reference" if how == "pickle" else "auto"))
    if state_device == "nvme":
        kw["nvme_path"], kw["nvme"] = str(tmp_path), NvmeOptions(io="threads")
    ps = _params()
    opt = FP4AdamW(ps, **kw)
    _run(opt, ps, 2)
    opt.skipped_steps = 4
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    public = {k for k in vars(opt) if not k.startswith("_")}
    assert public == {k for k in vars(twin) if not k.startswith("_")}
    for k in public - {"state", "param_groups", "placement", "stepper", "hooks"}:  # the copy's own rooms
        assert getattr(twin, k) == getattr(opt, k), k
    qs = [p for g in twin.param_groups for p in g["params"]]
    assert all(q is not p for q, p in zip(qs, ps))
    if state_device == "nvme":
        mine, its = opt.placement.store.dir, twin.placement.store.dir
        assert its != mine and its.parent == mine.parent
    for i in range(2, 5):
        _grads(ps, i)
        _grads(qs, i)
        opt.step()
        twin.step()
        _same(ps, qs)
    _sd_equal(opt.state_dict(), twin.state_dict())
    twin.close()
    opt.close()


def test_copy_drops_hooks_like_torch():
    ps = _params()
    opt = FP4AdamW(ps, state_format=StateFormat(min_numel=1))
    opt.register_step_post_hook(lambda o, a, k: None)
    opt.register_state_dict_post_hook(lambda o, sd: None)
    wrapped = opt.load_state_dict
    opt.load_state_dict = lambda sd: wrapped(sd)  # an engine's wrapper around a method stays with the original
    twin = copy.deepcopy(opt)
    assert not twin._optimizer_step_post_hooks and not twin._optimizer_state_dict_post_hooks
    assert "load_state_dict" not in vars(twin) and twin.load_state_dict.__self__ is twin
    ref = copy.deepcopy(torch.optim.AdamW(_params()))
    assert not ref._optimizer_step_post_hooks
    assert "differentiable" not in twin.defaults


# ---- tensor lr ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("min_numel", [1, 4096])
def test_tensor_lr_equals_float_lr_and_works_with_a_scheduler(min_numel):
    lr = float(torch.tensor(3e-3))  # the fp32 value, so both runs use the same number
    a, b = _params(), _params()
    opt_a = FP4AdamW(a, lr=lr, state_format=StateFormat(min_numel=min_numel))
    opt_b = FP4AdamW(b, lr=torch.tensor(lr), state_format=StateFormat(min_numel=min_numel))
    sa, sb = StepLR(opt_a, step_size=2, gamma=0.5), StepLR(opt_b, step_size=2, gamma=0.5)
    for i in range(5):
        _grads(a, i)
        _grads(b, i)
        opt_a.step()
        opt_b.step()
        sa.step()
        sb.step()
        _same(a, b)
    assert torch.is_tensor(opt_b.param_groups[0]["lr"]) and float(opt_b.param_groups[0]["lr"]) == lr * 0.25
    sd = opt_b.state_dict()
    c = [torch.nn.Parameter(p.detach().clone()) for p in b]
    opt_c = FP4AdamW(c, lr=torch.tensor(lr), state_format=StateFormat(min_numel=min_numel))
    opt_c.load_state_dict(copy.deepcopy(sd))
    _grads(b, 9)
    _grads(c, 9)
    opt_b.step()
    opt_c.step()
    _same(b, c)


def test_zero_gradients_without_weight_decay_leave_the_weights():
    ps = _params()
    before = _bits(ps)
    opt = FP4AdamW(ps, weight_decay=0.0, state_format=StateFormat(min_numel=1))
    for p in ps:
        p.grad = torch.zeros_like(p)
    opt.step()
    _same(before, ps)


# ---- options torch AdamW has and FP4AdamW does not ---------------------------------------------------------


def test_unsupported_options_fuzz():
    """Every flag x value, in the constructor and in a param group: off is accepted, on is a ConfigError
    naming the flag and the reason."""
    values = [True, False, None, 1, 0, "yes", torch.tensor(True)]
    n = handled = 0
    for flag, value, where in itertools.product(sorted(UNSUPPORTED), values, ("ctor", "group")):
        n += 1
        off = value is None or value is False or (not torch.is_tensor(value) and value == 0)
        kw = {flag: value}
        try:
            if where == "ctor":
                opt = FP4AdamW(_params(), state_format=StateFormat(min_numel=1), **kw)
            else:
                opt = FP4AdamW([{"params": _params(), **kw}], state_format=StateFormat(min_numel=1))
            _run(opt, [p for g in opt.param_groups for p in g["params"]], 1)
        except ConfigError as e:
            assert not off, (flag, value, where)
            assert e.key == flag and UNSUPPORTED[flag] in str(e)
            handled += 1
            continue
        assert off, (flag, value, where)
        handled += 1
    print(f"fuzz: {n} cases of unsupported torch AdamW options, {handled} accepted-when-off or ConfigError")
    assert handled == n


def test_torch_adamw_state_dicts_load_and_amsgrad_is_refused():
    src = _params()
    t = torch.optim.AdamW(src, lr=1e-3, foreach=False)
    _run(t, src, 2)
    sd = t.state_dict()
    ps = [torch.nn.Parameter(p.detach().clone()) for p in src]
    opt = FP4AdamW(ps, state_format=StateFormat(min_numel=1))
    opt.load_state_dict(sd)
    g = opt.param_groups[0]
    assert not set(UNSUPPORTED) & set(g) and "decoupled_weight_decay" not in g and g["v_format"] == "ue2m2"
    _run(opt, ps, 1, start=2)
    a = torch.optim.AdamW(_params(), amsgrad=True)
    _run(a, [p for g in a.param_groups for p in g["params"]], 1)
    with pytest.raises(ConfigError, match=r"\['amsgrad'\].*max_exp_avg_sq"):
        FP4AdamW(_params(), state_format=StateFormat(min_numel=1)).load_state_dict(a.state_dict())
