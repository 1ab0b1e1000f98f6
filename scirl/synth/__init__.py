"""Made-up data and models for a machine without a hub: SciKnowEval-schema questions (``questions``),
rows in the other sets' hub schemas (``other_formats``) and tiny Qwen3 models (``tiny_model``), for the
tests, the demo and the benchmarks.

May import: the base modules and ``scirl.task``.
"""
