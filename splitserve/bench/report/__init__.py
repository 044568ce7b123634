"""`splitserve bench report`: docs/benchmarks.md from real runs (main.py)."""
