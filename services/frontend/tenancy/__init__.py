"""Tenants: API keys, each with its own prefix-cache salt (auth.py) and token bucket
(rate_limit.py), shared by the gateway and the batch runner.
"""
