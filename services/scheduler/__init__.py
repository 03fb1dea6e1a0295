"""Scheduler service: one per engine; owns request queues, the KV block pool and the step loop."""
