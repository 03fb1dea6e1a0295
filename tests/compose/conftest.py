"""Compose fixtures: the throwaway certificates of the TLS overlays."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.compose.model import ROOT

CERT_HOSTS = ["host-a", "host-b", "host-c"]   # the multihost overlay's default host names


@pytest.fixture
def dev_certs(tmp_path: Path) -> Path:
    """What scripts/make_dev_certs.sh writes, as a user of the TLS overlays runs it (naming
    the multihost overlay's machines)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: scripts/make_dev_certs.sh needs it")
    subprocess.run(["bash", str(ROOT / "scripts" / "make_dev_certs.sh"), str(tmp_path / "tls"),
                    *CERT_HOSTS], check=True, capture_output=True, timeout=60)
    return tmp_path / "tls"
