"""Model implementations the worker runs, looked up by the HF config's model_type."""
