"""Generation: the ``Generator`` contract (``base``) and its engines: transformers in process (``hf``),
vLLM in process (``vllm``), vLLM OpenAI servers over HTTP (``remote``), and a server's command line
(``vllm_command``). Every call into vLLM lives here or in ``scirl.weights``: its API moves every
release.

May import: the base modules and ``scirl.task``.
"""
