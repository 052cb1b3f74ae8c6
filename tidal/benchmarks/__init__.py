"""Benchmarks: `tidal bench throughput` (offline engine throughput, optionally beside Hugging Face
transformers) and `tidal bench serve` (an OpenAI-compatible server under load)."""
