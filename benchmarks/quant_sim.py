"""AdamW with its moments stored through a 4-bit codec between steps, in plain torch ops: which state's rounding
costs accuracy, and what a rounding rule does, before it goes into the kernels.

The codec is FP4AdamW's layout (docs/design.md 3.3, 3.7): one fp32 scale per 1024-element chunk, one E4M3 scale
per block of 16, and E2M1 codes (m, signed) or ufp4 codes (u = sqrt(v), unsigned, no zero). The arithmetic is
fp32 AdamW (torch's formulas). Each state is stored with one of these rules:

- ``none``: kept in fp32 (not quantized);
- ``rn``: round to nearest;
- ``sr``: stochastic rounding (up with probability equal to the position between the two grid neighbours);
- ``dither``: subtractive dither. The same codes as ``sr`` (a code is ``floor(t + r)`` for the position ``t`` on
  the code grid and a uniform ``r``), but the decoder, which can replay ``r`` from the seed, returns the
  position ``k + 1/2 - r`` instead of the grid point ``k``: the stored value is then off by a uniform error
  of half the variance of stochastic rounding's, independent of the value, and need not lie on the grid;
- ``srv`` (unsigned grids only): stochastic rounding of u = sqrt(v) that is unbiased in v, not u: up with
  probability ``(u^2 - lo^2) / (hi^2 - lo^2)`` between the grid neighbours lo and hi.

This is a model of the kernels for ablations, not a second implementation: the block scales follow the
codec's rules, but random bits come from torch's generator.
"""

from __future__ import annotations

import math

import torch

from fp4offload.formats import bits as B

CHUNK, BLOCK = 1024, 16
RULES = ("none", "rn", "sr", "dither", "srv")


#: unsigned grids of sqrt(v): (binades, codes per binade, base). 4 bits: e3m1 (ufp4), e2m2 (ue2m2), e1m3;
#: 2 bits (4 codes, one per binade, no mantissa): l2b2 (1/8 .. 1, a factor 2 apart), l2b4 (1/64 .. 1, 4 apart)
GRIDS = {"e3m1": (8, 2, 2), "e2m2": (4, 4, 2), "e1m3": (2, 8, 2), "l2b2": (4, 1, 2), "l2b4": (4, 1, 4)}
#: signed grids of m: e2m1 (4 bits, FP4AdamW's), s2t (2 bits: -1, 0, +1 times the block scale, a code left over)
M_GRIDS = ("e2m1", "s2t")


def codes(grid: str) -> int:
    """How many codes an unsigned grid has (16: 4 bits, 4: 2 bits)."""
    nb, M, _ = GRIDS[grid]
    return nb * M


def grid_max(grid: str) -> float:
    """The largest value of an unsigned grid (its top binade is [1, base), M codes apart)."""
    _, M, base = GRIDS[grid]
    return 1.0 + (base - 1.0) * (M - 1) / M


def _position(a: torch.Tensor, unsigned: bool, grid: str = "e3m1") -> torch.Tensor:
    """The piecewise-linear position of magnitudes `a` on the code grid (grid point k at position k), clamped to
    the grid's ends. E2M1: 0, 0.5, ..., 2 at 0-4, then steps of 1 to 4 and of 2 to 6. Unsigned grids (no zero)
    with nb binades of M codes, base b: the binade [b^e, b^(e+1)) holds (1 + (b-1) j/M) b^e at position
    M(e + nb - 1) + j, e = 1-nb..0; ufp4 is e3m1 (nb 8, M 2, b 2)."""
    if unsigned:
        nb, M, base = GRIDS[grid]
        a = a.clamp(min=float(base) ** (1 - nb), max=grid_max(grid))
        _, exp2 = torch.frexp(a)  # a in [2^(exp2-1), 2^exp2)
        e = torch.div(exp2 - 1, int(math.log2(base)), rounding_mode="floor").float()  # a in [base^e, base^(e+1))
        lo = torch.pow(float(base), e)
        return M * (e + nb - 1) + M * (a - lo) / (lo * (base - 1))
    if grid == "s2t":
        return a.clamp(max=1.0)
    a = a.clamp(max=6.0)
    return torch.where(a < 2, 2 * a, torch.where(a < 4, a + 2, 0.5 * a + 4))


def _value(t: torch.Tensor, unsigned: bool, grid: str = "e3m1") -> torch.Tensor:
    """Inverse of _position, extended linearly past the ends (a dithered position may lie half a step outside)."""
    if unsigned:
        nb, M, base = GRIDS[grid]
        k = torch.floor(t / M).clamp(0, nb - 1)
        lo = torch.pow(float(base), k - nb + 1)
        return lo * (1.0 + (base - 1) * (t - M * k) / M)
    if grid == "s2t":
        return t
    return torch.where(t < 4, t / 2, torch.where(t < 6, t - 2, 2 * t - 8))


