"""Moving a registered worker to the other pool (orchestrator/registry.py's role API)."""

import orjson

from splitserve.orchestrator.registry import Registry

URL = "http://127.0.0.1:9001"


def call(registry, path, body):
    status, answer = registry.handle("POST", path, orjson.dumps(body))
    return status, orjson.loads(answer)


def roles(registry):
    return {m["url"]: (m["role"], m["registered_role"]) for m in registry.listing()}


def test_a_move_holds_against_heartbeats_until_the_worker_leaves():
    registry, changes = Registry(30.0), []
    registry.listeners.append(lambda: changes.append(1))
    assert call(registry, "/internal/workers", {"role": "generation", "url": URL})[0] == 200
    assert call(registry, "/internal/workers/role", {"url": URL, "role": "context"})[0] == 200
    assert roles(registry) == {URL: ("context", "generation")}
    assert len(changes) == 2
    # its heartbeats say generation; it stays where it was moved, nothing changes
    call(registry, "/internal/workers", {"role": "generation", "url": URL})
    assert roles(registry) == {URL: ("context", "generation")} and len(changes) == 2
    # moved back to its own role: the assignment is gone
    call(registry, "/internal/workers/role", {"url": URL, "role": "generation"})
    assert registry.assigned == {} and roles(registry) == {URL: ("generation", "generation")}
    call(registry, "/internal/workers/role", {"url": URL, "role": "context"})
    call(registry, "/internal/workers/remove", {"url": URL})
    call(registry, "/internal/workers", {"role": "generation", "url": URL})
    assert roles(registry) == {URL: ("generation", "generation")}


def test_bad_moves_are_400s_naming_the_field():
    registry = Registry(30.0)
    status, body = call(registry, "/internal/workers/role", {"url": URL, "role": "context"})
    assert status == 400 and body["error"]["param"] == "url"
    call(registry, "/internal/workers", {"role": "generation", "url": URL})
    status, body = call(registry, "/internal/workers/role", {"url": URL, "role": "prefill"})
    assert status == 400 and body["error"]["param"] == "role"
    status, body = call(registry, "/internal/workers/role", {"url": URL})
    assert status == 400 and body["error"]["param"] == "role"
    assert roles(registry) == {URL: ("generation", "generation")}
