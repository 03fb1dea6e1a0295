"""Sampling, as vLLM's `v1/sample`: the sampler (sampler.py) over each step's per-row
parameters (sampling_metadata.py), and the grammars of structured outputs: one matcher per
constrained row and the batch's bitmask (structured_outputs.py), started after a reasoning
section where asked (reasoning_gate.py).
"""
