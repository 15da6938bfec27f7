"""sluiceway: a streaming-first, OpenAI-compatible LLM inference server."""

__version__ = "0.1.0"
