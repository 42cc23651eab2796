"""``HFTokenizer`` calls the Rust tokenizer directly on the gateway's hot path; its ids must be
exactly those of the transformers API it replaces (quota counts and bills are built on them)."""

from __future__ import annotations

import random

from transformers import AutoTokenizer

WORDS = ["Héllo", "wörld", "你好", "🙂", "<|im_start|>", "<|im_end|>", "\n", "  ", "the", "tokens,",
         "KV", "$x^2$", "def f():", "\t", "ünïcödé", "'s", "1234567"]


def test_fast_path_matches_transformers(tokenizer, model_dir):
    reference = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(7)
    for _ in range(200):
        messages = [{"role": rng.choice(["system", "user", "assistant"]),
                     "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 30)))}
                    for _ in range(rng.randint(1, 4))]
        messages[-1]["role"] = "user"
        expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert tokenizer.encode_chat(messages) == list(expected)
        text = messages[0]["content"]
        for special in (True, False):
            assert tokenizer.encode(text, add_special_tokens=special) == reference.encode(
                text, add_special_tokens=special)
        ids = [rng.randrange(len(reference)) for _ in range(rng.randint(1, 40))]
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)
