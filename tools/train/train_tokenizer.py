#!/usr/bin/env python3
"""Train HYPIC-tiny's byte-level BPE tokenizer and write its HF tokenizer files.

Qwen2-style pipeline (the one real Qwen3-Next uses): NFC normaliser, the Qwen2
pre-tokenizer regex (isolated split) then ByteLevel without regex, BPE without unk,
ByteLevel decoder.  The BPE is trained on text from gen_corpus.py (seed 11, a seed no
other split uses) and gets 4093 tokens; the three special tokens follow in Qwen's order:
<|endoftext|> = 4093, <|im_start|> = 4094, <|im_end|> = 4095, so vocab_size = 4096.

    python tools/train/train_tokenizer.py --out models/hypic-tiny

writes tokenizer.json, tokenizer_config.json (ChatML chat_template, Qwen2Tokenizer class,
whose regex is the same as ours, so HF's AutoTokenizer and the raw tokenizer.json agree)
and generation_config.json (eos = <|im_end|>).  Deterministic for the pinned tokenizers
version (0.23.3).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402

import gen_corpus as gc  # noqa: E402

TOKENIZER_SEED = 11
BASE_VOCAB = 4093
SPECIALS = [gc.ENDOFTEXT, gc.IM_START, gc.IM_END]  # ids 4093, 4094, 4095
VOCAB_SIZE = BASE_VOCAB + len(SPECIALS)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def corpus_texts(n: int):
    count = gc.TokCounter(None)
    for i in range(n):
        ex = gc.make_example(TOKENIZER_SEED, i, count, n_extra=3)
        text = gc.prompt_text(ex) + gc.answer_text(ex)
        for q in ex["extra"]:
            text += gc.followup_text(q["question"], q["answer"])
        for s in SPECIALS:
            text = text.replace(s, "\x00")
        for piece in text.split("\x00"):
            if piece:
                yield piece


def build(n_examples: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(gc.QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BASE_VOCAB,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(corpus_texts(n_examples), trainer=trainer)
    assert tok.get_vocab_size() == BASE_VOCAB, tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    assert tok.get_vocab_size() == VOCAB_SIZE
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == BASE_VOCAB + i, s
    return tok


def tokenizer_config() -> dict:
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(BASE_VOCAB + i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True}
            for i, s in enumerate(SPECIALS)
        },
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": gc.IM_END,
        "errors": "replace",
        "model_max_length": 16384,
        "pad_token": gc.ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def generation_config() -> dict:
    return {
        "bos_token_id": None,
        "do_sample": False,
        "eos_token_id": BASE_VOCAB + 2,
        "pad_token_id": BASE_VOCAB,
        "max_new_tokens": 32,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=3000, help="corpus examples (each with 3 follow-up QAs)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    tok = build(a.n)
    tok.save(os.path.join(a.out, "tokenizer.json"), pretty=True)
    with open(os.path.join(a.out, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(), f, indent=2)
        f.write("\n")
    with open(os.path.join(a.out, "generation_config.json"), "w") as f:
        json.dump(generation_config(), f, indent=2)
        f.write("\n")
    print(f"vocab {tok.get_vocab_size()} written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
