"""`splitserve bench engine`: prefill and decode throughput of the engine alone (main.py)."""
