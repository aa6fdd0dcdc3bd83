"""The vLLM agent: a vLLM OpenAI server made a loraplex worker (``loraplex vllm-agent``).

Not the bundled engine: it runs no model and never imports torch (it runs from the plain
install). It shares the worker side's torch-free pieces with the bundled worker: adapter sources
and the disk cache (``engine.lora.sources``), the control API (``engine.control_api``: its routes
over the agent's backend), the worker secret (``engine.worker_auth``) and the residency reports
(``engine.reporter``).
"""
