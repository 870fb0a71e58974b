"""The OpenAI-compatible server and its demo adapters."""
