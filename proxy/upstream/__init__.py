"""Talking to backends: the shared connection pool, SSE pass-through and the stream meter."""
