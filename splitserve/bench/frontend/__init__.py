"""`splitserve bench frontend`: the GEN front-end's cost per token relay mode (main.py)."""
