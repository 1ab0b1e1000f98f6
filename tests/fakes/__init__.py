"""Stand-ins for other programs: the fake OpenAI-compatible (and vLLM) server, the launcher's servers and trainer,
Slurm's commands, NCCL's communicator."""
