"""Synthesizing prompts of an exact token length with the model's own tokenizer.

Traces give lengths, not text. :class:`PromptSynthesizer` builds a user message whose chat, after
the model's chat template, is exactly ``n`` tokens: it draws words that are single tokens of the
vocabulary (a leading space plus letters, which byte-level BPE pre-tokenizes on their own, so a
sequence of k such words is k tokens), seeded per request so prompts do not share prefixes by
accident (which would turn the replay into a prefix-cache benchmark), then checks the count with
the real template and trims or pads until it matches.
"""

from __future__ import annotations

import random

from kvmeter.serving.engines.base import Tokenizer

__all__ = ["PromptSynthesizer"]


class PromptSynthesizer:
    """Builds chat messages of an exact templated token length.

    Raises:
        ValueError: from :meth:`messages` when ``n`` is below the template's own overhead.
    """

    def __init__(self, tokenizer: Tokenizer, *, vocabulary_size: int = 2000, seed: int = 0) -> None:
        self._tok = tokenizer
        self._words = self._single_token_words(vocabulary_size, seed)
        self.overhead = len(tokenizer.encode_chat([{"role": "user", "content": ""}]))

    def _single_token_words(self, limit: int, seed: int) -> list[str]:
        rng = random.Random(seed)
        words: list[str] = []
        for token_id in range(self._tok.vocab_size):
            text = self._tok.decode([token_id])
            if len(text) > 3 and text[0] == " " and text[1:].isalpha() and text[1:].isascii():
                if self._tok.encode(text) == [token_id]:
                    words.append(text)
            if len(words) >= limit * 3:
                break
        if len(words) < 50:
            raise ValueError("the tokenizer has too few single-token words to synthesize prompts")
        rng.shuffle(words)
        return words[:limit]

    def messages(self, n: int, *, seed: int) -> list[dict[str, str]]:
        """A one-message chat that templates to exactly ``n`` tokens (≥ overhead + 1)."""
        want = n - self.overhead
        if want < 1:
            raise ValueError(f"{n} tokens is below the chat template's own {self.overhead} tokens")
        rng = random.Random(seed)
        words = [rng.choice(self._words) for _ in range(want)]
        for _ in range(8):  # converge: word boundaries after the template may merge or split
            content = "".join(words).lstrip()
            count = len(self._tok.encode_chat([{"role": "user", "content": content}]))
            if count == n:
                return [{"role": "user", "content": content}]
            if count > n:
                del words[-(count - n):]
            else:
                words.extend(rng.choice(self._words) for _ in range(n - count))
        raise ValueError(f"could not synthesize a prompt of exactly {n} tokens")
