"""The layering rules of the code base, as a checker over a source tree.

- A service package (a folder under services/ other than common and frontend) imports only
  services.common and itself: the wire is the only coupling between services. The gateway
  and the batch runner may also import services.frontend, the request path they share.
- services.frontend (the OpenAI layer and the engine client) imports only services.common
  and itself.
- services.common imports no service, and not the frontend.
- The scheduler's engine core (services/scheduler/core) does no I/O and knows no wire
  types: it imports only itself and services.common.block_hash.
- kernels/ stands on nothing in services/ or llm_mesh/.
- llm_mesh/ (the command line, the launcher, the load generator) starts services as
  processes, never runs their code: of services/ it imports only services.common and each
  service's settings module (the flags it hands on). Nothing in services/ or kernels/
  imports llm_mesh.
- No import cycle: not between packages, not among the files of one package.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

CORE = "services.scheduler.core"
FRONTEND = "services.frontend"
FRONTEND_USERS = ("services.gateway", "services.batch")
CORE_MAY_IMPORT = ("services.common.block_hash",)
LAUNCHER = "llm_mesh"
TOPS = ("services", "kernels", "llm_mesh")


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(root: Path, path: Path) -> set[str]:
    """Every module `path` imports, anywhere in the file (TYPE_CHECKING blocks and function
    bodies included), relative imports resolved."""
    package = module_name(root, path).split(".")
    if path.name != "__init__.py":
        package.pop()
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            # `from services.x import y` names the module services.x.y when there is one.
            for alias in node.names:
                submodule = root / Path(*module.split("."), alias.name)
                is_module = submodule.is_dir() or submodule.with_suffix(".py").exists()
                modules.add(f"{module}.{alias.name}" if is_module else module)
    return modules


def _sources(root: Path, top: str) -> Iterator[Path]:
    yield from sorted((root / top).rglob("*.py")) if (root / top).is_dir() else ()


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layering_violations(root: Path) -> list[str]:
    services_dir = root / "services"
    service_packages = sorted(p.name for p in services_dir.iterdir()
                              if p.is_dir() and (p / "__init__.py").exists()
                              and p.name not in ("common", "frontend"))
    violations = []
    for path in _sources(root, "services"):
        name = module_name(root, path)
        own = ".".join(name.split(".")[:2])
        for module in imported_modules(root, path):
            if not _within(module, "services") or module == "services":
                continue
            target = ".".join(module.split(".")[:2])
            where = f"{path.relative_to(root)} imports {module}"
            if own == "services.common" and target != "services.common":
                violations.append(f"{where} (common imports no service)")
            elif own == FRONTEND and target not in (own, "services.common"):
                violations.append(f"{where} (the frontend imports only common and itself)")
            elif own.split(".")[1] in service_packages and target not in (own, "services.common") \
                    and not (target == FRONTEND and own in FRONTEND_USERS):
                violations.append(f"{where} (a service imports only common and itself)")
            if _within(name, CORE) and not _within(module, CORE) \
                    and not any(_within(module, allowed) for allowed in CORE_MAY_IMPORT):
                violations.append(f"{where} (the engine core imports only itself and "
                                  f"{', '.join(CORE_MAY_IMPORT)})")
    for top in ("services", "kernels"):
        for path in _sources(root, top):
            violations.extend(f"{path.relative_to(root)} imports {module} (services and "
                              f"kernels import nothing of llm_mesh)"
                              for module in imported_modules(root, path)
                              if _within(module, LAUNCHER))
    for path in _sources(root, "kernels"):
        violations.extend(f"{path.relative_to(root)} imports {module} (kernels stand on "
                          f"nothing in services)"
                          for module in imported_modules(root, path)
                          if _within(module, "services"))
    for path in _sources(root, LAUNCHER):
        violations.extend(f"{path.relative_to(root)} imports {module} (llm_mesh imports of "
                          f"services only common and their settings)"
                          for module in imported_modules(root, path)
                          if _within(module, "services") and not _within(module, "services.common")
                          and not _is_settings_module(module))
    return violations


def _is_settings_module(module: str) -> bool:
    parts = module.split(".")
    return len(parts) == 3 and parts[0] == "services" and parts[2] == "settings"


def import_cycles(root: Path, tops: tuple[str, ...] = TOPS) -> list[str]:
    """Every import cycle among the files of the tree, within one package or across several
    (one per strongly connected set of files)."""
    files = {module_name(root, path): path for top in tops for path in _sources(root, top)}
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in files.items():
        edges[name] = {module for module in imported_modules(root, path)
                       if module in files and module != name}
    return [" -> ".join(cycle) for cycle in _cycles(edges)]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component) + [sorted(component)[0]])

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return components
