"""BlockPool and KVCacheManager bookkeeping: LRU reuse, reference counts, hash chains, truncation."""

from __future__ import annotations

import pytest

from sid.engine.kv_cache import BlockPool, KVCacheManager, hash_block
from sid.engine.request import Request
from sid.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], salt: str | None = None, domain: str = "fast") -> Request:
    return Request(
        request_id=rid,
        prompt=None,
        prompt_token_ids=tokens,
        params=SamplingParams(max_tokens=4),
        seed=0,
        max_tokens=4,
        eos_token_ids=frozenset(),
        arrival=0,
        cache_salt=salt,
        domain=domain,
    )


def test_block_pool_lru_eviction_and_ref_counts() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert pool.num_free == 2 and all(b.ref_cnt == 1 for b in a)
    pool.register(a[0], 111)
    pool.register(a[1], 222)
    pool.release(a)  # tail first: a[1] is freed before a[0], so it is evicted first
    assert pool.num_free == 4 and pool.lookup(111) is a[0]
    fresh = pool.allocate(3)  # two never-used blocks, then the least recently freed cached one
    assert a[1] in fresh and a[0] not in fresh
    assert pool.lookup(222) is None and pool.lookup(111) is a[0]
    assert pool.evictions == 1
    pool.touch([a[0]])  # a cache hit revives a free block
    assert pool.num_free == 0 and a[0].ref_cnt == 1
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_hash_chain_depends_on_parent_tokens_and_extra_keys() -> None:
    base = hash_block(None, [1, 2, 3], ("fast", ""))
    assert base == hash_block(None, [1, 2, 3], ("fast", ""))
    assert base != hash_block(None, [1, 2, 4], ("fast", ""))
    assert base != hash_block(7, [1, 2, 3], ("fast", ""))
    assert base != hash_block(None, [1, 2, 3], ("canonical:abc", ""))
    assert base != hash_block(None, [1, 2, 3], ("fast", "salt"))


def test_prefix_hits_need_same_tokens_domain_and_salt() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    first = make_request("a", list(range(10)))
    assert kv.find_cached_prefix(first) == []
    assert kv.allocate(first, 10)
    kv.cache_full_blocks(first, 10)  # two full blocks (8 tokens) registered; the partial one is not
    assert kv.pool.num_cached() == 2
    same = make_request("b", list(range(10)) + [99])
    assert [b.block_id for b in kv.find_cached_prefix(same)] == kv.block_ids(first)[:2]
    assert kv.find_cached_prefix(make_request("c", list(range(10)), salt="s")) == []
    assert kv.find_cached_prefix(make_request("d", list(range(10)), domain="canonical:x")) == []
    # A prompt that is exactly the cached blocks still leaves its last token to compute.
    assert len(kv.find_cached_prefix(make_request("e", list(range(8))))) == 1


def test_allocate_fails_without_side_effects_and_free_returns_blocks() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    r = make_request("a", list(range(9)))
    assert not kv.allocate(r, 13)  # 4 blocks needed
    assert kv.pool.num_free == 3 and kv.blocks_of(r) == []
    assert kv.allocate(r, 9)
    assert kv.pool.num_free == 0
    kv.free(r)
    assert kv.pool.num_free == 3


def test_truncate_drops_tail_blocks_and_refuses_to_cut_cached_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    r = make_request("a", list(range(14)))
    assert kv.allocate(r, 14)
    r.num_computed_tokens = 14
    kv.cache_full_blocks(r, 14)  # blocks 0..2 registered
    kv.truncate(r, 13)  # inside the partial last block: allowed
    assert len(kv.blocks_of(r)) == 4 and r.num_computed_tokens == 13
    kv.truncate(r, 12)  # exactly at a block boundary: the last block goes back to the pool
    assert len(kv.blocks_of(r)) == 3 and kv.pool.num_free == 5
    with pytest.raises(RuntimeError, match="cached block"):
        kv.truncate(r, 10)


def test_block_table_rows_follow_allocate_truncate_and_free_as_the_arrays_grow() -> None:
    kv = KVCacheManager(num_blocks=400, block_size=4, enable_prefix_caching=False)
    # More requests than the table's first rows, and one longer than its first columns.
    requests = [make_request(f"r{i}", list(range(3 + i % 5))) for i in range(70)]
    for r in requests:
        assert kv.allocate(r, r.num_tokens)
    long = make_request("long", list(range(90)))
    assert kv.allocate(long, 90)
    picked = [requests[5], long, requests[69]]
    table = kv.block_table(picked)
    assert table.shape == (3, 23) and table.dtype.name == "int32"
    for row, r in zip(table.tolist(), picked):
        assert row == kv.block_ids(r) + [0] * (23 - len(kv.block_ids(r)))
    long.token_ids.extend([1] * 10)  # grows by 3 blocks: written after the first 23
    assert kv.allocate(long, 100)
    assert kv.block_table([long])[0].tolist() == kv.block_ids(long)
    table[1, 0] = -5  # a step's table is a copy: later steps never see its changes
    assert kv.block_table([long])[0, 0] == kv.block_ids(long)[0]
    kv.truncate(long, 41)  # 11 blocks kept; beside a longer request, its row shows zeros after them
    other = make_request("other", list(range(100)))
    assert kv.allocate(other, 100)
    assert kv.block_table([long, other])[0].tolist() == kv.block_ids(long) + [0] * 14
    # A freed request's row is zeroed and reused by the next one.
    kv.free(long)
    newcomer = make_request("new", [7] * 5)
    assert kv.allocate(newcomer, 5)
    assert kv.block_table([newcomer])[0].tolist() == kv.block_ids(newcomer)
    assert kv.block_table([newcomer, requests[1]]).shape == (2, 2)
