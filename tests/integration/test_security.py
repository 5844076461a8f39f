"""TLS on both services, mutual TLS on the step channel, and API keys on
the public API, with throwaway certificates made in the test."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmsched.launch import launch
from llmsched.v1 import executor_pb2, executor_pb2_grpc
from llmsched.v1 import scheduler_pb2 as spb
from llmsched.v1 import scheduler_pb2_grpc as spb_grpc


def _name(cn):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject, issuer_name, issuer_key, key, is_ca, server=False):
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
    if server:
        b = b.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(path: Path, key, cert) -> tuple[str, str]:
    key_path, cert_path = path.with_suffix(".key"), path.with_suffix(".pem")
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    out = {}
    for ca_name in ("ca", "rogue-ca"):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _cert(ca_name, _name(ca_name), ca_key, ca_key, is_ca=True)
        out[ca_name] = _write(d / ca_name, ca_key, ca_cert)[0]
        for leaf, server in (("server", True), ("client", False)):
            key = ec.generate_private_key(ec.SECP256R1())
            cert = _cert(f"{ca_name}-{leaf}", ca_cert.subject, ca_key, key, is_ca=False, server=server)
            out[f"{ca_name}-{leaf}"] = _write(d / f"{ca_name}-{leaf}", key, cert)
    return out


def creds(pki, ca="ca", client=None):
    read = lambda p: Path(p).read_bytes()  # noqa: E731
    if client is None:
        return grpc.ssl_channel_credentials(read(pki[ca]))
    cert, key = pki[client]
    return grpc.ssl_channel_credentials(read(pki[ca]), private_key=read(key), certificate_chain=read(cert))


@pytest.fixture(scope="module")
def secured(pki):
    server_cert, server_key = pki["ca-server"]
    client_cert, client_key = pki["ca-client"]
    services = launch(
        executor_env={"EXECUTOR_TLS_CERT": server_cert, "EXECUTOR_TLS_KEY": server_key, "EXECUTOR_TLS_CLIENT_CA": pki["ca"]},
        scheduler_env={
            "SCHEDULER_TLS_CERT": server_cert, "SCHEDULER_TLS_KEY": server_key,
            "SCHEDULER_EXECUTOR_TLS_CA": pki["ca"], "SCHEDULER_EXECUTOR_TLS_CERT": client_cert,
            "SCHEDULER_EXECUTOR_TLS_KEY": client_key, "SCHEDULER_API_KEYS": "key-one,key-two",
        },
    )
    services.executor_credentials = creds(pki, client="ca-client")
    services.scheduler_credentials = creds(pki)
    services.start()
    yield services
    services.stop()


def generate(address, credentials, key=None, timeout=30):
    with grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address) as channel:
        stub = spb_grpc.SchedulerStub(channel)
        metadata = (("authorization", f"Bearer {key}"),) if key else None
        req = spb.GenerateRequest(prompt="hi", sampling=spb.SamplingParams(max_tokens=4, ignore_eos=True))
        return [r for r in stub.Generate(req, metadata=metadata, timeout=timeout)]


def test_tls_client_with_the_right_ca_and_key_is_served(secured, pki):
    responses = generate(secured.scheduler_address, creds(pki), key="key-two")
    assert sum(len(r.token_ids) for r in responses) == 4


def test_plaintext_client_is_refused_by_the_tls_scheduler(secured):
    with pytest.raises(grpc.RpcError) as exc:
        generate(secured.scheduler_address, None, key="key-one", timeout=5)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_trusting_another_ca_is_refused(secured, pki):
    with pytest.raises(grpc.RpcError) as exc:
        generate(secured.scheduler_address, creds(pki, ca="rogue-ca"), key="key-one", timeout=5)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("key", [None, "wrong", "key-one-but-longer", ""], ids=["missing", "wrong", "prefix", "empty"])
def test_missing_or_wrong_api_key_is_unauthenticated(secured, pki, key):
    with pytest.raises(grpc.RpcError) as exc:
        generate(secured.scheduler_address, creds(pki), key=key)
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_stays_open_without_a_key(secured, pki):
    with grpc.secure_channel(secured.scheduler_address, creds(pki)) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def handshake(address, credentials):
    with grpc.secure_channel(address, credentials) as channel:
        return executor_pb2_grpc.ExecutorStub(channel).Handshake(executor_pb2.HandshakeRequest(), timeout=5)


def test_executor_accepts_only_clients_with_a_certificate_from_its_ca(secured, pki):
    assert handshake(secured.executor_address, creds(pki, client="ca-client")).num_kv_blocks > 0
    for bad in (creds(pki), creds(pki, client="rogue-ca-client")):
        with pytest.raises(grpc.RpcError) as exc:
            handshake(secured.executor_address, bad)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
