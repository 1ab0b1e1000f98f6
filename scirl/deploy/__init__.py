"""The disaggregated deployment: vLLM servers and a torchrun trainer, started and supervised by
``scirl train`` itself. ``ports`` picks and records every port, ``preflight`` refuses what cannot work
before anything starts, ``supervisor`` runs and stops child processes, ``launch`` puts them in order.

May import: the base modules, ``scirl.task``, ``scirl.inference`` and ``scirl.run`` (the config, the run
directory).
"""
