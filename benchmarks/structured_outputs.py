"""What structured outputs cost a worker step: the grammar bitmask of a batch of constrained
rows, filled and applied once over the batch (the worker's own code path:
services/worker/sampling/structured_outputs.py fills, the sampler applies with its apply_bitmask),
then each matcher advanced by its token. xgrammar's own CPU kernel applies the same mask
beside it, for comparison (the results are checked equal).

Every row of the batch is constrained (the worst case) by the same grammar, as agents
re-sending one schema are; each step draws fresh random logits, masks them, takes the
argmax and feeds it to the matchers, so rows walk through their grammars' states (inside
strings most of the vocabulary is allowed, between fields a handful of tokens). A row
whose grammar ended starts again. CPU, the embedded SmolLM2 vocabulary (49,152 tokens).

    .venv/bin/python -m benchmarks.structured_outputs [--batch 32 --steps 200]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
import xgrammar as xgr

from benchmarks.harness import distribution, markdown_table, print_preamble, progress
from services.common import wire
from services.common.model_files import resolve_model
from services.worker.models.config import ModelConfig
from services.worker.sampling.structured_outputs import (
    StructuredOutputs,
    apply_bitmask,
    load_tokenizer_info,
)

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "format": "email"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
    "required": ["name", "age", "email", "tags"]}
GRAMMARS = {
    "JSON schema (4 fields)": wire.GrammarSpec(kind=wire.GrammarKind.JSON_SCHEMA,
                                               spec=json.dumps(PERSON)),
    "json_object": wire.GrammarSpec(kind=wire.GrammarKind.JSON_SCHEMA, spec='{"type":"object"}'),
    "choice of 3": wire.GrammarSpec(kind=wire.GrammarKind.EBNF,
                                    spec='root ::= "positive" | "negative" | "neutral"'),
}
COLUMNS = {"fill": "fill", "apply": "apply", "accept": "accept",
           "total": "per step (fill + apply + accept)",
           "xgrammar": "apply by xgrammar's CPU kernel"}


def measure(spec: wire.GrammarSpec, batch: int, steps: int, vocab_size: int, eos: list[int],
            load_info: Callable[[], xgr.TokenizerInfo]) -> dict[str, list[float]]:
    structured = StructuredOutputs(load_info, batch, vocab_size, cache_size=4)
    max_len = steps + 2
    token_ids = np.zeros((batch, max_len), dtype=np.int32)
    num_tokens = np.ones(batch, dtype=np.int32)            # one prompt token per row
    rows = np.arange(batch)
    for row in rows.tolist():
        structured.add_request(row, spec, 1)
    structured.wait_compiled()
    structured.fill_bitmask(rows, token_ids, num_tokens)   # first matchers: warm-up
    generator = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {key: [] for key in COLUMNS}
    for _ in range(steps):
        logits = torch.randn(batch, vocab_size, generator=generator)
        by_xgrammar = logits.clone()
        started = time.perf_counter()
        mask = structured.fill_bitmask(rows, token_ids, num_tokens)
        filled = time.perf_counter()
        assert mask is not None
        apply_bitmask(logits, mask)
        applied = time.perf_counter()
        xgr.apply_token_bitmask_inplace(by_xgrammar, mask.bitmask, indices=mask.indices)
        times["xgrammar"].append(time.perf_counter() - applied)
        assert torch.equal(logits, by_xgrammar)
        sampled = logits.argmax(dim=-1).numpy().astype(np.int32)
        token_ids[rows, num_tokens] = sampled
        num_tokens += 1
        before_accept = time.perf_counter()
        structured.accept_tokens(rows, sampled)
        accepted = time.perf_counter()
        for row in np.flatnonzero(np.isin(sampled, eos)).tolist():   # grammar ended: again
            structured.remove_request(row)
            structured.add_request(row, spec, int(num_tokens[row]))
        times["fill"].append(filled - started)
        times["apply"].append(applied - filled)
        times["accept"].append(accepted - before_accept)
        times["total"].append(applied - started + accepted - before_accept)
    structured.close()
    return times


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    print_preamble()
    model_dir = resolve_model("").hf_dir
    config = ModelConfig.from_hf_dir(model_dir)
    eos = list(config.eos_token_ids)
    started = time.perf_counter()
    info = load_tokenizer_info(model_dir, config.vocab_size, eos)
    print(f"tokenizer info: {time.perf_counter() - started:.2f} s; torch threads "
          f"{torch.get_num_threads()}; batch {args.batch}, {args.steps} steps, vocabulary "
          f"{config.vocab_size}")
    table = []
    for name, spec in GRAMMARS.items():
        progress(name)
        times = measure(spec, args.batch, args.steps, config.vocab_size, eos, lambda: info)
        cells = [distribution(times[key]) for key in COLUMNS]
        table.append([name] + [f"{d.p50:.2f} / {d.p99:.2f}" for d in cells])
    print(markdown_table(["every row constrained by"] + [f"{title} ms P50 / P99"
                                                         for title in COLUMNS.values()], table))


if __name__ == "__main__":
    main()
