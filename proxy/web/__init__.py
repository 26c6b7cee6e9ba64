"""HTTP routes: thin ASGI endpoints; the logic lives in the stages."""
