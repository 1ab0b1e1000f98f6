"""A training run: its config (``config``, ``config_io``), its set-up (``setup``, ``backends``), the loop
(``train``), its directory (``rundir``), checkpoints (``checkpoint``), metrics row and step line
(``metrics``) and the eval during training (``eval_hook``).

May import: every layer below it: the base modules, ``task``, ``inference``, ``rollouts``,
``trainer``, ``weights``, ``cpu`` and ``eval``.
"""
