"""Throwaway certificates for the TLS tests, from a trustme CA, written as PEM files."""

from __future__ import annotations

from pathlib import Path

import trustme


def issue(ca: trustme.CA, identity: str, directory: Path, name: str) -> tuple[str, str, str]:
    """A certificate for `identity` (a host name or IP) signed by `ca`: writes
    <name>-ca.pem, <name>.pem and <name>-key.pem; returns their paths in that order."""
    paths = tuple(str(directory / f"{name}{suffix}.pem") for suffix in ("-ca", "", "-key"))
    cert = ca.issue_cert(identity)
    ca.cert_pem.write_to_path(paths[0])
    cert.cert_chain_pems[0].write_to_path(paths[1])
    cert.private_key_pem.write_to_path(paths[2])
    return paths
