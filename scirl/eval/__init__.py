"""Evaluation: an async OpenAI-compatible client (``client``), in-process evaluation (``local``),
metrics (``metrics``), the results format and resumable records file (``results``)."""
