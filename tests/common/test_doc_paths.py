"""docs/architecture.md's path of a request is code too: every `file: function` its tables
name exists, so a newcomer following the tables never looks for a function that moved."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs/architecture.md"
SECTION = "## The path of a request"
COLUMN = "file: function"
SPAN = re.compile(r"`([^`]+)`")


def path_tables(text: str) -> list[list[dict[str, str]]]:
    """The markdown tables of the section, each as its rows (header -> cell)."""
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    tables, header = [], None
    for line in section.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            tables.append([])
        elif not set("".join(cells)) <= set("-: "):
            tables[-1].append(dict(zip(header, cells)))
    return tables


def named_functions(cell: str) -> list[tuple[str, str]]:
    """(file, name) for each `file: name` in a cell; a bare `name` is in the file named
    before it in the cell."""
    named, last_file = [], None
    for span in SPAN.findall(cell):
        if ": " in span:
            last_file, name = span.split(": ", 1)
        else:
            name = span
        assert last_file is not None, f"{span!r} names no file before it"
        named.append((last_file, name))
    return named


def defines(module: ast.Module, name: str) -> bool:
    """A function or class `name` (at any depth: a route inside create_app counts), or a
    method `Class.method` of a top-level class."""
    if "." in name:
        class_name, method = name.split(".", 1)
        return any(isinstance(node, ast.ClassDef) and node.name == class_name
                   and any(isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                           and item.name == method for item in node.body)
                   for node in module.body)
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
               and node.name == name for node in ast.walk(module))


def test_the_section_has_the_request_path_and_what_lies_beside_it() -> None:
    tables = path_tables(DOC.read_text())
    assert len(tables) == 2 and all(COLUMN in rows[0] for rows in tables)
    assert [row["#"] for row in tables[0]] == [str(i) for i in range(1, len(tables[0]) + 1)]


def test_every_file_and_function_the_path_names_exists() -> None:
    missing, modules = [], {}
    for rows in path_tables(DOC.read_text()):
        for row in rows:
            for file, name in named_functions(row[COLUMN]):
                path = ROOT / file
                if not path.is_file():
                    missing.append(f"{file} (no such file)")
                    continue
                module = modules.setdefault(file, ast.parse(path.read_text()))
                if not defines(module, name):
                    missing.append(f"{file}: {name}")
    assert not missing, missing


def test_a_renamed_function_is_caught() -> None:
    text = DOC.read_text().replace("RequestRun.start", "RequestRun.begin", 1)
    cell = next(row[COLUMN] for row in path_tables(text)[0] if "RequestRun.begin" in row[COLUMN])
    file, name = next(pair for pair in named_functions(cell) if pair[1] == "RequestRun.begin")
    assert not defines(ast.parse((ROOT / file).read_text()), name)
