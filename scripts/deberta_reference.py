#!/usr/bin/env python3
"""Reference scores of tiny DeBERTa-v2/v3 reward models, from transformers.

Writes tests/fixtures/deberta/<name>/ for two tiny random `DebertaV2ForSequenceClassification`
checkpoints, each saved by transformers' save_pretrained (float32):
  config.json, model.safetensors        the checkpoint
  tokenizer.json, tokenizer_config.json a `DebertaV2Tokenizer` (Unigram, Metaspace) transformers
                                        wrote; its vocabulary is a tiny Unigram model trained
                                        here with the `tokenizers` library (no hub is reachable)
  reference.json                        8 (prompt, response) pairs, the ids and token type ids
                                        `tokenizer(prompts, responses, truncation=True)` gives
                                        them (as a batch: an empty response is the pair
                                        [CLS] p [SEP] [SEP]), and the logits of the batched
                                        padded forward (f32)

  deberta_v3  the DeBERTa-v3 layout (as in deberta-v3-large reward models): relative attention
              with shared keys, c2p + p2c, log-bucketed positions, LayerNorm on the relative
              embeddings, no absolute positions, no token types, one label
  deberta_v2  the other switches: separate pos_key_proj / pos_query_proj, clamped (unbucketed)
              relative positions, absolute position and token type embeddings, embedding_size
              below hidden_size (embed_proj), the convolution after layer 0, two labels

model_max_length is 24 so that some pairs are truncated (longest_first, as transformers does
with truncation=True). reference.json also holds transformers' make_log_bucket_position over a
range of relative positions for the fixture's buckets and for deberta-v3's (256, 512).

Run with the pinned reference venv (transformers 5.24, torch 2.15):
    ~/.cache/main_ppo/bench-venv/bin/python scripts/deberta_reference.py
The Rust tests (src/weights/deberta_tests.rs) read the fixtures; CI does not run this script.
"""
import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers, Regex
from transformers.models.deberta_v2.modeling_deberta_v2 import make_log_bucket_position

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "deberta"
MAX_LEN = 24

CORPUS = [
    "What is the capital of France? The capital of France is Paris.",
    "Explain why the sky is blue. Sunlight scatters off the air, and blue light scatters most.",
    "How do I sort a list in Python? Use sorted(list) or list.sort().",
    "Write a short poem about the sea. The sea is wide, the sea is deep, it rocks the boats to sleep.",
    "What is 6 times 7? It is 42.",
    "Tell me a joke. Why did the chicken cross the road? To get to the other side.",
    "I am sorry, I cannot help with that request.",
    "Please give me a recipe for bread: flour, water, salt and yeast, then bake it.",
    "The quick brown fox jumps over the lazy dog.",
    "A good answer is helpful, honest and harmless; a bad answer is rude.",
]

PAIRS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is 6 times 7?", "42"),
    ("Tell me a joke.", "Why did the chicken cross the road? To get to the other side, of course, and then back again."),
    ("Explain why the sky is blue, in detail, with physics and a little history of the idea.", "Scattering."),
    ("How do I sort a list in Python?", "I am sorry, I cannot help with that request."),
    ("Write a short poem about the sea.", "The sea is wide,\nthe sea is  deep; it rocks the boats to sleep."),
    ("Recipe?", "Flour, water, salt, yeast: bake. Zebra quiche ünïcödé 数字"),
    ("Hi", ""),
]


def train_vocab():
    """A tiny Unigram vocabulary over the corpus, with DeBERTa-v3's special tokens first."""
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence(
        [normalizers.Replace(Regex(r"\s{2,}|[\n\r\t]"), " "), normalizers.NFC(), normalizers.Strip(left=False, right=True)]
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=160, special_tokens=[], unk_token=None, shrinking_factor=0.75)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    learned = json.loads(tok.to_str())["model"]["vocab"]
    specials = [("[PAD]", 0.0), ("[CLS]", 0.0), ("[SEP]", 0.0), ("[UNK]", 0.0)]
    names = {s for s, _ in specials} | {"[MASK]"}
    vocab = specials + [(p, float(s)) for p, s in learned if p not in names] + [("[MASK]", 0.0)]
    return vocab


