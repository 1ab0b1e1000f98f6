"""The orchestrator's half of a step: which questions (``sampler``), their completions, rewards,
advantages and filters (``generate``, ``grpo``; the run's algorithm, handed in, decides the advantages), made in
process or on servers ahead of the trainer (``orchestrator``), handed over as a ``RolloutBatch`` (``contract``) by
a source (``source``).

``contract`` is the one module the trainer's side imports from here.

May import: the base modules, ``scirl.task`` and ``scirl.inference``; never the trainer.
"""
