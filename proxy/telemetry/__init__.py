"""Logs, traces and metrics about the requests the gateway handles."""
