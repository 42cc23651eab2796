"""Paged KV block accounting with a prefix cache keyed by block-group hashes.

The simulator tracks KV in blocks of ``block_size`` tokens (vLLM's paged attention, Kwon et al.,
SOSP 2023). A request's KV is a prefix of *shared* groups — whole hash blocks of
``group_tokens`` tokens (the Mooncake trace's ``hash_ids`` name 512-token blocks) — followed by
*private* blocks. The replica counts private blocks itself; this class owns the pool total and the
shared groups:

* a group is registered when a request has computed all its tokens (only full groups are
  cacheable, as vLLM caches only full blocks) and holds a reference while the request runs;
* a group whose last reference is released stays cached but *evictable* (vLLM's free-block queue
  keeps the hash until the block is reused); evictable groups count as free for allocation and are
  evicted least-recently-released first;
* a request arriving with a hash prefix that is cached skips that part of its prefill.

Invariants (tested): ``0 ≤ used_shared_blocks``, ``0 ≤ evictable_blocks``, and
``private + used_shared + evictable ≤ total`` after every allocation the replica makes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

__all__ = ["PrefixCache"]


class PrefixCache:
    """Shared hash groups of a replica's KV pool.

    Args:
        total_blocks: KV blocks of the replica (≥ 1).
        block_size: tokens per block (≥ 1).
        group_tokens: tokens per hash group; a multiple of ``block_size``.
        enabled: False disables lookups and registration (no prefix caching).
    Raises:
        ValueError: on non-positive sizes or a group size that is not a multiple of the block size.
    """

    __slots__ = ("total_blocks", "block_size", "group_tokens", "group_blocks", "enabled",
                 "_refs", "_evictable", "used_shared_blocks", "evictable_blocks",
                 "queries_tokens", "hits_tokens", "evictions")

    def __init__(self, total_blocks: int, block_size: int = 16, group_tokens: int = 512,
                 enabled: bool = True) -> None:
        if total_blocks < 1 or block_size < 1 or group_tokens < 1:
            raise ValueError("total_blocks, block_size and group_tokens must be ≥ 1")
        if group_tokens % block_size:
            raise ValueError(f"group_tokens ({group_tokens}) must be a multiple of block_size ({block_size})")
        self.total_blocks = total_blocks
        self.block_size = block_size
        self.group_tokens = group_tokens
        self.group_blocks = group_tokens // block_size
        self.enabled = enabled
        self._refs: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.used_shared_blocks = 0
        self.evictable_blocks = 0
        self.queries_tokens = 0
        self.hits_tokens = 0
        self.evictions = 0

    def cached_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` are cached (referenced or evictable)."""
        if not self.enabled:
            return 0
        n = 0
        refs = self._refs
        for h in hashes:
            if h in refs or h in self._evictable:
                n += 1
            else:
                break
        return n

    def revive_blocks(self, hashes: Sequence[int]) -> int:
        """Blocks that taking references on ``hashes`` would move from evictable to used."""
        return sum(self.group_blocks for h in hashes if h not in self._refs)

    def acquire(self, h: int) -> None:
        """Take a reference on cached group ``h`` (revives it if evictable).

        Raises:
            KeyError: if ``h`` is not cached.
        """
        if h in self._refs:
            self._refs[h] += 1
            return
        del self._evictable[h]
        self.evictable_blocks -= self.group_blocks
        self._refs[h] = 1
        self.used_shared_blocks += self.group_blocks

    def register(self, h: int) -> bool:
        """Cache a freshly computed group with one reference; False if already cached."""
        if not self.enabled or h in self._refs or h in self._evictable:
            return False
        self._refs[h] = 1
        self.used_shared_blocks += self.group_blocks
        return True

    def release(self, h: int) -> None:
        """Drop a reference; the last one makes the group evictable (most recently used)."""
        n = self._refs.get(h)
        if n is None:
            return
        if n > 1:
            self._refs[h] = n - 1
            return
        del self._refs[h]
        self.used_shared_blocks -= self.group_blocks
        self._evictable[h] = None
        self.evictable_blocks += self.group_blocks

    def evict(self, blocks: int) -> int:
        """Evict least-recently-released groups until ≥ ``blocks`` are freed (or none is left).

        Returns:
            blocks freed.
        """
        freed = 0
        while freed < blocks and self._evictable:
            self._evictable.popitem(last=False)
            self.evictable_blocks -= self.group_blocks
            freed += self.group_blocks
            self.evictions += 1
        return freed

    def free_blocks(self, private_blocks: int) -> int:
        """Blocks neither used nor cached, given the replica's ``private_blocks``."""
        return self.total_blocks - private_blocks - self.used_shared_blocks - self.evictable_blocks

    def allocatable_blocks(self, private_blocks: int) -> int:
        """Blocks an allocation may take (free + evictable)."""
        return self.total_blocks - private_blocks - self.used_shared_blocks

    def make_room(self, private_blocks: int, new_blocks: int) -> bool:
        """Ensure ``new_blocks`` more private blocks fit, evicting cached groups if needed.

        Returns:
            False (and evicts nothing) when even evicting everything would not make room.
        """
        free = self.free_blocks(private_blocks)
        if free >= new_blocks:
            return True
        if free + self.evictable_blocks < new_blocks:
            return False
        self.evict(new_blocks - free)
        return True
