"""loraplex: one base model, many per-tenant LoRA adapters, one OpenAI-compatible endpoint."""

__version__ = "0.1.0"
