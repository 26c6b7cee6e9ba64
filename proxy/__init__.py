"""tokenweir: an LLM gateway that treats tokens as a resource."""

__version__ = "0.1.0"
__all__ = ["__version__"]
