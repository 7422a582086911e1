"""Where the server listens: the host resolved, the TLS files checked, the port bound, each
with an error that names what is wrong and how to fix it.

gRPC reports every one of these as "failed to bind" (a TLS key that does not match its
certificate included), so they are checked here first with the standard library.
"""

from __future__ import annotations

import errno
import socket
import ssl

import grpc

from physis_ros.cli_errors import RuntimeFailure, UsageError


def resolve(host: str) -> None:
    """Raises UsageError when ``host`` is not a name or address this machine resolves."""
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise UsageError(
            f"host {host!r} does not resolve ({getattr(exc, 'strerror', None) or exc})",
            "give an address of this machine (127.0.0.1, 0.0.0.0) or a name it resolves "
            "(--host / frontend.host)",
        ) from exc


def tls_credentials(
    cert_path: str, key_path: str, client_ca_path: str | None
) -> grpc.ServerCredentials:
    """Server credentials from PEM files, checked: readable, PEM, the key the certificate's."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert_path, key_path)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or "mismatch" in str(exc).lower():
            raise UsageError(
                f"TLS key {key_path} does not match certificate {cert_path}",
                "pass the private key the certificate was issued for (--tls-key)",
            ) from exc
        raise UsageError(
            f"TLS certificate {cert_path} or key {key_path} is not usable PEM ({exc.reason})",
            "pass PEM files: the certificate chain (--tls-cert) and its private key (--tls-key)",
        ) from exc
    client_ca = None
    if client_ca_path is not None:
        try:
            context.load_verify_locations(client_ca_path)
        except ssl.SSLError as exc:
            raise UsageError(
                f"TLS client CA {client_ca_path} is not a PEM certificate ({exc.reason})",
                "pass the CA certificate (PEM) that client certificates chain to",
            ) from exc
        with open(client_ca_path, "rb") as f:
            client_ca = f.read()
    with open(key_path, "rb") as f:
        key = f.read()
    with open(cert_path, "rb") as f:
        cert = f.read()
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def check_address(host: str, port: int) -> None:
    """Raises the error ``bind`` would (host does not resolve, port taken or privileged),
    before a long start-up rather than after it."""
    resolve(host)
    refusal = _bind_refusal(host, port) if port != 0 else None
    if refusal is not None:
        raise refusal


def bind(server: grpc.Server, host: str, port: int, credentials=None) -> int:
    """Binds ``host:port`` (secure with ``credentials``); returns the bound port or raises
    an error that says why gRPC could not bind."""
    check_address(host, port)  # first with a plain socket: gRPC logs its own complaint
    address = f"{host}:{port}"
    try:
        if credentials is not None:
            bound = server.add_secure_port(address, credentials)
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError:  # grpcio raises where older versions returned 0
        bound = 0
    if bound == 0:
        raise _bind_refusal(host, port) or RuntimeFailure(
            f"gRPC cannot bind {host}:{port} (a plain socket can)",
            "rerun with GRPC_VERBOSITY=debug for gRPC's reason",
        )
    return bound


def _bind_refusal(host: str, port: int) -> Exception | None:
    """Why a socket cannot bind ``host:port`` as gRPC would (SO_REUSEADDR), or None."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return RuntimeFailure(
                f"port {port} on {host} is in use by another process",
                f"stop that process (`ss -ltnp 'sport = :{port}'` names it) or choose another "
                "--port (0: any free port, see --port-file)",
            )
        if exc.errno == errno.EACCES:
            return UsageError(
                f"port {port} on {host} needs privileges this process lacks",
                "choose a port >= 1024",
            )
        if exc.errno == errno.EADDRNOTAVAIL:
            return UsageError(
                f"{host} is not an address of this machine",
                "bind one of its addresses, 0.0.0.0 (all) or 127.0.0.1 (--host)",
            )
        return RuntimeFailure(f"cannot bind {host}:{port}: {exc.strerror}", "")
    return None
