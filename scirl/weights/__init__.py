"""The trainer's new weights to the sampler after every step, and proof that they arrived. ``base``
(the ``WeightSink`` seam of the loop), ``inprocess`` (an engine in this process), ``servers`` with the
``filesystem`` and ``nccl`` transports (vLLM servers), ``buckets`` (a push a bucket at a time), ``check``
(every push checked).

May import: the base modules and ``scirl.inference``; the trainer is passed in, never imported.
"""
