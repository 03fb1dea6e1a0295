"""The tokenizer service: chat templates, encoding, incremental detokenization, stop strings."""
