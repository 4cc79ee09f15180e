"""CURVE keys for a client: the server's public certificate and this client's own.

Certificates are the files ``zmq.auth.create_certificates`` writes: ``NAME.key``
(public) and ``NAME.key_secret`` (public and secret). A daemon on a non-loopback
tcp endpoint requires CURVE and accepts only clients whose public certificate
sits in its ``server.curve_authorized_keys`` folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq.auth

SERVER_KEY_ENV = "KVMUX_CURVE_SERVER_KEY"
CLIENT_KEY_ENV = "KVMUX_CURVE_CLIENT_KEY"

CurveKeys = tuple[bytes, bytes, bytes]  # server public, client public, client secret


def load_curve(server_cert: Path | str, client_secret_cert: Path | str) -> CurveKeys:
    """Keys for :class:`~kvmux.client.Client`'s ``curve`` argument; errors name the file."""
    server_public, _ = zmq.auth.load_certificate(server_cert)
    public, secret = zmq.auth.load_certificate(client_secret_cert)
    if secret is None:
        raise ValueError(
            f"{client_secret_cert} holds no secret key: pass the client's *.key_secret file"
        )
    return server_public, public, secret


def curve_from_env() -> CurveKeys | None:
    """Keys from ``$KVMUX_CURVE_SERVER_KEY`` and ``$KVMUX_CURVE_CLIENT_KEY``, if both are set."""
    server, client = os.environ.get(SERVER_KEY_ENV), os.environ.get(CLIENT_KEY_ENV)
    if not server or not client:
        return None
    return load_curve(server, client)