def configs(vocab_size):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        hidden_act="gelu",
        pooler_hidden_act="gelu",
        pooler_hidden_size=32,
        max_position_embeddings=64,
        pad_token_id=0,
        relative_attention=True,
        pos_att_type=["p2c", "c2p"],
    )
    return {
        "deberta_v3": transformers.DebertaV2Config(
            **common,
            layer_norm_eps=1e-7,
            position_buckets=8,
            max_relative_positions=32,
            share_att_key=True,
            norm_rel_ebd="layer_norm",
            position_biased_input=False,
            type_vocab_size=0,
            num_labels=1,
        ),
        "deberta_v2": transformers.DebertaV2Config(
            **common,
            layer_norm_eps=1e-7,
            max_relative_positions=6,
            share_att_key=False,
            norm_rel_ebd="none",
            position_biased_input=True,
            type_vocab_size=2,
            embedding_size=24,
            conv_kernel_size=3,
            conv_act="gelu",
            num_labels=2,
        ),
    }


def make(name, cfg, vocab):
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = transformers.DebertaV2Tokenizer(vocab=vocab, model_max_length=MAX_LEN)
    tokenizer.save_pretrained(out)
    assert len(tokenizer) == cfg.vocab_size, (len(tokenizer), cfg.vocab_size)
    torch.manual_seed(1234)
    model = transformers.DebertaV2ForSequenceClassification(cfg).eval()
    # Spread the weights beyond the init's 0.02 so that every path carries signal.
    with torch.no_grad():
        g = torch.Generator().manual_seed(99)
        for n, p in model.named_parameters():
            if "LayerNorm.weight" in n:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out, safe_serialization=True)
    # Read back what was written, as a user would.
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    prompts, responses = [p for p, _ in PAIRS], [r for _, r in PAIRS]
    enc = tokenizer(prompts, responses, truncation=True, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
        # Each pair alone (no padding) must give the same numbers.
        # An empty response is left out: tokenizer(p, "") alone encodes a single sequence
        # ([CLS] p [SEP]), while in a batch it is the pair [CLS] p [SEP] [SEP].
        alone = []
        for i, (p, r) in enumerate(PAIRS):
            if r:
                one = tokenizer(p, r, truncation=True, return_tensors="pt")
                alone.append((model(**one).logits[0] - logits[i]).abs().max())
    pad_diff = float(torch.stack(alone).max())
    mask = enc["attention_mask"]
    ids = [row[: int(m.sum())].tolist() for row, m in zip(enc["input_ids"], mask)]
    types = [row[: int(m.sum())].tolist() for row, m in zip(enc["token_type_ids"], mask)]
    untruncated = [len(tokenizer(p, r)["input_ids"]) for p, r in PAIRS]
    buckets = getattr(cfg, "position_buckets", -1)
    rel = torch.arange(-40, 41)
    rel_v3 = torch.arange(-1500, 1501)
    ref = {
        "name": name,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "pairs": [{"prompt": p, "response": r} for p, r in PAIRS],
        "model_max_length": MAX_LEN,
        "untruncated_lengths": untruncated,
        "input_ids": ids,
        "token_type_ids": types,
        "logits": logits.tolist(),
        "padded_vs_alone_max_diff": pad_diff,
        "buckets": {
            "fixture": {
                "bucket_size": buckets,
                "max_position": cfg.max_relative_positions,
                "relative": rel.tolist(),
                "bucket": make_log_bucket_position(rel, buckets, cfg.max_relative_positions).long().tolist()
                if buckets > 0
                else None,
            },
            "v3": {
                "bucket_size": 256,
                "max_position": 512,
                "relative": rel_v3.tolist(),
                "bucket": make_log_bucket_position(rel_v3, 256, 512).long().tolist(),
            },
        },
    }
    (out / "reference.json").write_text(json.dumps(ref) + "\n")
    print(f"{name}: lengths {[len(i) for i in ids]} (untruncated {untruncated}), padded vs alone {pad_diff:.2e} -> {out}")


def main():
    vocab = train_vocab()
    for name, cfg in configs(len(vocab)).items():
        make(name, cfg, vocab)


if __name__ == "__main__":
    main()
