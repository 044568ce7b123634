"""`splitserve bench serve`: load against an OpenAI-compatible server (main.py)."""
