"""The kernels' self-test, as shipped to users (``fusion-pass selftest``): the Triton
backend run by N simulated ranks on one GPU, or in Triton's interpreter on the CPU
(:mod:`.sim_group`), through a suite of cases checked element by element against
float64 (:mod:`.suite`, :mod:`.kernel_checks`)."""
