import os

# Inductor's FX graph cache would skip the pass on a hit, and tests count what the
# pass does; the kernel caches stay on (they only save C++ compile time).
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
