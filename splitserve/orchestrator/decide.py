"""Where a request is prefilled, decided before any worker is picked: on a context worker
(the split path), or on the generation worker itself (sent whole, as an aggregated
request), skipping CTX and the KV transfer. Local prefill when

- the request needs it (relay.needs_aggregated: prompt logprobs; n > 1, split into single
  choices first by split.py, only where a body was not split), or
- the prompt has at most `local_prefill_max_tokens` tokens: for a short prompt the extra
  hop and the KV pull cost more than the prefill they move (a bound from the body's bytes
  settles most of them without tokenizing), or
- a GEN already holds all but at most that many of its tokens in its prefix cache (as its
  /internal/kv_blocks last said): the request is pinned to that GEN, or
- `local_prefill_when_queued` is set and the CTX pool's queue would delay it more than a
  GEN would take to prefill it (queue_prefill.py): the request is pinned to that GEN.

Also builds the RequestInfo the routers read (the session id; the block hashes when the
prompt is tokenized), and polls the workers' cached blocks when a router or the decision
reads them. Tokenizing runs in a thread, never on the event loop."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import aiohttp

from splitserve.errors import InvalidRequestError
from splitserve.metrics import Counter, Gauge
from splitserve.orchestrator import relay
from splitserve.orchestrator.cluster import ClusterConfig, Server
from splitserve.orchestrator.kv_index import KVIndex
from splitserve.orchestrator.prompt_tokens import PromptTokenizer, block_hashes
from splitserve.orchestrator.queue_prefill import pick_gen
from splitserve.orchestrator.routers import RequestInfo, uses_kv_index
from splitserve.protocol.block_hashes import salted_root

SESSION_HEADER = "X-Session-Id"
MAX_SESSION_CHARS = 256


@dataclass(frozen=True)
class Plan:
    local: bool          # prefill on the GEN (an aggregated request)
    reason: str          # the metric's label: why
    info: RequestInfo


def session_id(header, body: dict) -> str | None:
    """The X-Session-Id header, else the body's `user`: bounded, a string, or a 400."""
    value, param = header(SESSION_HEADER), SESSION_HEADER
    if value is None:
        value, param = body.get("user"), "user"
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_SESSION_CHARS:
        raise InvalidRequestError(f"{param} must be a string of at most {MAX_SESSION_CHARS} "
                                  f"characters", param)
    return value


class Decider:
    def __init__(self, config: ClusterConfig, metrics):
        self.threshold = config.local_prefill_max_tokens
        self.when_queued = config.local_prefill_when_queued
        self.slowdown = config.local_prefill_gen_slowdown
        self.interval = config.health_check_interval
        self.poll_ctx = uses_kv_index(config.context_servers.router)
        self.poll_gen = uses_kv_index(config.generation_servers.router) or self.threshold > 0
        self.index = KVIndex() if self.poll_ctx or self.poll_gen else None
        self.counting = self.index is not None or self.when_queued
        # The tokenizer only when something reads counts: it costs start-up time and memory.
        self.tokens = PromptTokenizer(config.model if self.counting else None,
                                      config.load_format, config.chat_template)
        self.count = metrics.registry.register(Counter(
            "splitserve_orchestrator_prefill_total",
            "Requests by where their prompt was prefilled (ctx, or gen: sent whole) and why",
            ("where", "reason")))
        self.index_blocks = metrics.registry.register(Gauge(
            "splitserve_orchestrator_kv_index_blocks",
            "Cached blocks each worker reported holding, as last read", ("server",)))
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="orch-tokenize")

    async def plan(self, request, body: dict, ctx_servers: list[Server],
                   gen_servers: list[Server]) -> Plan:
        plan = await self._plan(request, body, ctx_servers, gen_servers)
        self.count.labels("gen" if plan.local else "ctx", plan.reason).inc()
        return plan

    async def _plan(self, request, body: dict, ctx_servers: list[Server],
                    gen_servers: list[Server]) -> Plan:
        info = RequestInfo(relay.prefix_key(body), session_id(request.header, body),
                           index=self.index)
        if relay.needs_aggregated(body):
            return Plan(True, "needs_aggregated", info)
        if self.threshold and self.tokens.surely_within(body, self.threshold):
            return Plan(True, "short_prompt", info)
        if self.counting:
            await self._tokenize(body, info)
        if not (self.threshold or self.when_queued):
            return Plan(False, "off", info)
        if info.num_tokens is None:
            return Plan(False, "not_counted", info)
        if info.num_tokens <= self.threshold:
            return Plan(True, "short_prompt", info)
        holder = self._gen_holding(info, gen_servers) if self.threshold else None
        if holder is not None:
            info.pin = holder.url
            return Plan(True, "gen_prefix_hit", info)
        holder = pick_gen(info.num_tokens, ctx_servers, gen_servers, self.slowdown) \
            if self.when_queued else None
        if holder is not None:
            info.pin = holder.url
            return Plan(True, "ctx_queue", info)
        return Plan(False, "long_prompt", info)

    async def _tokenize(self, body: dict, info: RequestInfo) -> None:
        sizes = self.index.block_sizes() if self.index is not None else ()
        root = salted_root(body.get("cache_salt"))   # the effective salt (app.py)

        def work():
            ids = self.tokens.token_ids(body)
            return (None, {}) if ids is None else (len(ids), block_hashes(ids, sizes, root))
        info.num_tokens, info.hashes = await asyncio.get_running_loop().run_in_executor(
            self._pool, work)

    def _gen_holding(self, info: RequestInfo, servers: list[Server]) -> Server | None:
        """The healthy GEN holding the most of the prompt, if it lacks at most threshold."""
        healthy = [s for s in servers if s.healthy]
        if not info.hashes or not healthy:
            return None
        best = max(healthy, key=info.cached_tokens)
        return best if info.num_tokens - info.cached_tokens(best) <= self.threshold else None

    # -- the workers' cached blocks ---------------------------------------------------------
    async def poll(self, session: aiohttp.ClientSession, pools) -> None:
        """Reads the cached blocks of the pools' healthy workers every health interval,
        while a router or the decision reads them. pools: orchestrator/pools.Pools."""
        if self.index is None:
            return
        while True:
            wanted = [p for p, on in ((pools.ctx, self.poll_ctx), (pools.gen, self.poll_gen)) if on]
            gone = await self.index.poll(session, {s.url: s.creds for p in wanted
                                                   for s in p.servers if s.healthy and s.creds})
            for url in gone:
                self.index_blocks.labels(url).set(0)
            for url, held in self.index.held.items():
                self.index_blocks.labels(url).set(len(held.hashes))
            await asyncio.sleep(self.interval)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
