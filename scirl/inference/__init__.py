"""Generation backends. ``base.Generator`` is the contract; ``hf`` (transformers, CPU and small GPUs) and
``vllm`` (GPUs) implement it."""
