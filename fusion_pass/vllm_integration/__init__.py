"""vLLM integration: the plugin, the pass subclass vLLM calls, and config helpers.

What differs between the supported vLLM versions is named once, in :mod:`.compat`.

Importing this package imports vLLM; the core package never does.
"""

from .config import JSON_PASS, cli_json, compilation_config
from .vllm_pass import VllmAllReduceRMSNormPass

__all__ = ["JSON_PASS", "VllmAllReduceRMSNormPass", "cli_json", "compilation_config"]
