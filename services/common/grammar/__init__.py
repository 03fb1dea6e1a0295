"""Structured outputs' grammars, shared by the two services that compile them: the tokenizer
(at encode time, so a bad or hostile grammar is a 400 before any engine sees it) and the
worker (which keeps a matcher per constrained row). Both compile with xgrammar through one
bounded LRU cache (grammar_cache.py) after the same checks (spec_check.py)."""
