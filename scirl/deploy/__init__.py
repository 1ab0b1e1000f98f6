"""The disaggregated deployment: vLLM servers and a torchrun trainer as processes. ``plan`` says what runs
where (command lines, nodes, ports, logs), ``ports`` picks and records every port, ``preflight`` refuses
what cannot work before anything starts, ``supervisor`` runs and stops child processes. ``launch`` is
``scirl train``'s one-node launcher, ``server`` is ``scirl inference`` (one server, the launcher's own
command), ``job`` runs a plan over several nodes inside their allocation, and ``slurm`` renders it as an
sbatch script.

May import: the base modules, ``scirl.task``, ``scirl.inference`` and ``scirl.run`` (the config, the run
directory).
"""
