"""The `llm-mesh` command line."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from llm_mesh.service_modules import SERVICE_MODULES

USAGE = """llm-mesh <command> [options]

commands:
  up                  start the whole mesh on this machine (embedded NATS and Redis, every
                      service)
  serve <service>     run one service: gateway | batch | tokenizer | scheduler | worker |
                      kvstore
  bench serve         load-test any OpenAI-compatible server (throughput, TTFT, ITL, plot)
  version             print the version

`llm-mesh <command> --help` lists each command's options.
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = args[0], args[1:]
    if command == "up":
        from llm_mesh.launcher import main as up_main
        return up_main(rest)
    if command == "serve":
        parser = argparse.ArgumentParser(prog="llm-mesh serve")
        parser.add_argument("service", choices=list(SERVICE_MODULES))
        if not rest or rest[0] in ("-h", "--help"):
            parser.print_help()
            return 0
        service = parser.parse_args(rest[:1]).service
        importlib.import_module(f"{SERVICE_MODULES[service]}.__main__").main(rest[1:])
        return 0
    if command == "bench":
        from llm_mesh.bench.cli import main as bench_main
        return bench_main(rest)
    if command == "version":
        from importlib.metadata import version
        print(version("llm-mesh"))
        return 0
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
