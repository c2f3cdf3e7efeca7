"""Paged KV-cache bookkeeping: a block pool with prefix caching, and per-request block lists.

The GPU (or CPU) tensors live in the runtime; this module only decides which block ids a
request owns, and keeps them as rows of one array (``BlockTables``) from which a step takes
its block table in one gather. A full block whose K/V is computed is registered under a hash chain over
(parent hash, its token ids, extra keys). The extra keys carry the numerics domain the
K/V was computed in and the request's cache salt, so blocks are shared only between
requests that would have computed the same bits.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from sid.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent: int | None, token_ids: Sequence[int], extra_keys: tuple[str, ...]) -> int:
    """128-bit hash of one full block, chained on its parent's hash."""
    h = xxhash.xxh3_128()
    h.update((parent or 0).to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    h.update("\x00".join(extra_keys).encode())
    return h.intdigest()


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class BlockPool:
    """Fixed set of blocks; free blocks are kept in LRU order and stay cached until reused."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}
        self.evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of blocks held by running requests."""
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` free blocks, evicting the least recently freed cached ones."""
        if n > len(self._free):
            raise RuntimeError(f"allocate({n}) with only {len(self._free)} free blocks")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
                self.evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on cache hits (pulling free ones out of the free list)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Sequence[KVBlock]) -> None:
        """Drop a reference; tail blocks are freed first so they are evicted first."""
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash)

    def register(self, block: KVBlock, block_hash: int) -> None:
        """Make a computed full block findable; a hash already cached keeps its first block."""
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block

    def num_cached(self) -> int:
        return len(self._cached)

    def reset_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is held."""
        if self.num_free < self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True


@dataclass
class PrefixCacheStats:
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockTables:
    """Each request's block ids as a row of one int32 array, zero past its blocks.

    A step's block table is a gather of its requests' rows (``take``): building it from
    Python lists cost a 256-request decode step about a millisecond of host time on the
    H200's host, a sixth of its host work. Rows are reused, and the array grows (doubling)
    in rows and columns as needed."""

    def __init__(self, rows: int = 64, width: int = 16) -> None:
        self._ids = np.zeros((rows, width), dtype=np.int32)
        self._row: dict[str, int] = {}
        self._free: list[int] = list(range(rows - 1, -1, -1))

    def extend(self, request_id: str, start: int, block_ids: Sequence[int]) -> None:
        """Write ``block_ids`` into the request's row from column ``start`` on."""
        row = self._row.get(request_id)
        if row is None:
            if not self._free:
                n = len(self._ids)
                self._ids = np.concatenate([self._ids, np.zeros_like(self._ids)])
                self._free = list(range(2 * n - 1, n - 1, -1))
            row = self._row[request_id] = self._free.pop()
        end = start + len(block_ids)
        if end > self._ids.shape[1]:
            wider = np.zeros((len(self._ids), max(end, 2 * self._ids.shape[1])), dtype=np.int32)
            wider[:, : self._ids.shape[1]] = self._ids
            self._ids = wider
        self._ids[row, start:end] = block_ids

    def cut(self, request_id: str, keep: int) -> None:
        """Zero the request's columns from ``keep`` on."""
        row = self._row.get(request_id)
        if row is not None:
            self._ids[row, keep:] = 0

    def drop(self, request_id: str) -> None:
        row = self._row.pop(request_id, None)
        if row is not None:
            self._ids[row] = 0
            self._free.append(row)

    def take(self, request_ids: Sequence[str], width: int) -> np.ndarray:
        """The requests' rows, ``width`` columns: a copy, [len(request_ids), width]."""
        return self._ids[[self._row[r] for r in request_ids], :width]


class KVCacheManager:
    """Which blocks each request holds, prefix-cache lookups, and truncation."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()
        self._blocks: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[int]] = {}
        self._registered: dict[str, int] = {}  # leading blocks of each request already registered
        self._tables = BlockTables()

    def blocks_of(self, request: Request) -> list[KVBlock]:
        return self._blocks.get(request.request_id, [])

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.blocks_of(request)]

    def block_table(self, requests: Sequence[Request]) -> np.ndarray:
        """The requests' block ids, one row each, zero-padded to the longest: int32 [n, width]."""
        width = max((len(self.blocks_of(r)) for r in requests), default=0)
        return self._tables.take([r.request_id for r in requests], max(width, 1))

    def _chain(self, request: Request, num_full_blocks: int) -> list[int]:
        """Hashes of the request's first ``num_full_blocks`` blocks (memoised per request)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        extra = request.cache_keys()
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, request.token_ids[i * bs : (i + 1) * bs], extra))
        return hashes[:num_full_blocks]

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """Longest run of cached blocks for the request's tokens, leaving >= 1 token to compute."""
        if not self.enable_prefix_caching or not request.may_read_prefix_cache:
            return []
        hits: list[KVBlock] = []
        for block_hash in self._chain(request, (request.num_tokens - 1) // self.block_size):
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        self.stats.queries += request.num_tokens
        self.stats.hits += len(hits) * self.block_size
        return hits

    def can_allocate(self, request: Request, upto: int, cached: Sequence[KVBlock] = ()) -> bool:
        needed = max(0, cdiv(upto, self.block_size) - len(self.blocks_of(request)) - len(cached))
        revived = sum(1 for b in cached if b.ref_cnt == 0)
        return needed + revived <= self.pool.num_free

    def allocate(self, request: Request, upto: int, cached: Sequence[KVBlock] = ()) -> bool:
        """Hold slots for positions ``0 .. upto - 1``, starting with the given cache hits.

        Returns False, changing nothing, when the pool cannot provide them.
        """
        if not cached and cdiv(upto, self.block_size) <= len(self.blocks_of(request)):
            return True  # most decode steps: the last block still has room
        if not self.can_allocate(request, upto, cached):
            return False
        blocks = self._blocks.setdefault(request.request_id, [])
        start = len(blocks)
        self.pool.touch(cached)
        blocks.extend(cached)
        blocks.extend(self.pool.allocate(max(0, cdiv(upto, self.block_size) - len(blocks))))
        self._tables.extend(request.request_id, start, [b.block_id for b in blocks[start:]])
        return True

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full within its first ``num_tokens``
        positions, whose K/V the caller knows is final (for a deterministic request: canonical)."""
        if not self.enable_prefix_caching:
            return
        blocks = self.blocks_of(request)
        num_full = min(num_tokens // self.block_size, len(blocks))
        done = self._registered.get(request.request_id, 0)
        if num_full <= done:
            return
        hashes = self._chain(request, num_full)
        for block, block_hash in zip(blocks[done:num_full], hashes[done:]):
            self.pool.register(block, block_hash)
        self._registered[request.request_id] = num_full

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Keep K/V for positions ``0 .. num_tokens - 1`` only; later positions are dropped.

        Registered (shared) blocks are never modified: the numerics contract only truncates
        above the cacheable prefix, and violating that is a bug worth failing loudly on.
        """
        blocks = self.blocks_of(request)
        keep = cdiv(num_tokens, self.block_size)
        if num_tokens % self.block_size and keep <= len(blocks) and blocks[keep - 1].block_hash is not None:
            raise RuntimeError(f"truncate({request.request_id}, {num_tokens}) would cut into a cached block")
        self.pool.release(blocks[keep:])
        del blocks[keep:]
        self._tables.cut(request.request_id, keep)
        hashes = self._hashes.get(request.request_id)
        if hashes is not None:
            del hashes[num_tokens // self.block_size :]
        self._registered[request.request_id] = min(
            self._registered.get(request.request_id, 0), num_tokens // self.block_size
        )
        request.num_computed_tokens = min(request.num_computed_tokens, num_tokens)

    def free(self, request: Request) -> None:
        self.pool.release(self._blocks.pop(request.request_id, []))
        self._tables.drop(request.request_id)
        self._hashes.pop(request.request_id, None)
        self._registered.pop(request.request_id, None)
