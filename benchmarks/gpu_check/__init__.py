"""GPU check: GRPO on one GPU, offline, in stages that fit a time budget; every figure lands in a JSON file.

Offline (no model hub): a random-init model with a Qwen3 release's shapes, synthetic SciKnowEval-schema questions,
and ``scirl train`` as a user runs it, on the mission's step: 8 questions x 16 completions, prompts of 100-350
tokens, completions of mixed lengths up to 256 tokens (a random model is given an EOS bias so that one ends with
probability 1/100 a token: mean 92 tokens, median 69, 7.6% at the limit; ``model.py`` says how and why). The three
rollout filters only monitor (every completion is trained on).

Stages, each in its own process with its own timeout (``python -m gpu_check --worker STAGE``); each writes its
figures to ``OUT/gpu_check.json`` (atomically) as it ends, so a later failure or timeout keeps them. A file each:

- ``probe.py``: the device, the versions that matter, whether vLLM is there, whether scirl imports, whether
  torch.compile works (a tiny function through inductor);
- ``model.py``: the model and the questions (``model``), and the mission's lengths;
- ``stage_a.py``, no vLLM: ``a_train`` (the transformers backend's steps, a checkpoint before the last step and one at
  it) and ``a_resume`` (the same run killed with kill -9 in checkpoint 2's write, resumed, its final weights
  bit-equal to a_train's); deterministic kernels on a GPU; ``scirl_run.py``: ``scirl train`` as they launch it;
- ``sweep.py``: ``a_sweep``, the training step alone by micro-batch tokens, activation checkpointing, kernels (compile,
  eager, Liger) and attention (flex, SDPA), issue 41's targets rows first, on batches seen and unseen, torch.compile's
  graphs and breaks counted (``compiles.py``), against the memory plan (``plan.py``); one step profiled; ``a_sweep2``,
  its default row at a second shape (1.7b);
- ``peer.py``: ``a_peer``, the peer benchmark's transformers pair (``bench_trl.py``: scirl beside TRL);
- ``stage_b.py``, vLLM: ``b_colocated``, ``b_disaggregated`` and ``b_eval``;
- ``launch.py``: ``scirl train`` as the stages run it (flags, the deterministic launch, the device's memory);
- ``figures.py``: MFU (useful tokens only: each group's prompt once, the LM head at the loss tokens) and the reports;
- ``orchestrate.py``: the flags, the device's settings, the time budget, the stages' processes, the JSON.

Figures: per step and as the mean of the steps after the first (the first pays for new shapes and, on CUDA, for
compiling the decoder layers): the split generate / train / weight sync, plus the checkpoint (its write, and the
seconds the next step waited on it); generation tokens/s (completion tokens / generate time); the trainer's token
counts (``train/forward_tokens``, ``unique_tokens``, ``loss_tokens``, ``padding_tokens``), useful tokens/s and MFU
(``figures.py``); the training peak (torch's allocator, its peak reset before each step's training, against the memory
plan's bytes in tensors) and the process's (generation's KV cache included), and on a GPU the device's as nvidia-smi
saw it, sampled every 0.5 s; graphs compiled and graph breaks; checkpoint write MB/s (the whole save: the state to
the host, the files, their sha256, fsync; MB = 10^6 bytes).

Time budget, GPU defaults (``--shape 0.6b``, 4 steps, bfloat16) on one H100 or H200: stage A's estimates are GUESSES
until a GPU runs the packed trainer (``orchestrate.GPU_BUDGET`` says from what: the earlier trainer's measured steps,
two checkpoints of 7.8 GB at ~400 MB/s, and 1-3 minutes cold of compiling per process): probe 20 s, model 40 s,
a_train 200 s, a_sweep 150 s (its targets' rows; the rest while its timeout allows), a_resume 150 s, a_peer 130 s,
a_sweep2 110 s. ``--stage targets`` (probe, model, a_sweep's targets rows, a_peer, a_sweep2, then a_train at 3
steps) puts issue 41's figures first in the default ``--budget-s 480``; ``--stage a --no-sweep`` (a_train and the
resume check) fits another. Stage B (measured: b_colocated 205 s, b_disaggregated with b_eval 188 s) takes another
~7 minutes (``--stage b``). A stage starts only when its estimate fits in what is left of the budget (else it is
skipped, the reason recorded), and its timeout is cut to what is left. At 1.7b and larger stage A takes 2 steps and
leaves a_resume out by default (``--resume`` runs it): a 1.7b checkpoint is ~24 GB, a minute to write, and the check
writes four.

CPU (``--cpu``, or no CUDA): ``--shape tiny`` (the demo model's shapes: hidden 128, 3 layers, 4 heads of 32, with a
4,096-token vocabulary so ids beyond the tokenizer occur as on a GPU), 2 steps of 4 questions x 4 completions x up
to 32 tokens, float32, 1 thread; the same stages, seconds each.

    bash benchmarks/gpu_check.sh [--stage all|a|b|targets] [--budget-s 480] [--shape 0.6b] [--steps 4] [--[no-]resume]
                                 [--micro-batch-tokens N] [--no-sweep] [--out DIR] [--cpu]

Other benchmarks take the model from here: ``from gpu_check import SHAPES, DeviceMemoryPeak, build_model``.
"""

from .launch import DeviceMemoryPeak
from .model import SHAPES, build_model

__all__ = ["SHAPES", "DeviceMemoryPeak", "build_model"]
