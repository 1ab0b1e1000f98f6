"""A training run: its config (``config``, ``config_io``), its set-up (``setup``, ``backends``, ``allocator``), the
loop (``train``), its directory (``rundir``), checkpoints (``checkpoint`` on disk, ``checkpointer`` writing them,
``serving_weights``), the metrics row and step line (``metrics``), the eval during training (``eval_hook``) and
each trainer GPU's memory plan (``memory``).

May import: every layer below it: the base modules, ``task``, ``inference``, ``rollouts``, ``trainer``,
``algorithms``, ``weights``, ``cpu`` and ``eval``.
"""
