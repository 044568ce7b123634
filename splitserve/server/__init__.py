"""The worker's HTTP front-end: OpenAI endpoints over the engine, SSE streaming, metrics."""
