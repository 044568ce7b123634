"""The GPU check (scripts/gpu_check.sh): greedy equality with transformers, `bench engine` on
Llama-3-8B shapes against the floors this card measures, and `splitserve up` on one card.
Every step also runs on the CPU (`--cpu-dry-run`) with small shapes."""
