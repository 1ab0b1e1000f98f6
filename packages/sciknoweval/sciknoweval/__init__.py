"""SciKnowEval MCQ as a verifiers v1 taskset: `id = "sciknoweval"` in a prime-rl or verifiers config.

verifiers resolves the id by importing this package and taking the one
`Taskset` subclass in `__all__`; the config class comes from its generic
parameters. Exporting a second Taskset subclass here would make that lookup fail.
"""

from sciknoweval.taskset import SciKnowEvalConfig, SciKnowEvalTaskset

__all__ = ["SciKnowEvalTaskset", "SciKnowEvalConfig"]
