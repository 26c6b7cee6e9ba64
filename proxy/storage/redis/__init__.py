"""The storage contracts on Redis, shared by every replica (quota, limits, cache, keys), and how
they reach it: the URL (url), the connections (conn, resp), the one Lua script (link, lua/).

Every module here imports redis-py absolutely (`import redis`), which Python 3 resolves to the
top-level package, never to this one."""
