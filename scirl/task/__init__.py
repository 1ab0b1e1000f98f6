"""The task: SciKnowEval-schema multiple-choice questions and what is asked of a model about them.

``schema`` (the validated ``Question`` record), ``data`` (loading, validation with reasons, dedup, the
train/held-out split), ``formats`` (other science MCQ sets mapped to the schema), ``prompt`` (the chat
messages), ``reward`` (answer-letter extraction and the 0/1 reward), ``shuffle`` (seeded option
orders). Used by training, evaluation and the prime-rl plug-in alike.

May import: ``scirl.errors`` only (the bottom layer above the base modules).
"""
