"""prime-rl: the same task as a verifiers taskset with prime-rl's config (``export``), and a prime-rl
DCP checkpoint as an HF model (``dcp_convert``).

May import: the base modules, ``scirl.task`` and ``scirl.run`` (the config, for the export's recipe).
"""
