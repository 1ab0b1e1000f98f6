"""Generation: the ``Generator`` contract (``base``) and its engines: transformers in process (``hf``),
vLLM in process (``vllm``), vLLM OpenAI servers over HTTP (``remote``, through one server's client,
``client``), and a server's command line and environment (``vllm_command``). Every call into vLLM lives here
or in ``scirl.weights``: its API moves every release. ``client`` and ``vllm_command`` import neither torch
nor transformers: the launcher uses them before anything loads a model.

May import: the base modules and ``scirl.task``.
"""
