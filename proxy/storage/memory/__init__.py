"""The storage contracts in this process's memory: the embedded default for one gateway process
(quota, limits, cache, keys)."""
