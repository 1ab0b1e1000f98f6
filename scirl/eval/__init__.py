"""Evaluation: an async OpenAI-compatible client (``client``), in-process evaluation (``local``),
accuracies, confidence intervals and paired comparisons (``stats``), letter bias (``letters``), option
permutations (``permutations``), the results format and resumable records file (``results``).

May import: the base modules, ``scirl.task`` and ``scirl.inference``.
"""
