-- Whether a mark is set: KEYS[1] the mark. Returns 1 or 0.
return redis.call('EXISTS', KEYS[1])
