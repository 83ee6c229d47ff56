"""Helpers for the tests, the notebooks and the examples, not used by the pass:
gloo ranks in fresh processes (:mod:`.spawn`), vLLM's TP group over gloo in them
(:mod:`.vllm_tp`) and a small compiled model's graph dump (:mod:`.example_dump`)."""
