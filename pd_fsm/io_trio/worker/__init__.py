"""The worker process: HTTP API over a scheduler backend (colocated, prefill or decode)."""
