"""Names the dead-code scan (tests/common/test_dead_code.py) cannot see used: what a
framework reads by name. Each line uses the name, which is all vulture needs; nothing here
runs. Dead code is never added here: delete it instead."""

# ruff: noqa
# mypy: ignore-errors
_ = None

# Pydantic models whose fields are the OpenAI API's shapes (serialized, never read here).
_.reasoning_tokens, _.input_tokens_details, _.output_tokens_details
_.in_progress_at, _.failed_at, _.expired_at, _.cancelling_at
# Request fields OpenAI clients send that change nothing here (a tool's `strict`: every
# forced call is enforced anyway).
_.strict
# Pydantic models and enums a test hands an agent library, which reads them by name.
_.RED, _.GREEN, _.BLUE, _.color, _.weight_grams, _.degrees
# uvicorn.Server hooks the gateway (and the bench stub server) override or set.
_.capture_signals, _.should_exit
# transformers reads it from a config: the tiny test checkpoints ask for eager attention.
_._attn_implementation
# A model config read from HF's config.json: kept whole so it describes the model.
_.hidden_size, _.intermediate_size
# nn.Linear's attribute names, which torch tooling (and a reader) expects on a linear layer.
_.in_features, _.out_features
# kernels/__init__.py: the module's lazy attribute access (PEP 562).
_.__getattr__, _.__dir__
# A Triton kernel's stride arguments come as a set, one per dimension, used or not.
_.stride_co
# http.server calls a request handler's do_GET by name (tests/tokenizer/multimodal).
_.do_GET
# tokenizers' PreTrainedTokenizerFast reads it (tests/bench/tiny_tokenizer.py).
_.pre_tokenizer
# hypothesis RuleBasedStateMachine rules and invariants, called by name.
_.preempt, _.pool_is_consistent, _.teardown
# llm-mesh bench's metrics: a latency field reported by name.
_.e2el
# Python reads an instance's class on every call: benchmarks/mixed_step.py swaps in a timing
# subclass on the linears it times.
_.__class__
# pickle's Pickler / Unpickler hooks, called by name (services/worker/parallel/commands.py).
_.persistent_id, _.persistent_load
# asyncio.Protocol's callbacks, which the event loop calls by name (the step channel's client).
_.connection_made, _.data_received, _.connection_lost
