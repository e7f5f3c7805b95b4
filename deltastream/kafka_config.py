"""Kafka client settings every tool shares: bootstrap servers and security (TLS, SASL).

Torch-free and kafka-free (the predictor side and the CLIs import it):

* :func:`check_bootstrap_servers` — the one validator of ``host:port[,host:port…]`` (port
  1..65535, non-empty host, IPv6 in brackets ``[::1]:9092``), used by the CLIs' argparse
  type and by every library entry point (``SyncDaemon``, ``DeltaPublisher``,
  ``TopicReader``, ``ensure_topic``); ``ValueError`` names the value and what is expected.
* :func:`security_config` — kafka-python security settings (``security_protocol``,
  ``sasl_mechanism``, ``sasl_plain_username``/``sasl_plain_password``, ``ssl_cafile``, …)
  from a properties file (``--kafka-config FILE``) and ``DELTASTREAM_KAFKA_*`` environment
  variables, validated (unknown key, bad value, missing file, contradicting settings →
  :class:`~deltastream.errors.KafkaConfigError` naming it). The dict goes as keyword
  arguments to ``SyncDaemon``/``TopicReader``/``DeltaPublisher``/``ensure_topic``.
* :func:`secret_values` / :func:`redacted` — what must never reach a log line.
* :func:`tls_probe` — one TLS handshake with a deadline, because kafka-python 3.0 waits
  forever on a TLS handshake with a plaintext listener.

The properties file is Kafka's ``client.properties`` shape: one ``key=value`` per line,
``#`` or ``!`` comments. Keys are kafka-python names (``security_protocol``) or Kafka's
dotted names (``security.protocol``, ``sasl.username``, ``sasl.jaas.config`` with
``username="…" password="…"``, ``ssl.endpoint.identification.algorithm``). Environment
variables override the file key by key: ``DELTASTREAM_KAFKA_SECURITY_PROTOCOL``,
``…_SASL_MECHANISM``, ``…_SASL_USERNAME``, ``…_SASL_PASSWORD``, ``…_SSL_CAFILE``,
``…_SSL_CERTFILE``, ``…_SSL_KEYFILE``, ``…_SSL_PASSWORD``, ``…_SSL_CRLFILE``,
``…_SSL_CHECK_HOSTNAME``, ``…_SSL_CIPHERS``, ``…_SASL_KERBEROS_SERVICE_NAME``,
``…_SASL_KERBEROS_DOMAIN_NAME``; a tool's own prefix (``DELTASTREAM_SYNC_KAFKA_…``) wins
over the shared one.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import ssl
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union

from deltastream.errors import KafkaConfigError

__all__ = ["check_bootstrap_servers", "split_bootstrap_servers", "bootstrap_list", "security_config",
           "read_properties", "check_security", "secret_values", "redacted", "tls_probe",
           "refused_everywhere", "REFUSED_GRACE_S",
           "SECURITY_SETTINGS", "ENV_NAMES", "KafkaConfigError"]

log = logging.getLogger(__name__)

_EXPECTED = "host:port[,host:port...] with a port in 1..65535 (IPv6 as [addr]:port)"
_HOST = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?$")

BootstrapServers = Union[str, Sequence[str]]


def _check_entry(entry: str) -> tuple[str, int]:
    """``(host, port)`` of one ``host:port``; ValueError with the reason otherwise."""
    if not entry:
        raise ValueError("an empty entry")
    if entry.startswith("["):
        addr, sep, port = entry[1:].partition("]:")
        if not sep:
            raise ValueError(f"{entry!r} has no ']:port' after the IPv6 address")
        try:
            ipaddress.IPv6Address(addr.split("%", 1)[0])
        except ValueError:
            raise ValueError(f"{addr!r} is not an IPv6 address") from None
        host = addr
    else:
        host, sep, port = entry.rpartition(":")
        if not sep:
            raise ValueError(f"{entry!r} has no ':port'")
        if ":" in host:
            raise ValueError(f"{entry!r}: write an IPv6 address in brackets, e.g. "
                             "[::1]:9092")
        if not host:
            raise ValueError(f"{entry!r} has an empty host")
        if not _HOST.match(host):
            raise ValueError(f"host {host!r} is not a host name or address")
    if not port.isdigit() or not port.isascii():
        raise ValueError(f"port {port!r} is not a number")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"port {int(port)} is outside 1..65535")
    return host, int(port)


def split_bootstrap_servers(value: BootstrapServers) -> list[tuple[str, int]]:
    """``[(host, port), …]`` of a bootstrap list (a comma-separated str or a list of
    ``host:port`` str). Raises ``ValueError`` naming the value and what is expected."""
    if isinstance(value, str):
        entries = value.split(",")
    elif isinstance(value, Sequence) and value and all(isinstance(v, str) for v in value):
        entries = list(value)
    else:
        raise ValueError(f"bootstrap servers: expected {_EXPECTED}, got {value!r}")
    out = []
    for entry in entries:
        try:
            out.append(_check_entry(entry.strip()))
        except ValueError as e:
            raise ValueError(f"bootstrap servers {value!r}: {e}; expected {_EXPECTED}") \
                from None
    return out


def bootstrap_list(value: BootstrapServers) -> list[str]:
    """The ``host:port`` entries of a valid bootstrap list, stripped (kafka-python's form)."""
    split_bootstrap_servers(value)
    entries = value.split(",") if isinstance(value, str) else list(value)
    return [e.strip() for e in entries]


def check_bootstrap_servers(value: BootstrapServers) -> BootstrapServers:
    """``value`` unchanged when it is a valid bootstrap list, else ``ValueError`` naming it
    and what is expected (``host:port[,host:port…]``, port 1..65535, IPv6 in brackets)."""
    split_bootstrap_servers(value)
    return value


# --------------------------------------------------------------------------- security

#: kafka-python setting -> kind: "choice:A|B", "str", "secret", "file", "bool"
SECURITY_SETTINGS: dict[str, str] = {
    "security_protocol": "choice:PLAINTEXT|SSL|SASL_PLAINTEXT|SASL_SSL",
    "sasl_mechanism": "choice:PLAIN|SCRAM-SHA-256|SCRAM-SHA-512|GSSAPI|AWS_MSK_IAM",
    "sasl_plain_username": "str",
    "sasl_plain_password": "secret",
    "sasl_kerberos_service_name": "str",
    "sasl_kerberos_domain_name": "str",
    "ssl_cafile": "file",
    "ssl_certfile": "file",
    "ssl_keyfile": "file",
    "ssl_crlfile": "file",
    "ssl_password": "secret",
    "ssl_check_hostname": "bool",
    "ssl_ciphers": "str",
}

#: environment variable suffix (after ``DELTASTREAM_`` or a tool's prefix) per setting
ENV_NAMES: dict[str, str] = {
    name: "KAFKA_" + name.upper() for name in SECURITY_SETTINGS
}
ENV_NAMES["sasl_plain_username"] = "KAFKA_SASL_USERNAME"
ENV_NAMES["sasl_plain_password"] = "KAFKA_SASL_PASSWORD"

# Kafka's (Java client) names and other spellings -> kafka-python names
_ALIASES = {
    "sasl_username": "sasl_plain_username",
    "sasl_password": "sasl_plain_password",
    "ssl_ca_location": "ssl_cafile",
    "ssl_certificate_location": "ssl_certfile",
    "ssl_key_location": "ssl_keyfile",
    "ssl_key_password": "ssl_password",
    "ssl_cipher_suites": "ssl_ciphers",
}
_UNSUPPORTED = {
    "ssl_truststore_location": "JKS/PKCS12 trust stores are not supported by kafka-python: "
                               "export the CA as PEM and set ssl_cafile",
    "ssl_keystore_location": "JKS/PKCS12 key stores are not supported by kafka-python: "
                             "export them as PEM and set ssl_certfile and ssl_keyfile",
    "sasl_oauthbearer_token_endpoint_url": "OAUTHBEARER needs a token provider object: "
                                           "use the Python API (sasl_oauth_token_provider)",
}
_IGNORED = {"ssl_truststore_password", "ssl_truststore_type", "ssl_keystore_password",
            "ssl_keystore_type", "ssl_enabled_protocols", "ssl_protocol"}
_JAAS = re.compile(r'\b(username|password)\s*=\s*"((?:[^"\\]|\\.)*)"')
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _canonical(key: str, where: str) -> Optional[str]:
    """kafka-python name of a file/env key; None for keys that are accepted but unused."""
    k = key.strip().lower().replace(".", "_").replace("-", "_")
    k = _ALIASES.get(k, k)
    if k in SECURITY_SETTINGS or k in ("sasl_jaas_config",
                                       "ssl_endpoint_identification_algorithm"):
        return k
    if k in _UNSUPPORTED:
        raise KafkaConfigError(f"{where}: {key!r}: {_UNSUPPORTED[k]}")
    if k in _IGNORED:
        return None
    known = ", ".join(sorted(SECURITY_SETTINGS))
    raise KafkaConfigError(f"{where}: unknown Kafka setting {key!r}; expected one of "
                           f"{known} (or Kafka's dotted names, e.g. security.protocol)")


def _value(name: str, raw: Any, where: str) -> Any:
    kind = SECURITY_SETTINGS[name]
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text not in _TRUE + _FALSE:
            raise KafkaConfigError(f"{where}: {name}={raw!r}: expected true or false")
        return text in _TRUE
    if not isinstance(raw, str):
        raise KafkaConfigError(f"{where}: {name}: expected a string, got "
                               f"{type(raw).__name__}")
    text = raw if kind == "secret" else raw.strip()
    if kind.startswith("choice:"):
        choices = kind[len("choice:"):].split("|")
        if text.upper() not in choices:
            raise KafkaConfigError(f"{where}: {name}={text!r}: expected one of "
                                   f"{', '.join(choices)}")
        return text.upper()
    if kind == "file":
        if not Path(text).is_file() or not os.access(text, os.R_OK):
            raise KafkaConfigError(f"{where}: {name}={text!r}: not a readable file")
    if not text:
        raise KafkaConfigError(f"{where}: {name} is empty")
    return text


def _put(out: dict, key: str, raw: Any, where: str) -> None:
    name = _canonical(key, where)
    if name is None:
        return
    if name == "sasl_jaas_config":  # Java's login module line: take username and password
        found = dict(_JAAS.findall(str(raw)))
        if not found:
            raise KafkaConfigError(f"{where}: sasl.jaas.config holds no username=\"…\" "
                                   "password=\"…\"")
        if "username" in found:
            out["sasl_plain_username"] = found["username"]
        if "password" in found:
            out["sasl_plain_password"] = found["password"]
        return
    if name == "ssl_endpoint_identification_algorithm":  # Java: "https" checks, "" not
        out["ssl_check_hostname"] = str(raw).strip().lower() == "https"
        return
    out[name] = _value(name, raw, where)


def read_properties(path: Union[str, Path]) -> dict[str, Any]:
    """Security settings from a ``key=value`` properties file (see the module docstring).

    Raises :class:`KafkaConfigError` naming the file (and line) of a bad entry.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KafkaConfigError(f"--kafka-config {str(p)!r}: cannot read it: "
                               f"{e.strerror if isinstance(e, OSError) else e}") from None
    out: dict[str, Any] = {}
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s or s[0] in "#!":
            continue
        key, sep, value = s.partition("=")
        if not sep or not key.strip():
            raise KafkaConfigError(f"{p}:{n}: expected key=value, got a line without '='")
        _put(out, key, value.strip(), f"{p}:{n}")
    return out


def check_security(config: Mapping[str, Any], where: str = "Kafka settings") -> dict:
    """Validate a whole security config: values, and settings that contradict each other
    (SASL settings without a SASL protocol, TLS files without TLS, PLAIN/SCRAM without a
    username and password). Returns a new dict; raises :class:`KafkaConfigError`."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        _put(out, key, value, where)
    proto = out.get("security_protocol")
    sasl = sorted(k for k in out if k.startswith("sasl_"))
    tls = sorted(k for k in out if k.startswith("ssl_"))
    if (sasl or tls) and proto is None:
        raise KafkaConfigError(f"{where}: {', '.join(sasl + tls)} set but no "
                               "security_protocol; set it to SSL, SASL_PLAINTEXT or "
                               "SASL_SSL")
    if proto is not None:
        if sasl and not proto.startswith("SASL_"):
            raise KafkaConfigError(f"{where}: {', '.join(sasl)} set but security_protocol "
                                   f"is {proto}; use SASL_PLAINTEXT or SASL_SSL")
        if tls and proto not in ("SSL", "SASL_SSL"):
            raise KafkaConfigError(f"{where}: {', '.join(tls)} set but security_protocol "
                                   f"is {proto}; use SSL or SASL_SSL")
        if proto.startswith("SASL_"):
            mech = out.get("sasl_mechanism")
            if mech is None:
                raise KafkaConfigError(f"{where}: security_protocol {proto} needs "
                                       "sasl_mechanism (PLAIN, SCRAM-SHA-256, …)")
            if mech in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
                missing = [k for k in ("sasl_plain_username", "sasl_plain_password")
                           if not out.get(k)]
                if missing:
                    raise KafkaConfigError(f"{where}: sasl_mechanism {mech} needs "
                                           f"{' and '.join(missing)}")
    if "ssl_keyfile" in out and "ssl_certfile" not in out:
        raise KafkaConfigError(f"{where}: ssl_keyfile set without ssl_certfile")
    return out


def security_config(file: Optional[Union[str, Path]] = None, *,
                    environ: Optional[Mapping[str, str]] = None,
                    prefixes: Sequence[str] = ("DELTASTREAM_",)) -> dict[str, Any]:
    """kafka-python security kwargs from ``file`` and the environment, validated.

    Each setting is taken from the first of ``<prefix>KAFKA_<NAME>`` (``prefixes`` in
    order, e.g. ``("DELTASTREAM_SYNC_", "DELTASTREAM_")``) that is set, else from the file.
    Returns ``{}`` when nothing is configured (plaintext, no authentication).
    """
    env = os.environ if environ is None else environ
    merged: dict[str, Any] = read_properties(file) if file else {}
    for name, suffix in ENV_NAMES.items():
        for prefix in prefixes:
            var = prefix + suffix
            if var in env:
                merged[name] = _value(name, env[var], var)
                break
    return check_security(merged, f"--kafka-config {str(file)!r}" if file
                          else "Kafka settings")


def secret_values(config: Mapping[str, Any]) -> list[str]:
    """The secret strings of ``config`` (passwords), to keep out of logs."""
    return [str(v) for k, v in config.items()
            if SECURITY_SETTINGS.get(k) == "secret" and v]


def redacted(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with secret values replaced by ``"***"`` (for logs and messages)."""
    return {k: ("***" if SECURITY_SETTINGS.get(k) == "secret" and v else v)
            for k, v in config.items()}


#: seconds a one-shot tool lets a refusing address refuse before it says nothing listens
REFUSED_GRACE_S = 5.0


def refused_everywhere(bootstrap_servers: BootstrapServers, timeout: float = 2.0,
                       grace: float = REFUSED_GRACE_S) -> Optional[str]:
    """One line when every bootstrap server keeps refusing TCP connections for ``grace``
    seconds (nothing listens there: a one-shot tool can say so in seconds instead of
    retrying until its timeout; the grace covers a broker started just before, e.g. in the
    background), else None — also as soon as a server accepts, or one does not answer
    within ``timeout`` seconds (a firewall, a host still starting: the client's own retries
    handle those)."""
    deadline = time.monotonic() + grace
    while True:
        refused = []
        for host, port in split_bootstrap_servers(bootstrap_servers):
            try:
                socket.create_connection((host, port), timeout=timeout).close()
                return None
            except ConnectionRefusedError:
                refused.append(f"{host}:{port}")
            except OSError:
                return None
        if not refused:
            return None
        if time.monotonic() >= deadline:
            return (f"nothing listens on {', '.join(refused)} (connection refused for "
                    f"{grace:g} s)")
        time.sleep(0.2)


def tls_probe(bootstrap_servers: BootstrapServers, config: Mapping[str, Any],
              timeout: float) -> Optional[str]:
    """One TLS handshake with the first bootstrap server that accepts a TCP connection.

    Returns None when TLS is not configured, no server accepts a connection (the client's
    own retries handle a broker that is down) or the handshake succeeds; else one line
    saying why it failed — e.g. a plaintext listener, on which kafka-python would wait
    forever. Certificates are checked as kafka-python checks them.
    """
    if config.get("security_protocol") not in ("SSL", "SASL_SSL"):
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = bool(config.get("ssl_check_hostname", True))
    try:
        if config.get("ssl_cafile"):
            ctx.load_verify_locations(config["ssl_cafile"])
        else:
            ctx.load_default_certs()
        if config.get("ssl_certfile"):
            ctx.load_cert_chain(config["ssl_certfile"], config.get("ssl_keyfile"),
                                config.get("ssl_password"))
    except (OSError, ssl.SSLError) as e:
        return f"cannot load the TLS certificates: {e}"
    for host, port in split_bootstrap_servers(bootstrap_servers):
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError:
            continue  # down or unreachable: not a TLS problem
        try:
            with ctx.wrap_socket(sock, server_hostname=host,
                                 do_handshake_on_connect=False) as tls:
                tls.settimeout(timeout)
                tls.do_handshake()
            return None
        except TimeoutError:
            return (f"TLS handshake with {host}:{port} got no answer within {timeout:g} s: "
                    "is that a plaintext listener? (security_protocol "
                    f"{config['security_protocol']})")
        except (OSError, ssl.SSLError) as e:
            return f"TLS handshake with {host}:{port} failed: {e}"
        finally:
            sock.close()
    return None
