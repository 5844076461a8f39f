"""TLS credentials from PEM files, and API-key authentication for the
public API."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import grpc

# Always reachable without a key: probes and tooling must work.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                        "/grpc.reflection.v1.ServerReflection/")


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def server_credentials(cert: str, key: str, client_ca: str) -> grpc.ServerCredentials | None:
    """TLS when cert and key are set; with client_ca, clients must also
    present a certificate signed by it (mutual TLS)."""
    if not cert and not key:
        if client_ca:
            raise ValueError("a client CA needs a server certificate and key as well")
        return None
    if not (cert and key):
        raise ValueError("TLS needs both a certificate and a key")
    return grpc.ssl_server_credentials(
        [(_read(key), _read(cert))],
        root_certificates=_read(client_ca) if client_ca else None,
        require_client_auth=bool(client_ca),
    )


def channel_credentials(ca: str, cert: str = "", key: str = "") -> grpc.ChannelCredentials | None:
    """TLS to a server whose certificate ca signed; cert and key add a
    client certificate for mutual TLS."""
    if not ca:
        if cert or key:
            raise ValueError("a client certificate needs the server's CA as well")
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca),
        private_key=_read(key) if key else None,
        certificate_chain=_read(cert) if cert else None,
    )


def load_api_keys(keys: str, keys_file: str) -> list[bytes]:
    """Keys from a comma-separated setting and/or a file of one key per line."""
    found = [k.strip() for k in keys.split(",") if k.strip()]
    if keys_file:
        found += [line.strip() for line in Path(keys_file).read_text().splitlines() if line.strip()]
    return [k.encode() for k in found]


def presented_api_key(metadata) -> bytes:
    """The key in `authorization: Bearer <key>`, or b"" when there is none."""
    header = next((v for k, v in metadata or () if k == "authorization"), "")
    if isinstance(header, bytes):
        header = header.decode(errors="replace")
    scheme, _, presented = header.partition(" ")
    return presented.strip().encode() if scheme.lower() == "bearer" else b""


def api_key_owner(metadata) -> str:
    """Names the API key a call presented, without keeping the key: calls
    with the same key have the same owner."""
    return hashlib.sha256(presented_api_key(metadata)).hexdigest()


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <key>` on every call but health and
    reflection. Every key is compared in constant time, all of them each
    call, so timing tells nothing about which prefix matched."""

    def __init__(self, keys: list[bytes]):
        if not keys:
            raise ValueError("ApiKeyInterceptor needs at least one key")
        self._keys = keys

    def _authorized(self, metadata) -> bool:
        token = presented_api_key(metadata)
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(token, key)
        return ok

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(OPEN_METHOD_PREFIXES) or self._authorized(handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        return _DENY


async def _deny(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key (authorization: Bearer <key>)")


_DENY = grpc.unary_unary_rpc_method_handler(_deny)
