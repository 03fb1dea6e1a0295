"""The frontend: the request path that the gateway and the batch runner both stand on, as
vLLM's `entrypoints/openai` and `v1/engine` (the engine client) are.

    openai/         the OpenAI API: request models, the chat / completions / Responses
                    handlers, sampling validation, tool and reasoning parsers
    engine_client/  the mesh client: encode with a tokenizer, submit to an engine, follow
                    its output, move a request whose engine or tokenizer is lost
    router/         which engine serves a request: prefix index, cost, sessions
    tenancy/        API keys, their cache salts and token buckets
    batch_jobs/     the batch plane (job records, JetStream store) of /v1/batches and the
                    batch runner

The gateway serves these handlers over HTTP; the batch runner calls them in process for each
batch line. Neither service imports the other: both import this package, which stands only
on services/common (tests/common/import_rules.py).
"""
