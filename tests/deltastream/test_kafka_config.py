"""Bootstrap servers are validated in one place; TLS/SASL settings come from a properties
file and the environment, are checked, reach every Kafka client's kwargs, never a log."""

from __future__ import annotations

import logging

import kafka
import kafka.errors
import pytest

from deltastream.clilog import RedactSecrets
from deltastream.errors import KafkaConfigError
from deltastream.kafka_config import (
    bootstrap_list,
    check_bootstrap_servers,
    redacted,
    secret_values,
    security_config,
    tls_probe,
)


@pytest.mark.parametrize("value", ["kafka:9092", "a:1,b:65535", " a:1 , b:2 ", "[::1]:9092",
                                   "10.0.0.1:9092,[fe80::1%eth0]:9093", ["h1:1", "h2:2"],
                                   "my-broker.example.com:9092"])
def test_valid_bootstrap_servers(value):
    assert check_bootstrap_servers(value) == value
    assert all(":" in e for e in bootstrap_list(value))


@pytest.mark.parametrize("value, why", [
    ("127.0.0.1:abc", "port 'abc' is not a number"),
    ("127.0.0.1:99999", "port 99999 is outside 1..65535"),
    ("127.0.0.1:0", "port 0 is outside 1..65535"),
    (":9092", "empty host"),
    ("kafka", "has no ':port'"),
    ("::1:9092", "in brackets"),
    ("[::zz]:9092", "not an IPv6 address"),
    ("a:1,,b:2", "an empty entry"),
    ("", "an empty entry"),
    ("ho st:1", "not a host name"),
    ([], "expected host:port"),
    (9092, "expected host:port"),
])
def test_invalid_bootstrap_servers_name_the_value_and_what_is_expected(value, why):
    with pytest.raises(ValueError) as e:
        check_bootstrap_servers(value)
    text = str(e.value)
    assert why in text and repr(value) in text and "host:port" in text


def test_library_entry_points_validate_bootstrap_the_same_way(tmp_path):
    from consumers.sync import SyncDaemon
    from consumers.topic import TopicReader
    from deltastream.publishing.publisher import DeltaPublisher
    from deltastream.publishing.topics import ensure_topic

    bad = "127.0.0.1:99999"
    calls = [
        lambda: SyncDaemon(bad, "deltas.m", model="m", state_dir=tmp_path / "s"),
        lambda: TopicReader(bad, "deltas.m"),
        lambda: DeltaPublisher(bad, "deltas.m", model="m", shard=0),
        lambda: ensure_topic(bad, "deltas.m", 1),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"'127\.0\.0\.1:99999': port 99999 is outside"):
            call()
    assert not (tmp_path / "s").exists()  # refused before touching the disk


# --------------------------------------------------------------------------- security


def _props(tmp_path, text: str):
    p = tmp_path / "client.properties"
    p.write_text(text)
    return p


def test_properties_file_with_kafka_names_and_jaas(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    p = _props(tmp_path, f"""# Kafka's client.properties shape
security.protocol=sasl_ssl
sasl.mechanism=SCRAM-SHA-512
sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required \
username="svc" password="p=w \\"x\\"";
ssl.cafile = {ca}
! another comment style
ssl.endpoint.identification.algorithm=
ssl.truststore.type=PEM
""")
    cfg = security_config(p, environ={})
    assert cfg == {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
                   "sasl_plain_username": "svc", "sasl_plain_password": 'p=w \\"x\\"',
                   "ssl_cafile": str(ca), "ssl_check_hostname": False}
    assert secret_values(cfg) == ['p=w \\"x\\"']
    assert redacted(cfg)["sasl_plain_password"] == "***"
    assert redacted(cfg)["sasl_plain_username"] == "svc"


def test_environment_overrides_the_file_and_the_tool_prefix_wins(tmp_path):
    p = _props(tmp_path, "security_protocol=SASL_PLAINTEXT\nsasl_mechanism=PLAIN\n"
                         "sasl_plain_username=from-file\nsasl_plain_password=file-pw\n")
    env = {"DELTASTREAM_KAFKA_SASL_USERNAME": "shared-user",
           "DELTASTREAM_KAFKA_SASL_PASSWORD": "shared-pw",
           "DELTASTREAM_SYNC_KAFKA_SASL_PASSWORD": "sync-pw"}
    cfg = security_config(p, environ=env, prefixes=("DELTASTREAM_SYNC_", "DELTASTREAM_"))
    assert cfg["sasl_plain_username"] == "shared-user"
    assert cfg["sasl_plain_password"] == "sync-pw"
    # another tool's variable is not read
    cfg = security_config(p, environ={"DELTASTREAM_REPLAY_KAFKA_SASL_PASSWORD": "x"},
                          prefixes=("DELTASTREAM_SYNC_", "DELTASTREAM_"))
    assert cfg["sasl_plain_password"] == "file-pw"
    assert security_config(None, environ={}) == {}


@pytest.mark.parametrize("text, env, words", [
    ("security.protocol=SSL\nssl.cafle=/x\n", {}, ["unknown Kafka setting 'ssl.cafle'",
                                                   "ssl_cafile"]),
    ("security.protocol=TLS\n", {}, ["security_protocol='TLS'", "SASL_SSL"]),
    ("security.protocol=SSL\nssl.cafile=/nonexistent/ca.pem\n", {},
     ["ssl_cafile='/nonexistent/ca.pem'", "not a readable file"]),
    ("security.protocol=SASL_SSL\n", {}, ["needs sasl_mechanism"]),
    ("security.protocol=SASL_PLAINTEXT\nsasl.mechanism=PLAIN\nsasl.username=u\n", {},
     ["needs sasl_plain_password"]),
    ("sasl.mechanism=PLAIN\n", {}, ["no security_protocol"]),
    ("security.protocol=PLAINTEXT\nsasl.mechanism=PLAIN\n", {}, ["security_protocol is "
                                                                  "PLAINTEXT"]),
    ("ssl.truststore.location=/t.jks\n", {}, ["not supported by kafka-python", "PEM"]),
    ("just a line\n", {}, [":1:", "key=value"]),
    ("", {"DELTASTREAM_KAFKA_SSL_CHECK_HOSTNAME": "maybe"},
     ["DELTASTREAM_KAFKA_SSL_CHECK_HOSTNAME", "true or false"]),
])
def test_bad_settings_are_refused_naming_them(tmp_path, text, env, words):
    with pytest.raises(KafkaConfigError) as e:
        security_config(_props(tmp_path, text), environ=env)
    for w in words:
        assert w in str(e.value)


def test_a_missing_config_file_is_named(tmp_path):
    with pytest.raises(KafkaConfigError, match="nope.properties.*cannot read"):
        security_config(tmp_path / "nope.properties", environ={})


def _recorder(calls: list, name: str):
    class Recorder:
        DEFAULT_CONFIG = getattr(kafka, name).DEFAULT_CONFIG

        def __init__(self, **kwargs):
            calls.append((name, kwargs))
            raise kafka.errors.KafkaTimeoutError("recorded")

    return Recorder


SASL = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN",
        "sasl_plain_username": "u", "sasl_plain_password": "pw"}


