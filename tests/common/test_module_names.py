"""One module name per job: a file name used in two places names the same kind of thing in
both (each service's settings, each model family's code on each side), never two unrelated
jobs (two stop_checker.py once held stop tokens and stop strings)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("services", "kernels", "llm_mesh")
GENERATED = ("wire", "wire_pb")

SAME_JOB = {
    "service.py": "a service's lifecycle (services/common/service.py: the base class)",
    "settings.py": "a service's or a layer's flags",
    "config.py": "a configuration read at start (runner, model, checkpoint quantization, "
                 "scheduler)",
    "errors.py": "the typed errors of their package",
    "registry.py": "a model family's name -> its implementation",
    "protocol.py": "an OpenAI API's request bodies (chat and completions; Responses)",
    "layers.py": "a model's layers (plain, and their tensor-parallel forms)",
    "reference.py": "torch references that kernels are held to",
    "connector.py": "the KV connector's two sides, vLLM's scheduler and worker roles",
    "cli.py": "a command line (llm-mesh; its bench subcommand)",
    "idefics3.py": "one model family's images: the tokenizer's preprocessing, the worker's "
                   "vision tower",
    "qwen2_vl.py": "one model family's images: the tokenizer's preprocessing, the worker's "
                   "vision tower",
}


def test_no_module_name_is_used_twice_for_different_jobs() -> None:
    places: dict[str, list[str]] = defaultdict(list)
    for top in TOPS:
        for path in (ROOT / top).rglob("*.py"):
            relative = path.relative_to(ROOT)
            if path.name in ("__init__.py", "__main__.py") \
                    or any(part in GENERATED for part in relative.parts):
                continue
            places[path.name].append(str(relative))
    repeated = {name: sorted(paths) for name, paths in places.items() if len(paths) > 1}
    unexplained = {name: paths for name, paths in repeated.items() if name not in SAME_JOB}
    assert not unexplained, unexplained
    assert SAME_JOB.keys() <= repeated.keys(), "a name listed here is used once now: drop it"
