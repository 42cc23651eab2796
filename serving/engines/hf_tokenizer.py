"""The model's Hugging Face tokenizer behind kvmeter's :class:`~kvmeter.serving.engines.base.Tokenizer`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from kvmeter.serving.engines.base import Tokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer as RustTokenizer

__all__ = ["HFTokenizer", "GIL_FREE_CHARS"]

#: Texts longer than this (characters) are encoded with the Rust tokenizer's ``encode_batch``, which
#: releases the GIL while it works (its ``encode`` holds it: a 1.3 M-character prompt held the
#: gateway's event loop for 2.8 s, even from a worker thread). Shorter texts keep ``encode``:
#: releasing the GIL costs a re-acquisition, up to a switch interval on a busy process.
GIL_FREE_CHARS = 16_384


class HFTokenizer(Tokenizer):
    """Wraps ``transformers.AutoTokenizer`` loaded from a local model directory.

    Raises:
        ValueError: from :meth:`encode_chat` when the model has no chat template or the messages
            cannot be rendered.
    """

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer  # heavy import, only when a model is served

        #: the model directory the tokenizer was loaded from
        self.model_dir = Path(model_dir)
        self._tok = AutoTokenizer.from_pretrained(str(model_dir))
        self._vocab_size = len(self._tok)
        # The Rust tokenizer of a fast tokenizer, called directly on the hot path: the same ids as
        # the transformers wrapper (which adds ~0.1 ms of Python per call), see encode_chat.
        self._backend: RustTokenizer | None = getattr(self._tok, "backend_tokenizer", None)

    @staticmethod
    def _backend_ids(backend: RustTokenizer, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) > GIL_FREE_CHARS:
            return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        backend = self._backend
        if backend is not None:
            return self._backend_ids(backend, text, add_special_tokens)
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self._tok, "chat_template", None):
            raise ValueError("this model has no chat template; use /v1/completions")
        backend = self._backend
        try:
            if backend is not None:
                # What apply_chat_template(tokenize=True) does: render, then encode the text
                # without adding special tokens (the template writes them).
                text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                # transformers annotates every return shape; tokenize=False renders one str
                return self._backend_ids(backend, text, False)  # type: ignore[arg-type]
            ids = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
        except Exception as exc:  # noqa: BLE001 — jinja errors of all kinds
            raise ValueError(f"chat template could not render the messages: {exc}") from exc
        if isinstance(ids, Mapping):  # some versions return a BatchEncoding (a UserDict) regardless
            ids = ids["input_ids"]
        return list(ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(list(token_ids), skip_special_tokens=True)
        # transformers annotates the batch case too (list[str]); one sequence decodes to one str
        return self._tok.decode(list(token_ids), skip_special_tokens=True)  # type: ignore[return-value]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def hf(self):  # noqa: ANN201 — the underlying transformers tokenizer, for prompt synthesis
        return self._tok