def test_settings_reach_every_kafka_client(monkeypatch, tmp_path):
    """The dict from security_config goes as keyword arguments to SyncDaemon, TopicReader,
    DeltaPublisher and ensure_topic; each hands it to its kafka-python client."""
    from consumers.sync import SyncDaemon
    from consumers.topic import BrokerUnavailable, TopicReader
    from deltastream.errors import PublishError
    from deltastream.publishing.publisher import DeltaPublisher
    from deltastream.publishing.topics import ensure_topic

    calls: list = []
    for name in ("KafkaConsumer", "KafkaProducer", "KafkaAdminClient"):
        monkeypatch.setattr(kafka, name, _recorder(calls, name))
    monkeypatch.setattr("consumers.topic.KafkaConsumer", _recorder(calls, "KafkaConsumer"))
    servers = "127.0.0.1:1"

    with pytest.raises(BrokerUnavailable):
        TopicReader(servers, "deltas.m", timeout=1, **SASL)
    with pytest.raises(PublishError):
        ensure_topic(servers, "deltas.m", 1, timeout=1, **SASL)
    with pytest.raises(PublishError):
        DeltaPublisher(servers, "deltas.m", model="m", shard=0, send_timeout=1, **SASL)
    d = SyncDaemon(servers, "deltas.m", model="m", state_dir=tmp_path, summary_interval=0,
                   **SASL)
    try:
        d.run_for(seconds=0.5)
    finally:
        d.stop()
    kinds = {n for n, _ in calls}
    assert {"KafkaConsumer", "KafkaAdminClient"} <= kinds
    assert len([n for n, _ in calls if n == "KafkaConsumer"]) >= 2  # reader and daemon
    for name, kwargs in calls:
        for k, v in SASL.items():
            assert kwargs.get(k) == v, (name, k)


def test_tls_probe_names_a_plaintext_listener_instead_of_hanging():
    """kafka-python 3.0 waits forever on a TLS handshake with a plaintext listener."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    held = []
    threading.Thread(target=lambda: held.append(srv.accept()), daemon=True).start()
    port = srv.getsockname()[1]
    try:
        why = tls_probe(f"127.0.0.1:{port}", {"security_protocol": "SSL"}, 0.5)
        assert why and "no answer within 0.5 s" in why and "plaintext listener" in why
        assert tls_probe(f"127.0.0.1:{port}", {}, 0.5) is None  # no TLS configured
    finally:
        srv.close()
        for conn, _ in held:
            conn.close()


def test_secrets_are_redacted_in_log_lines(caplog):
    f = RedactSecrets(["hunter2"])
    rec = logging.LogRecord("kafka.admin", logging.DEBUG, __file__, 1,
                            "Starting with configuration: %s", ({"pw": "hunter2"},), None)
    assert f.filter(rec)
    assert "hunter2" not in rec.getMessage() and "***" in rec.getMessage()


def test_library_clients_refuse_tls_to_a_plaintext_listener_quickly(broker, tmp_path):
    """Without the probe, kafka-python 3.0 hangs forever in the client's constructor."""
    import time

    from consumers.topic import BrokerUnavailable, TopicReader
    from deltastream.errors import PublishError
    from deltastream.publishing.publisher import DeltaPublisher
    from deltastream.publishing.topics import ensure_topic

    tls = {"security_protocol": "SSL", "ssl_check_hostname": False}
    servers = broker.bootstrap_servers
    t0 = time.monotonic()
    with pytest.raises(BrokerUnavailable, match="TLS handshake"):
        TopicReader(servers, "deltas.m", timeout=1, **tls)
    with pytest.raises(PublishError, match="TLS handshake"):
        ensure_topic(servers, "deltas.m", 1, timeout=1, **tls)
    with pytest.raises(PublishError, match="TLS handshake"):
        DeltaPublisher(servers, "deltas.m", model="m", shard=0, send_timeout=1, **tls)
    # the daemon keeps serving, reports the broker as disconnected and still stops
    from consumers.sync import SyncDaemon

    d = SyncDaemon(servers, "deltas.m", model="m", state_dir=tmp_path, request_timeout=1,
                   summary_interval=0, **tls)
    try:
        d.run_for(seconds=1.5)
        assert d.stats()["broker"] == "disconnected"
    finally:
        d.stop()
    assert time.monotonic() - t0 < 30
