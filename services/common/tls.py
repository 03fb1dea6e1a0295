"""One way to build a TLS context from PEM files, for NATS (services/common/bus.py) and the
kvstore data plane (services/common/kv_data_plane.py)."""

from __future__ import annotations

import ssl


def tls_context(purpose: ssl.Purpose, ca_file: str, cert_file: str, key_file: str,
                flags: str) -> ssl.SSLContext:
    """Trusts `ca_file` (empty: the system's CAs) to verify the other end and presents
    `cert_file` / `key_file` if given; a file that cannot be read is a ValueError naming
    `flags`, the settings that point at the files."""
    try:
        context = ssl.create_default_context(purpose, cafile=ca_file or None)
        if cert_file:
            context.load_cert_chain(cert_file, key_file or None)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"{exc} (check {flags})") from exc
    return context
