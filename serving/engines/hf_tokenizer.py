"""The model's Hugging Face tokenizer behind kvmeter's :class:`~kvmeter.serving.engines.base.Tokenizer`."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from kvmeter.serving.engines.base import Tokenizer

__all__ = ["HFTokenizer"]


class HFTokenizer(Tokenizer):
    """Wraps ``transformers.AutoTokenizer`` loaded from a local model directory.

    Raises:
        ValueError: from :meth:`encode_chat` when the model has no chat template or the messages
            cannot be rendered.
    """

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer  # heavy import, only when a model is served

        self._tok = AutoTokenizer.from_pretrained(str(model_dir))
        self._vocab_size = len(self._tok)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self._tok, "chat_template", None):
            raise ValueError("this model has no chat template; use /v1/completions")
        try:
            ids = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
        except Exception as exc:  # noqa: BLE001 — jinja errors of all kinds
            raise ValueError(f"chat template could not render the messages: {exc}") from exc
        if hasattr(ids, "keys"):  # some versions return a BatchEncoding regardless
            ids = ids["input_ids"]
        return list(ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def hf(self):  # noqa: ANN201 — the underlying transformers tokenizer, for prompt synthesis
        return self._tok
