"""No service imports another service's package: the wire is their only coupling."""

import ast
from pathlib import Path

SERVICES_DIR = Path(__file__).resolve().parents[2] / "services"
SERVICE_PACKAGES = sorted(p.name for p in SERVICES_DIR.iterdir()
                          if p.is_dir() and (p / "__init__.py").exists() and p.name != "common")


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return modules


def test_services_import_only_common_and_themselves() -> None:
    assert {"gateway", "tokenizer", "scheduler", "worker"} <= set(SERVICE_PACKAGES)
    violations = []
    for package in SERVICE_PACKAGES:
        for path in (SERVICES_DIR / package).rglob("*.py"):
            for module in imported_modules(path):
                parts = module.split(".")
                if parts[0] == "services" and len(parts) > 1 and parts[1] not in (package, "common"):
                    violations.append(f"{path.relative_to(SERVICES_DIR.parent)} imports {module}")
    assert not violations, "\n".join(violations)


def test_common_imports_no_service() -> None:
    violations = [
        f"{path.name} imports {module}"
        for path in (SERVICES_DIR / "common").rglob("*.py")
        for module in imported_modules(path)
        if module.startswith("services.") and not module.startswith("services.common")
    ]
    assert not violations, "\n".join(violations)
