"""bridge_mr: DrJAX-style MapReduce primitives as JAX primitives, callable from PyTorch."""
