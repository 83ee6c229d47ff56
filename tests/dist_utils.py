from fusion_pass.spawn import free_port, run_ranks  # noqa: F401
