"""`python -m services.tokenizer` (what `llm-mesh serve tokenizer` runs)."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.service import run_service
from services.common.settings import parse_settings
from services.tokenizer.service import TokenizerService
from services.tokenizer.settings import TokenizerSettings


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(TokenizerSettings, argv, prog="llm-mesh serve tokenizer",
                              description="Chat templates, encoding, detokenization, stop strings.")
    run_service(TokenizerService(settings))


if __name__ == "__main__":
    main()
