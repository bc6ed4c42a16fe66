"""The shared ledger's two loops besides the worker: the refresh pass and the listener.

* the refresh pass: renewals every ttl/3, else reclaiming expired leases, checking
  each backend's epoch and repairing drift; and the eviction-policy check;
* the listener: release notices over pub/sub, so a waiter wakes on another replica's
  release.

Both read and write the state `Upkeep` (`proxy.redis_upkeep`) holds with the ledger;
they extend it rather than reach into it, as redis-py's command mixins extend its client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.exceptions import NoScriptError, ResponseError

from proxy.redis_faults import REDIS_ERRORS, fault, refused, unreachable
from proxy.redis_upkeep import Upkeep, as_text

__all__ = ["RefreshingUpkeep"]

log = logging.getLogger("kvgate.ledger")


class RefreshingUpkeep(Upkeep):
    """`Upkeep` with its refresh pass and release-notice listener: what the ledger runs."""

    # ------------------------------------------------------------------ the refresh pass
    async def maintain(self) -> None:
        """Renew leases every ttl/3 (every pass while unreachable or rebuilding), else
        reclaim expired ones, check the epoch and repair drift; refresh the resident view.

        Only a cancel stops it: the refresh pass queues the renewals, and one that
        stopped would let every live lease of this replica expire. A pass that raises
        anything besides Redis' errors (a bug) is logged with its traceback, and the
        next pass runs on schedule: passes are `refresh_interval_s` apart whether they
        fail or not, so a failure that repeats does not spin.
        """
        renew_every_s = self._ttl_ms / 3000
        since_renew = renew_every_s
        self._was_available = self.available
        while True:
            renew = since_renew >= renew_every_s or not self.available
            if renew:
                since_renew = 0.0
            try:
                await self._pass(renew, renew_every_s)
            except Exception as exc:
                self._repeats.log(("refresh", *fault(exc)), logging.ERROR,
                                  "shared ledger: a refresh pass failed; the next runs in "
                                  "%.1f s", self._refresh_s, exc_info=exc)
            await asyncio.sleep(self._refresh_s)
            since_renew += self._refresh_s

    async def _pass(self, renew: bool, renew_every_s: float) -> None:
        if renew:
            for backend in self._backends:
                self._queue_renewal(backend)
        else:
            try:
                await self._reclaim_expired()
            except REDIS_ERRORS as exc:
                if not unreachable(exc):
                    raise
                self.set_reachable(False, exc)
        if self.reachable and (not self._policy_checked_at or time.monotonic()
                               - self._policy_checked_at >= renew_every_s):
            with contextlib.suppress(*REDIS_ERRORS):
                problem = await self.check_eviction_policy()
                self._policy_checked_at = time.monotonic()
                if problem is not None:
                    # Too late to refuse to start: say it loudly; a lost lease hash
                    # is still caught by the epoch and rebuilt.
                    self._say_policy("unsafe", logging.ERROR, "%s", problem)
        available = self.available
        if available and not self._was_available and self.reachable:
            log.warning("shared ledger admits again")
        self._was_available = available
        # Waiters re-check after each pass: this covers a lost pub/sub message.
        self._notify_all()

    async def _reclaim_expired(self) -> None:
        """One pipelined pass: reclaim expired leases, check each backend's epoch, repair
        drift, refresh the resident view. A backend whose script got NOSCRIPT is run
        once more at once (the next pipeline loads the scripts first, as the worker's)."""
        backends = await self._reclaim_on(self._backends, reloaded=False)
        if backends:
            await self._reclaim_on(backends, reloaded=True)

    async def _reclaim_on(self, backends: list[str], *, reloaded: bool) -> list[str]:
        """-> the backends to run again: those that got NOSCRIPT, unless `reloaded`."""
        assert self._client is not None
        pipe = self._client.pipeline(transaction=False)
        for backend in backends:
            await self._reclaim(keys=self._keys(backend),
                                args=[self._channel, backend, self._ttl_ms], client=pipe)
        marks = {backend: self._resident.mark(backend) for backend in backends}
        results = await self._execute(pipe, len(backends))
        passing: ResponseError | None = None
        again: list[str] = []
        for backend, result in zip(backends, results, strict=True):
            if isinstance(result, ResponseError):
                if isinstance(result, NoScriptError) and not reloaded:
                    again.append(backend)
                elif not refused(result):
                    passing = result
                else:
                    self.say_refused("refresh pass", backend, "", result,
                                     "its expired leases are not reclaimed, nor its "
                                     "counters repaired, until a pass is answered")
                continue
            self._resident.read(backend, int(result[0]), marks[backend])
            self.reclaimed_total += int(result[1])
            if result[2] is None or as_text(result[2]) != self._epoch.get(backend):
                self._lost(backend, gone=result[2] is None)
                continue
            self._rebuilding_until[backend] = time.monotonic() + max(0, int(result[3])) / 1000
            self._drifted(backend, int(result[4]), int(result[5]))
        if passing is not None:
            raise passing  # the other backends' answers are taken in
        return again

    # ------------------------------------------------------------------ the listener
    async def listen(self) -> None:
        """Release notices from every replica: refresh the resident view and wake waiters.

        Only `close()` stops it: anything it raises besides Redis' errors (a bug, a
        notice it cannot read) is logged with its traceback and it subscribes again
        after a refresh interval."""
        while not self._closing():
            try:
                assert self._client is not None
                pubsub = self._client.pubsub()
                await pubsub.subscribe(self._channel)
                try:
                    while not self._closing():
                        message = await pubsub.get_message(
                            ignore_subscribe_messages=True, timeout=0.2
                        )
                        if message is None:
                            continue
                        backend = message["data"].decode()
                        mark = self._resident.mark(backend)
                        try:
                            value = await self._client.get(self._keys(backend)[0])
                        except ResponseError as exc:
                            if not refused(exc):
                                raise
                            self.say_refused("read of the resident counter", backend, "",
                                             exc, "the waiters are woken all the same")
                        else:
                            self._resident.read(backend, int(value or 0), mark)
                        self._notify(backend)
                finally:
                    # Bounded: closing a pub/sub connection mid-read can otherwise hang
                    # a cancelled task (and with it, shutdown).
                    with contextlib.suppress(*REDIS_ERRORS, TimeoutError):
                        async with asyncio.timeout(1.0):
                            await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]
            except REDIS_ERRORS as exc:
                if not unreachable(exc):  # e.g. SUBSCRIBE denied by an ACL
                    self._repeats.log(("listen", *fault(exc)), logging.ERROR,
                                      "shared ledger: Redis refused the release-notice "
                                      "subscription: %s: %s; trying again in %.1f s",
                                      type(exc).__name__, exc, self._refresh_s)
                await asyncio.sleep(self._refresh_s)
            except Exception as exc:
                self._repeats.log(("listen", *fault(exc)), logging.ERROR,
                                  "shared ledger: the release-notice listener failed; it "
                                  "subscribes again in %.1f s", self._refresh_s,
                                  exc_info=exc)
                await asyncio.sleep(self._refresh_s)
