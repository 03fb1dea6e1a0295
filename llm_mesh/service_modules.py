"""Which module runs each service: `llm-mesh serve <service>` and `llm-mesh up` start
`python -m <module>`. Every service is its own package, the batch runner included."""

SERVICE_MODULES = {
    "gateway": "services.gateway",
    "batch": "services.batch",
    "tokenizer": "services.tokenizer",
    "scheduler": "services.scheduler",
    "worker": "services.worker",
    "kvstore": "services.kvstore",
}
