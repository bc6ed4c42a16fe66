"""Whether a Redis may evict the shared ledger's keys: kvgate refuses one that may.

None of the ledger's keys carries a TTL, so `noeviction` and every `volatile-*` policy
keep them; an `allkeys-*` policy with a `maxmemory` set may evict a lease hash, and
each eviction costs a rebuild window (`proxy.redis_scripts`) during which nothing is
admitted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

__all__ = ["UnsafeRedisConfig", "eviction_risk"]


# maxmemory-policy values that may evict keys without a TTL, which all the ledger's are.
_EVICTING_POLICIES = ("allkeys-lru", "allkeys-lfu", "allkeys-random")
_SAFE_POLICY_ADVICE = (
    "set `maxmemory-policy noeviction` (a `volatile-*` policy is safe too: the ledger's "
    "keys carry no TTL, and volatile policies evict only keys that do), e.g. "
    "`redis-cli CONFIG SET maxmemory-policy noeviction`, or give kvgate a Redis of its own"
)


class UnsafeRedisConfig(ValueError):
    """Redis may evict the ledger's keys: kvgate does not start on it."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def eviction_risk(client: aioredis.Redis, say: Callable[..., None]) -> str | None:
    """-> why Redis may evict the ledger's keys (an `allkeys-*` maxmemory-policy with
    a maxmemory set), or None. Where CONFIG GET is refused, says a warning instead
    (`say(state, level, message, *args)`, which logs each state once). Connection
    errors propagate."""
    try:
        raw = await client.config_get("maxmemory*")
    except ResponseError as exc:  # CONFIG renamed or denied (managed Redis, ACLs)
        say(
            "refused", logging.WARNING,
            "cannot read Redis' maxmemory-policy (CONFIG GET: %s); kvgate cannot "
            "check that Redis will not evict the ledger's keys: %s", exc,
            _SAFE_POLICY_ADVICE)
        return None
    config = {_text(k): _text(v) for k, v in dict(raw).items()}
    policy = config.get("maxmemory-policy", "noeviction")
    maxmemory = int(config.get("maxmemory", "0") or 0)
    if policy not in _EVICTING_POLICIES:
        say(policy, logging.INFO, "Redis maxmemory-policy %s keeps the ledger's keys (none "
            "carries a TTL)", policy)
        return None
    if maxmemory == 0:
        say(
            policy, logging.WARNING,
            "Redis maxmemory-policy is %s but no maxmemory is set, so nothing is "
            "evicted yet; a maxmemory would let Redis evict the ledger's keys: %s",
            policy, _SAFE_POLICY_ADVICE)
        return None
    return (f"Redis runs maxmemory-policy {policy} with maxmemory {maxmemory} bytes: it "
            "may evict the shared ledger's keys (an evicted lease hash costs a rebuild "
            f"during which nothing is admitted); kvgate does not run on it: "
            f"{_SAFE_POLICY_ADVICE}")
