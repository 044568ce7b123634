"""`splitserve bench`: the benchmarks every number in docs/benchmarks.md comes from. None of
the serving code imports this package.

One subpackage per command, its entry point in `main.py` (arguments and run):
  engine/    `bench engine`: the engine alone, in-process (and a plain PyTorch reference)
  serve/     `bench serve`: load against any OpenAI-compatible server (workloads, the
             request client, --compare tables)
  frontend/  `bench frontend`: the GEN front-end's cost per token relay mode, against a worker
             whose KV backend is `none`
  report/    `bench report`: runs the others and writes docs/benchmarks.md, one module a section
Shared: metrics.py (client-side metrics, /metrics deltas), plot.py (`bench plot`),
provenance.py (versions and machine in every result), server_process.py (a server subprocess).
"""
