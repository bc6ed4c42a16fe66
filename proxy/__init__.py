"""kvgate: a token-aware admission proxy that enforces a KV-cache ceiling."""

__version__ = "0.1.0"
