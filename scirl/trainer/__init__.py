"""The trainer's half of a step: loading the policy for training with FSDP2 (``model``), micro-batched
forward/backward and one AdamW step (``step``), prime-rl's loss (``loss``), a self-teacher's sequences
(``teacher``), LoRA (``lora``), the bf16 compute copy of a single process (``mixed_precision``) and the full
weights, gathered a tensor at a time for pushes and checkpoints (``full_weights``). Which loss a run computes
is its algorithm's (``scirl.algorithms``), handed to ``Trainer``.

May import: the base modules and ``scirl.rollouts.contract`` (the step's samples), nothing else of the
orchestrator's side.
"""
