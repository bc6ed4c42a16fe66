"""The simulator's KV block pool, with prefix caching as vLLM v1 does it.

What follows vLLM v1 (`vllm/v1/core/block_pool.py`, `kv_cache_utils.py`,
`single_type_kv_cache_manager.py`):

* A block's identity is a chained hash: `hash(parent block's hash, this block's token
  ids)`, so equal hashes mean equal prefixes. Only full blocks are hashed and cached.
* A block carries a reference count; a block referenced by several running requests is
  held once.
* A block whose count falls to 0 goes to the tail of a free queue and keeps its hash:
  it still gives hits until it is evicted. New blocks come from the head of that queue
  (least recently freed first); taking a cached block drops its hash (eviction).
* A hit on a free cached block takes it back out of the free queue ("touch"): it costs
  a block, but no compute.
* A request's blocks are freed tail first, so the private end of a prompt is evicted
  before the shared head.
* Blocks are cached when allocated for the tokens computed in that step (not after the
  step), so a request scheduled later in the same step already hits them. Identical
  blocks computed twice are both kept under one hash (vLLM does not de-duplicate).

`vllm:kv_cache_usage_perc` is `1 - free / total`, cached-but-free blocks counting as
free. vLLM's reserved null block is not modelled.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["ROOT_HASH", "Block", "BlockHash", "BlockPool", "block_hashes_from_hash_ids",
           "hash_block_tokens", "hash_prompt_blocks", "private_block_hash"]

BlockHash = int

# The parent of a prompt's first block (vLLM's NONE_HASH). Python's hash of ints and of
# tuples of ints is not randomised per process, so chains are stable across runs.
ROOT_HASH: BlockHash = 0x6B7667617465  # "kvgate"
_PRIVATE = -0x707269766174  # marks hashes of blocks no other request can share
_TRACE = -0x7472616365  # marks hashes built from a trace's hash ids


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """One block's hash: its parent's hash and its own token ids."""
    return hash((parent, tuple(token_ids)))


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The hash chain of every full block of `token_ids` (a trailing partial block has none)."""
    hashes: list[BlockHash] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


def private_block_hash(parent: BlockHash, owner: int, index: int) -> BlockHash:
    """A block whose tokens are known only to its request (`owner`): generated tokens,
    or a prompt submitted without ids or hashes. Its own request can hit it again after
    a preemption; no other request can."""
    return hash((parent, _PRIVATE, owner, index))


def block_hashes_from_hash_ids(hash_ids: Sequence[int], *, hash_id_tokens: int,
                               block_size: int, prompt_tokens: int) -> list[BlockHash]:
    """Engine block hashes for a trace that names its prompt by hash ids (one id per
    `hash_id_tokens` tokens, chained as prompts are: equal ids at equal positions mean
    equal prefixes), for the prompt's full engine blocks that the ids cover."""
    if hash_id_tokens < 1 or block_size < 1:
        raise ValueError("hash_id_tokens and block_size must be >= 1")
    covered = min(prompt_tokens, len(hash_ids) * hash_id_tokens)
    hashes: list[BlockHash] = []
    parent = ROOT_HASH
    for start in range(0, covered - block_size + 1, block_size):
        end = start + block_size
        ids = tuple(hash_ids[start // hash_id_tokens:(end - 1) // hash_id_tokens + 1])
        parent = hash((parent, _TRACE, ids, start % hash_id_tokens))
        hashes.append(parent)
    return hashes


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """Blocks, their reference counts, the LRU free queue and the hash -> block map."""

    def __init__(self, num_blocks: int, *, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # the free queue in eviction order (head first); a dict gives O(1) removal
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, dict[int, Block]] = {}
        self._cached_free = 0  # blocks in the free queue that still have a hash
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks a new allocation may take: never used, freed, or cached but unreferenced."""
        return len(self._free)

    @property
    def num_cached_free(self) -> int:
        return self._cached_free

    @property
    def num_cached(self) -> int:
        """Blocks with a hash, referenced or not."""
        return sum(len(by_id) for by_id in self._cached.values())

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next evicted) first."""
        return list(self._free)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        by_id = self._cached.get(block_hash)
        return next(iter(by_id.values())) if by_id else None

    def find_longest_cache_hit(self, hashes: Sequence[BlockHash], max_blocks: int) -> list[Block]:
        """The cached blocks of the longest prefix of the chain, at most `max_blocks`."""
        hit: list[Block] = []
        if not self.enable_caching:
            return hit
        for block_hash in hashes[:max_blocks]:
            block = self.get_cached_block(block_hash)
            if block is None:
                break  # a chain: nothing after a miss can be cached
            hit.append(block)
        return hit

    def touch(self, blocks: Iterable[Block]) -> None:
        """Reference hit blocks; a free one leaves the free queue (no longer evictable)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
                self._cached_free -= 1
            block.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[Block]:
        """`n` blocks from the head of the free queue, evicting the cached ones."""
        if n > len(self._free):
            raise ValueError(f"cannot take {n} blocks, {len(self._free)} free")
        out: list[Block] = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: Block) -> None:
        assert block.block_hash is not None
        by_id = self._cached[block.block_hash]
        del by_id[block.block_id]
        if not by_id:
            del self._cached[block.block_hash]
        block.block_hash = None
        self._cached_free -= 1
        self.evictions += 1

    def cache_block(self, block: Block, block_hash: BlockHash) -> None:
        """Name a full, referenced block so later requests can hit it."""
        assert block.block_hash is None and block.ref_cnt > 0
        block.block_hash = block_hash
        self._cached.setdefault(block_hash, {})[block.block_id] = block

    def free_blocks(self, ordered: Iterable[Block]) -> None:
        """Drop one reference from each block; those at 0 join the free queue's tail in
        the given order (the first given is evicted first)."""
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is not None:
                    self._cached_free += 1
