"""The rooms import each other only through protocol/ and the shared base modules
(docs/architecture.md, "Rooms, and where their agreements live"). Every module of splitserve/ is read with ast, none is
imported, and every import counts: a lazy one inside a function, a relative one, one under
`if TYPE_CHECKING`.

The rooms are the orchestrator, the worker front-end (server/), the engine, KV transfer
(kv/), the model and its C kernels. The entry points (cli.py, llm.py: the offline engine in
this process, bench/, planner/: programs that speak to a cluster over HTTP) may import
anything. Everything else is a shared base layer: protocol/ (every agreement between
rooms), httpd/ and the top-level modules. A base module imports no
room; a room imports another room only where ALLOWED says, and why."""

from __future__ import annotations

import ast
import pathlib

import splitserve   # (its __init__ imports nothing)

PACKAGE = pathlib.Path(splitserve.__file__).parent
ROOMS = {"orchestrator", "server", "engine", "kv", "model", "kernels", "platforms"}
ENTRY_POINTS = {"cli", "llm", "bench", "planner", ""}   # "": the package (LLM, SamplingParams)

# (importer, imported): why. Module names below splitserve., each covering the modules
# inside it. The same table is in docs/architecture.md.
ALLOWED = {
    ("orchestrator", "model.loader"): "counting a prompt as the workers do needs their "
        "tokenizer and chat template (orchestrator/prompt_tokens.py), never the weights: "
        "model/loader.py loads no torch, so neither does the orchestrator",
    ("orchestrator.up_args", "cli"): "`splitserve up` takes the --api-key and "
        "--cache-isolation flags of serve and orchestrator (cli.add_api_key_arguments), and "
        "worker flags it passes on (cli.add_worker_flags)",
    ("server", "model.loader"): "the front-end tokenizes and renders chat templates; the "
        "weights load in the engine process only",
    ("server.engine_process", "engine.process"): "the engine process's entry point, imported "
        "inside the spawned child only: the front-end's own process loads no engine module",
    ("engine", "model"): "the engine runs the model",
    ("engine", "kv"): "and moves its KV blocks",
    ("engine", "kernels"): "engine/process.py builds the C kernels before the model loads",
    ("kv", "model.config"): "a KV layout's fingerprint is the model's shape",
    ("kv.checksums", "kernels"): "the KV blocks' checksums are a C kernel (kernels/kvsum.c)",
    ("model", "kernels"): "the model's C kernels",
    ("config", "kv"): "a KV transport's name is checked against kv/__init__.py's registry",
    ("config", "model.quant"): "whether this torch can run a quantization, asked only when "
        "one is",
    ("config", "platforms"): "a device name is checked against platforms/__init__.py's list "
        "(torch loads only to check that cuda is there)",
    ("orchestrator.up", "planner.config"): "`splitserve up --planner` checks the planner's "
        "settings before any worker starts",
    ("orchestrator.up_args", "planner.config"): "and takes the planner's defaults",
    ("orchestrator.up", "platforms"): "`splitserve up --device cuda` is refused before any "
        "worker starts where PyTorch sees no GPU",
    ("engine", "platforms"): "the engine asks its device's platform what differs per device",
    ("model", "platforms"): "the model's linear kernels and device are the platform's choice",
    ("kv", "platforms"): "a KV block's bytes reach a socket through the cache's platform",
    ("platforms", "model"): "the CPU platform picks the model's CPU linears (packed, "
        "quantized) and waits for the kernels' helper thread",
    ("platforms", "kernels"): "the CPU platform's start line names the C kernels' build",
}


def unit(module: str) -> str:
    """The room or layer a module belongs to: splitserve.engine.core -> engine."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def within(module: str, prefix: str) -> bool:
    name = "splitserve." + prefix
    return module == name or module.startswith(name + ".")


def allowed(importer: str, imported: str) -> bool:
    if unit(importer) in ENTRY_POINTS or unit(imported) == unit(importer):
        return True
    if unit(imported) not in ROOMS | ENTRY_POINTS:   # a base layer
        return True
    return any(within(importer, a) and within(imported, b) for a, b in ALLOWED)


def imports(module: str, source: str, is_package: bool = False):
    """(imported module, line) for every import of a splitserve module in source."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            # `from splitserve import envs` imports the module splitserve.envs
            names = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base
                     for a in node.names]
        else:
            continue
        yield from ((name, node.lineno) for name in names
                    if name == "splitserve" or name.startswith("splitserve."))


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def violations(modules) -> list[str]:
    """modules: (name, source, is_package) -> 'importer:line imports imported' for each
    import against the layering."""
    found = sorted((module, line, imported) for module, source, is_package in modules
                   for imported, line in imports(module, source, is_package)
                   if not allowed(module, imported))
    return [f"{module}:{line} imports {imported}" for module, line, imported in found]


def package_modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        yield name, path.read_text(), is_package


def test_rooms_import_each_other_only_through_protocol_and_the_base_layers():
    bad = violations(package_modules())
    assert not bad, ("imports against the layering (move the agreement into protocol/, or "
                     "add the edge to ALLOWED with its reason):\n  " + "\n  ".join(bad))


def test_every_kind_of_import_is_seen():
    """The walk finds lazy, relative and aliased imports, and the names a `from splitserve
    import` brings in."""
    source = ("import splitserve.engine.core as core\n"
              "def f():\n    from splitserve.server.kv_blocks import kv_blocks_response\n"
              "from ..engine import admission\n"
              "from splitserve import llm, envs\n"
              "from splitserve.protocol.block_hashes import chain_hashes\n"
              "from splitserve.model.loader import load_model_source\n")
    assert violations([("splitserve.orchestrator.x", source, False)]) == [
        "splitserve.orchestrator.x:1 imports splitserve.engine.core",
        "splitserve.orchestrator.x:3 imports splitserve.server.kv_blocks",
        "splitserve.orchestrator.x:4 imports splitserve.engine.admission",
        "splitserve.orchestrator.x:5 imports splitserve.llm"]
    assert violations([("splitserve.server.x", "from splitserve.engine import admission\n",
                        False)]) == ["splitserve.server.x:1 imports splitserve.engine.admission"]
    assert violations([("splitserve.protocol.x", "from splitserve.server import app\n",
                        False)]) == ["splitserve.protocol.x:1 imports splitserve.server.app"]
    assert violations([("splitserve.engine.x", "from splitserve.orchestrator import relay\n"
                        "from splitserve.kv.base import make_transport\n", False)]) == [
        "splitserve.engine.x:1 imports splitserve.orchestrator.relay"]
