"""The trainer's half of a step: loading the policy for training with FSDP2 (``model``), micro-batched
forward/backward and one fused AdamW step (``step``), micro-batches as packed rows, each group's prompt once
(``batching``, ``packing``), the attention over them (``attention``), the decoder layers' kernels
(``kernels``), the LM head over blocks of tokens (``head``), prime-rl's loss (``loss``), top-k teacher
targets (``targets``), LoRA (``lora``), the bf16 compute copy of a single process (``mixed_precision``) and the
full weights, gathered a tensor at a time for pushes and checkpoints (``full_weights``). Which loss a run
computes is its algorithm's (``scirl.algorithms``), handed to ``Trainer``.

May import: the base modules and ``scirl.rollouts.contract`` (the step's samples), nothing else of the
orchestrator's side.
"""
