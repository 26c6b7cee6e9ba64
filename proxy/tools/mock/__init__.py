"""`tokenweir mock-backend`: the simulated OpenAI-compatible backend (backend.py) and its parts."""
