"""Who a request is for: tenants from API keys, their weights, and the
salt that scopes their prefix-cache blocks.

With API keys on, each key belongs to one tenant (`tenant:key` entries; a
bare key is a tenant of its own, named by a digest that does not reveal
the key), and a request's tenant is its key's. Without API keys, a request
may name its tenant (GenerateRequest.tenant), or it belongs to the default
tenant: fine on a trusted network, where clients are who they say.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from llmsched.errors import StartupError
from llmsched.security import presented_api_key
from scheduler_svc.core.policy import TENANT_NAME

DEFAULT_TENANT = "default"
MAX_CACHE_SALT_CHARS = 256


def key_tenant_name(key: bytes) -> str:
    """A bare key's tenant: a digest short enough to read in metrics, which
    reveals nothing of the key."""
    return "key-" + hashlib.sha256(key).hexdigest()[:12]


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """Each accepted key and its tenant."""

    tenant_by_key: dict[bytes, str]

    @classmethod
    def parse(cls, entries: list[bytes], setting: str = "SCHEDULER_API_KEYS") -> "ApiKeys":
        tenant_by_key: dict[bytes, str] = {}
        for entry in entries:
            name, sep, key = entry.partition(b":")
            if not sep:
                tenant_by_key[entry] = key_tenant_name(entry)
                continue
            tenant = name.decode(errors="replace")
            if not TENANT_NAME.fullmatch(tenant):
                raise StartupError(f"{setting}: tenant {tenant!r} in a tenant:key entry must be 1-64 characters of "
                                   "[A-Za-z0-9_.-], starting with a letter or digit")
            if not key:
                raise StartupError(f"{setting}: the entry for tenant {tenant!r} has an empty key")
            tenant_by_key[key] = tenant
        return cls(tenant_by_key)

    @property
    def keys(self) -> list[bytes]:
        return list(self.tenant_by_key)

    def tenant_of(self, metadata) -> str | None:
        """The presented key's tenant (None for an unknown key). Every key is
        compared in constant time, all of them each call."""
        token = presented_api_key(metadata)
        found = None
        for key, tenant in self.tenant_by_key.items():
            if hmac.compare_digest(token, key):
                found = tenant
        return found


def prefix_salt(tenant: str, cache_salt: str | None, scope: str) -> bytes:
    """What a request's prefix-cache hashes are salted with: its cache_salt
    when it has one, else its tenant under the `tenant` scope, else nothing
    (every request shares)."""
    if cache_salt is not None:
        return b"salt:" + cache_salt.encode()
    if scope == "tenant":
        return b"tenant:" + tenant.encode()
    return b""
