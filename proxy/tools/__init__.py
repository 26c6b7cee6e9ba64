"""Tools shipped with the gateway: the simulated backend, the demo, the benchmark client."""
