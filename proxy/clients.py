"""Who is asking: the clients the operator configured, and what each may claim.

Fair share and priority are only worth something if a client cannot pick them: a fresh
`Authorization` value per request must not buy a fresh tenant, and a priority header
must not lift a request above its client's class. So identities come from the
operator alone:

* `[[clients]]` (or the file `[server] clients_file` names): each key (plain, or
  only its SHA-256) belongs to a client with a tenant name, a priority ceiling and a
  fair-share weight. With any configured, a request without a valid key is `401`.
* `[queue] priority_by_api_key` (older): a key's ceiling; its tenant is the key's hash.
* Anyone else shares one default tenant at class `normal`.

A priority header may lower a request's class below its ceiling, never raise it.
No HTTP here; the only I/O is reading `clients_file` while the config loads.
"""

from __future__ import annotations

import hashlib
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policies.ordering import PRIORITY_CLASSES, class_rank
from proxy.config_values import check_keys, get_num, get_str
from proxy.modelconfig import ConfigError

__all__ = ["DEFAULT_PRIORITY", "Client", "Clients", "Identity", "key_digest", "load_clients",
           "parse_clients"]

DEFAULT_PRIORITY = "normal"


def key_digest(key: str) -> str:
    """SHA-256 of an API key, hex: what a clients file stores instead of the key."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class Client:
    """A configured client: its tenant (`name`), its priority ceiling and weight."""

    name: str
    priority: str = DEFAULT_PRIORITY
    weight: float = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Identity:
    """What admission keys a request on: its tenant and its priority class."""

    tenant: str
    priority: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Clients:
    """The configured clients by key digest; empty: no client authentication."""

    by_digest: Mapping[str, Client] = field(default_factory=dict)
    priority_by_api_key: Mapping[str, str] = field(default_factory=dict)

    @property
    def required(self) -> bool:
        """With clients configured, every inference request must bring a valid key."""
        return bool(self.by_digest)

    def client(self, key: str) -> Client | None:
        """The client whose key this is; a dict lookup on the key's SHA-256, which tells
        a guesser nothing about how close a wrong key came."""
        return self.by_digest.get(key_digest(key)) if key else None

    def identify(self, key: str, claimed_priority: str) -> Identity | None:
        """The tenant and class of a request bringing `key` (may be ""); None when
        clients are required and the key is not one of theirs."""
        client = self.client(key)
        if client is not None:
            tenant, ceiling = client.name, client.priority
        elif self.required:
            return None
        elif key and key in self.priority_by_api_key:
            tenant, ceiling = key_digest(key)[:12], self.priority_by_api_key[key]
        else:
            tenant, ceiling = "", DEFAULT_PRIORITY
        priority = ceiling
        claimed = claimed_priority.strip().lower()
        if claimed in PRIORITY_CLASSES and class_rank(claimed) > class_rank(ceiling):
            priority = claimed  # lowering is everyone's right; raising is nobody's
        return Identity(tenant=tenant, priority=priority)

    def weights(self) -> dict[str, float]:
        return {c.name: c.weight for c in self.by_digest.values()}


# ----------------------------------------------------------------------------- config

_DIGEST_CHARS = frozenset("0123456789abcdef")


def parse_clients(entries: object, where: str) -> dict[str, Client]:
    """`[[clients]]` tables -> clients by key digest; every error names its key.

    Each needs `name` and exactly one of `key` (the key itself) or `key_sha256` (its
    SHA-256 in hex, so a file of keys can be shared without the keys); `priority`
    (default `normal`) is the highest class the client may claim, `weight` (default 1)
    its fair share against the others.
    """
    if not isinstance(entries, list):
        raise ConfigError(f"`{where}` must be a list of [[clients]] tables")
    out: dict[str, Client] = {}
    names: set[str] = set()
    for i, entry in enumerate(entries):
        w = f"{where}[{i}]."
        if not isinstance(entry, Mapping):
            raise ConfigError(f"`{where}[{i}]` must be a table")
        check_keys(entry, {"name", "key", "key_sha256", "priority", "weight"}, w)
        name = get_str(entry, "name", w)
        if not name or name in names:
            raise ConfigError(f"`{w}name` must be a non-empty name used once. Given: {name!r}")
        names.add(name)
        if ("key" in entry) == ("key_sha256" in entry):
            raise ConfigError(f"`{w[:-1]}` needs exactly one of `key` or `key_sha256`")
        if "key" in entry:
            key = get_str(entry, "key", w)
            if not key:
                raise ConfigError(f"`{w}key` must be a non-empty string")
            digest = key_digest(key)
        else:
            digest = get_str(entry, "key_sha256", w).lower()
            if len(digest) != 64 or not set(digest) <= _DIGEST_CHARS:
                raise ConfigError(f"`{w}key_sha256` must be 64 hex digits (sha256sum of the "
                                  f"key). Given: {digest!r}")
        if digest in out:
            raise ConfigError(f"`{w[:-1]}`: the same key as client {out[digest].name!r}")
        priority = get_str(entry, "priority", w, DEFAULT_PRIORITY)
        if priority not in PRIORITY_CLASSES:
            raise ConfigError(f"`{w}priority` must be one of {list(PRIORITY_CLASSES)}. "
                              f"Given: {priority!r}")
        weight = get_num(entry, "weight", w, 1.0, minimum=0.0)
        if weight <= 0:
            raise ConfigError(f"`{w}weight` must be > 0. Given: {weight}")
        out[digest] = Client(name=name, priority=priority, weight=weight)
    return out



def load_clients(entries: Any, server: Mapping[str, Any], base: Path,
                 tenant_weights: Mapping[str, float], priority_by_api_key: Mapping[str, str],
                 ) -> Clients:
    """`[[clients]]` and the `[[clients]]` of `server.clients_file`, one set of keys."""
    by_digest = parse_clients(entries, "clients")
    if "clients_file" in server:
        path = base / get_str(server, "clients_file", "server.")
        try:
            more = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"`server.clients_file` {path}: {exc}") from exc
        check_keys(more, {"clients"}, f"{path}: ")
        for digest, client in parse_clients(more.get("clients", []), f"{path}: clients").items():
            if digest in by_digest or client.name in {c.name for c in by_digest.values()}:
                raise ConfigError(f"`server.clients_file` {path}: client {client.name!r} is "
                                  "configured twice")
            by_digest[digest] = client
    for client in by_digest.values():
        weight = tenant_weights.get(client.name)
        if weight is not None and weight != client.weight:
            raise ConfigError(f"client {client.name!r}: weight {client.weight} in [[clients]] "
                              f"but {weight} in `queue.tenant_weights`")
    return Clients(by_digest=by_digest, priority_by_api_key=priority_by_api_key)
