"""KV transfer between engine-core processes (base.py: what every transport provides)."""

# The KV transports by name, each with the module that registers it. A module is imported
# when its transport is first asked for: nixl is an optional dependency.
TRANSPORT_MODULES = {
    "tcp": "splitserve.kv.tcp",     # built in: ZeroMQ over TCP
    "nixl": "splitserve.kv.nixl",   # NVIDIA's nixl over UCX
    "none": "splitserve.kv.none",   # moves nothing: front-end benchmarks only
}
