"""C kernels for the engine's hot loops, built for the machine they run on (build.py)."""