def roundtrip(x: torch.Tensor, rule: str, unsigned: bool, gen: torch.Generator, grid: str = "e3m1") -> torch.Tensor:
    """x (flat fp32) stored with `rule` and read back."""
    if rule == "none":
        return x
    n = x.numel()
    pad = (-n) % CHUNK
    X = torch.nn.functional.pad(x, (0, pad)).view(-1, CHUNK // BLOCK, BLOCK)
    emax = grid_max(grid) if unsigned else (1.0 if grid == "s2t" else 6.0)
    top = codes(grid) - 1 if unsigned else (1 if grid == "s2t" else 7)
    amax_c = X.abs().amax(dim=(1, 2), keepdim=True)
    s_enc = torch.where(amax_c > 0, emax * 448.0 / amax_c.clamp(min=1e-38), torch.zeros_like(amax_c))
    s_dec = torch.where(s_enc > 0, 1.0 / s_enc.clamp(min=1e-38), torch.zeros_like(s_enc))
    amax_b = X.abs().amax(dim=2, keepdim=True)
    sb = B.e4m3_table()[B.e4m3_encode((amax_b / emax * s_enc).clamp(max=448.0)).long()]
    step = sb * s_dec  # the value of grid unit 1 in this block
    y = torch.where(step > 0, X / step.clamp(min=1e-38), torch.zeros_like(X))
    t = _position(y.abs(), unsigned, grid)
    if rule == "rn":
        q = _value(torch.floor(t + 0.5), unsigned, grid)
    elif rule == "srv":
        if not unsigned:
            raise ValueError("rule 'srv' is for sqrt(v) on an unsigned grid")
        k = torch.floor(t).clamp(max=top)
        lo, hi = _value(k, True, grid), _value((k + 1).clamp(max=top), True, grid)
        a = y.abs().clamp(min=lo)
        p_up = torch.where(hi > lo, (a * a - lo * lo) / (hi * hi - lo * lo), torch.zeros_like(a))
        q = torch.where(torch.rand(t.shape, generator=gen) < p_up, hi, lo)
    else:
        r = torch.rand(t.shape, generator=gen)
        k = torch.floor(t + r).clamp(max=top)
        q = _value(k, unsigned, grid) if rule == "sr" else _value(k + 0.5 - r, unsigned, grid)
    q = q if unsigned else torch.copysign(q, y)
    out = (q * step).flatten()[:n]
    return out.clamp(min=0) if unsigned else out


class QuantSimAdamW(torch.optim.Optimizer):
    """torch AdamW (decoupled weight decay) whose m and sqrt(v) are stored with `m_rule` / `v_rule` after every
    step (see the module docstring). Tensors under 4096 elements keep fp32 states, as in FP4AdamW."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 m_rule: str = "sr", v_rule: str = "rn", seed: int = 0, min_numel: int = 4096,
                 v_grid: str = "e3m1", m_grid: str = "e2m1"):
        if m_rule not in RULES or v_rule not in RULES or v_grid not in GRIDS or m_grid not in M_GRIDS:
            raise ValueError(f"rules must be in {RULES}, v_grid in {tuple(GRIDS)} and m_grid in {M_GRIDS}, got "
                             f"m_rule={m_rule!r}, v_rule={v_rule!r}, v_grid={v_grid!r}, m_grid={m_grid!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.m_rule, self.v_rule, self.min_numel, self.v_grid = m_rule, v_rule, min_numel, v_grid
        self.m_grid = m_grid
        self.gen = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["m"] = torch.zeros(p.numel())
                    st["v"] = torch.zeros(p.numel())
                st["step"] += 1
                t = st["step"]
                g = p.grad.detach().float().flatten()
                m = st["m"].mul(b1).add_(g, alpha=1 - b1)
                v = st["v"].mul(b2).addcmul_(g, g, value=1 - b2)
                w = p.detach().float().flatten()
                w.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(group["eps"])
                w.addcdiv_(m, denom, value=-group["lr"] / (1 - b1 ** t))
                p.copy_(w.view_as(p))
                quantize = p.numel() >= self.min_numel
                st["m"] = roundtrip(m, self.m_rule, False, self.gen, self.m_grid) if quantize else m
                if quantize and self.v_rule != "none":
                    u = roundtrip(v.sqrt(), self.v_rule, True, self.gen, self.v_grid)
                    st["v"] = u * u
                else:
                    st["v"] = v


def ema_scatter(grid: str, sigma: float, *, steps: int = 3000, n: int = 16 * 1024, seed: int = 0,
                rule: str = "sr") -> dict:
    """Adam's second moment alone (beta2 0.999) for n elements with gradients N(0, s^2), s log-normal with
    log-spread `sigma` (0: every element alike), stored as sqrt(v) on `grid` with `rule` after every step,
    against the fp32 average of the same gradients. Returns the median and the log-spread of stored/true v and
    the mean of sqrt(true/stored), the factor on the update's size."""
    g = torch.Generator().manual_seed(seed)
    rng = torch.Generator().manual_seed(seed + 1)
    scale = torch.exp(torch.randn(n, generator=g) * sigma)
    v, vt = torch.zeros(n), torch.zeros(n)
    for _ in range(steps):
        gr = torch.randn(n, generator=g) * scale
        v = 0.999 * v + 0.001 * gr * gr
        vt = 0.999 * vt + 0.001 * gr * gr
        u = roundtrip(v.sqrt(), rule, True, rng, grid)
        v = u * u
    r = v / vt
    return {"median": float(r.median()), "log_std": float(r.log().std()), "update": float((1 / r).sqrt().mean())}


if __name__ == "__main__":  # the scatter of a stochastically rounded sqrt(v), per grid (docs/numerics.md)
    print("| grid | rule | log-spread of the gradient scales | stored/true v: median | log-spread "
          "| mean update factor |")
    print("|---|---|---|---|---|---|")
    for sig in (0.0, 0.5):
        for grid, rule in (("e3m1", "sr"), ("e2m2", "sr"), ("e3m1", "srv")):
            r = ema_scatter(grid, sig, rule=rule)
            print(f"| {grid} | {rule} | {sig} | {r['median']:.3f} | {r['log_std']:.3f} | {r['update']:.3f} |")
