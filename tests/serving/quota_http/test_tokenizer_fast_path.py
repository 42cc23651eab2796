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


def test_long_texts_match_transformers_and_leave_the_gil_to_other_threads(tokenizer, model_dir):
    import threading
    import time

    from kvmeter.serving.engines.hf_tokenizer import GIL_FREE_CHARS

    reference = AutoTokenizer.from_pretrained(str(model_dir))
    text = ("数据中心的令牌 tokens, KV 🙂 " * 40_000)[:600_000]
    assert len(text) > GIL_FREE_CHARS
    for special in (True, False):
        assert tokenizer.encode(text, add_special_tokens=special) == reference.encode(
            text, add_special_tokens=special)
    chat = [{"role": "user", "content": text}]
    assert tokenizer.encode_chat(chat) == list(reference.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=False))
    # while a worker thread encodes it (as the gateway does for long prompts), this thread runs:
    # with the GIL held for the whole encode it would get about one turn
    worker = threading.Thread(target=tokenizer.encode, args=(text,))
    turns = 0
    worker.start()
    while worker.is_alive():
        time.sleep(0.001)
        turns += 1
    assert turns >= 20, turns
