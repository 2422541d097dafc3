"""The vLLM server the ``generation.url`` tests start, as a user starts one: it lives in
``rlhf_pipeline/bench/vllm_server_process.py`` (the generation benchmark starts the same one).

Import from any test as ``from vllm_server_process import VLLMServerProcess`` (``tests/conftest.py``
puts this directory on ``sys.path``).
"""

from rlhf_pipeline.bench.vllm_server_process import START_TIMEOUT_S, VLLMServerProcess, free_port, save_model_dir

__all__ = ["START_TIMEOUT_S", "VLLMServerProcess", "free_port", "save_model_dir"]
