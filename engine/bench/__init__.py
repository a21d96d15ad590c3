"""Benchmarks: metrale against transformers in the same process. A leaf: only
``metrale.cli`` imports it (``python -m metrale.engine.bench.<name>`` runs the
stand-alone ones)."""
