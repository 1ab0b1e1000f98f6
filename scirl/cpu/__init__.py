"""CPU-only speed code, kept out of the core path.

None of this matters on the GPUs scirl is for; on a 2-core CPU it is most of a step's speed. Each
piece is chosen once, where the backend is built (``scirl.run.backends``), and the core modules never
call into it:

- ``generator.CPUGenerator``: ``HFGenerator`` with a preallocated KV cache and each group's prompt
  K/V kept once during decoding;
- ``attention``: the decode attention it registers with transformers;
- ``matrix_units.bf16_advice``: the line a bf16 run on a CPU without bf16 matrix units starts with;
- ``host_memory.keep_freed_memory``: a process-wide glibc setting, which only a CLI entry point
  (never the library) may switch on.

May import: the base modules, ``scirl.inference``, ``scirl.trainer`` and ``scirl.rollouts.contract``.
"""
