"""Speculative decoding in the worker: proposers write draft tokens into the persistent batch
after sampling; the verifier checks the drafts the next step runs (docs/architecture.md)."""
