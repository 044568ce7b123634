"""The engine side of disaggregation: leasing a context_only request's KV (or a draining
worker's stream's: can_move), and pulling a generation_only request's KV before it decodes.

Runs on the engine thread except for the transport's `done` callbacks, which only queue
results (and wake an idle engine loop); every block-manager call stays on the engine thread.
"""

from __future__ import annotations

import logging
import queue

from dataclasses import dataclass

import msgspec

from splitserve.config import KVTransferConfig
from splitserve.engine.admission import check_relayed_prompt
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.kv_leases import LeaseTable
from splitserve.engine.prompt_reads import reads_prompt
from splitserve.engine.request import NO_BLOCKS, Request, RequestStatus
from splitserve.errors import InvalidRequestError
from splitserve.kv.base import PullResult, layout_fingerprint, make_transport
from splitserve.kv.peers import KVPeers
from splitserve.kv.sockets import valid_endpoint
from splitserve.protocol.block_hashes import HASH_BYTES, split_hashes
from splitserve.protocol.engine import KVHandle, RemotePrefill
from splitserve.tokens import PromptTokens

logger = logging.getLogger(__name__)


@dataclass
class PullStats:
    """generation_only pulls so far (engine thread): what /metrics shows."""
    bytes_pulled: int = 0
    blocks_pulled: int = 0
    blocks_reused: int = 0    # prompt blocks the prefix cache had: not pulled

    def count(self, result: PullResult, block_nbytes: int) -> None:
        self.bytes_pulled += result.nbytes
        self.blocks_pulled += result.nbytes // block_nbytes


def can_move(req: Request) -> bool:
    """A stream a draining worker hands off at a step boundary: movable (n = 1, its stream
    continued by the orchestrator), decoding (all but its last output token computed, no
    pull under way), and reading no prompt values (they would have to travel too)."""
    return (req.movable and req.status == RequestStatus.RUNNING and not req.pulling
            and req.num_output_tokens > 0 and req.num_computed_tokens == req.num_tokens - 1
            and not reads_prompt(req.params, req.prompt_back))


class RemoteKV:
    def __init__(self, config: KVTransferConfig, bm: BlockManager, kv_cache, model_config, dtype,
                 platform=None):
        self.config = config
        self.bm = bm
        self.layout = layout_fingerprint(model_config, dtype, bm.block_size)
        self.wake = lambda: None          # the process wrapper points this at its loop
        self.leases = LeaseTable(config.lease_seconds, wake=lambda: self.wake())
        self.peers = KVPeers(config.peers)
        self.transport = make_transport(config.backend, kv_cache, self.layout, platform=platform,
                                        host=config.host,
                                        port=config.port, timeout=config.timeout,
                                        connect_timeout=config.connect_timeout,
                                        idle_seconds=config.idle_seconds,
                                        pull_threads=config.pull_threads, secret=config.secret)
        self.endpoint = self.transport.start(self.leases)
        self.results: queue.SimpleQueue = queue.SimpleQueue()   # (req, PullResult, hashes)
        self.vocab_size = model_config.vocab_size
        self.stats = PullStats()
        self._log_start()

    def _log_start(self) -> None:
        config = self.config
        logger.info("engine: KV transport %s at %s (%s); pulls allowed from %s", config.backend,
                    self.endpoint, "CURVE" if config.secret else "plaintext", self.peers.describe())
        if not config.secret:
            logger.warning("engine: no internal secret: the KV channel is plaintext and any "
                           "process that reaches %s may connect (set SPLITSERVE_INTERNAL_SECRET "
                           "to encrypt and authenticate it)", self.endpoint)

    # -- context_only ---------------------------------------------------------------------
    def lease(self, req: Request) -> KVHandle:
        """Move req's block references into a lease, with its prompt's token ids for a GEN
        that asks for them; the caller finishes the request."""
        hashes = self.bm.prompt_hashes(req)
        digest = self.bm.prompt_digest(req)
        token = self.leases.add(req.request_id, req.block_ids, req.num_prompt_tokens, digest,
                                req.prompt.array)
        req.block_ids = NO_BLOCKS
        return KVHandle(backend=self.config.backend, endpoint=self.endpoint,
                        ctx_request_id=req.request_id, layout=self.layout,
                        num_tokens=req.num_prompt_tokens,
                        agent_metadata=self.transport.agent_metadata(), lease_token=token,
                        prompt_digest=digest, block_hashes=b"".join(hashes))

    def move(self, req: Request) -> KVHandle:
        """A draining worker's stream (can_move): the blocks of its computed KV, the prompt
        and all but the last output token, move into a lease, as a context_only request's
        prompt does; blocks past them are freed. Its prompt's block hashes go with the handle
        where they are known (the next worker looks them up in its prefix cache); no token
        ids go (a stream whose prompt values are read is not moved). The caller finishes it."""
        n = req.num_computed_tokens
        keep = self.bm.blocks_needed(n)
        blocks, rest = req.block_ids[:keep], req.block_ids[keep:]
        hashes = self._known_prompt_hashes(req)
        token = self.leases.add(req.request_id, blocks, n)
        req.block_ids = NO_BLOCKS
        if len(rest):
            self.bm.free_blocks(rest)
        return KVHandle(backend=self.config.backend, endpoint=self.endpoint,
                        ctx_request_id=req.request_id, layout=self.layout, num_tokens=n,
                        agent_metadata=self.transport.agent_metadata(), lease_token=token,
                        block_hashes=b"".join(hashes))

    def _known_prompt_hashes(self, req: Request) -> list[bytes]:
        """req's full prompt blocks' hashes; none when its prompt is a placeholder that
        came without them."""
        full = req.num_prompt_tokens // self.bm.block_size
        if req.prompt.is_placeholder:
            return req.block_hashes[:full] if len(req.block_hashes) >= full else []
        return self.bm.prompt_hashes(req)

    def release_ended_leases(self) -> None:
        for block_ids in self.leases.collect():
            self.bm.free_blocks(block_ids)

    # -- generation_only ------------------------------------------------------------------
    def check(self, remote: RemotePrefill, prompt_len: int, vocab_size: int,
              num_resumed: int = 0) -> None:
        """The handle is one this worker may pull, of its layout, for prompt_len tokens (a
        moved stream's: and its num_resumed output tokens but the last)."""
        h = remote.handle
        if h.layout != self.layout:   # the layouts go to the log: they describe the deployment
            logger.warning("engine: KV layout mismatch: a handle of [%.200s], this worker [%s]",
                           h.layout, self.layout)
            raise InvalidRequestError("KV layout mismatch: the context worker's model, dtype or "
                                      "KV block size differs from this worker's",
                                      "disaggregated_params.kv_handle")
        if not valid_endpoint(h.endpoint):
            raise InvalidRequestError("the KV handle's endpoint must be tcp://host:port",
                                      "disaggregated_params.kv_handle")
        if not self.peers.allows(h.endpoint):   # never dialed, never echoed back
            raise InvalidRequestError("the KV handle names a KV endpoint this worker does not "
                                      "pull from (see its --kv-peers)", "disaggregated_params.kv_handle")
        if h.backend != self.config.backend:
            raise InvalidRequestError(f"the context worker uses KV backend {h.backend!r}, this "
                                      f"worker {self.config.backend!r}", "disaggregated_params.kv_handle")
        held = prompt_len + max(num_resumed - 1, 0)
        if h.num_tokens != held:
            raise InvalidRequestError(f"prompt_len {prompt_len} and {num_resumed} resumed tokens "
                                      f"disagree with the KV handle's {h.num_tokens} tokens",
                                      "disaggregated_params.prompt_len")
        if num_resumed and not remote.first_gen_tokens:
            return    # a moved stream: its resumed output takes the first tokens' place
        if not remote.first_gen_tokens or not all(0 <= t < vocab_size for t in remote.first_gen_tokens):
            raise InvalidRequestError("first_gen_tokens must be token ids of this vocabulary",
                                      "disaggregated_params.first_gen_tokens")

    def peer_hashes(self, handle: KVHandle, prompt_len: int) -> list[bytes]:
        """The handle's block hashes, one per full block of the prompt (none: no prefix
        reuse). Trusted: only a peer with the internal secret can send a handle."""
        raw, bs = handle.block_hashes, self.bm.block_size
        if not raw:
            return []
        if len(raw) != HASH_BYTES * (prompt_len // bs):
            raise InvalidRequestError(
                f"the KV handle carries {len(raw) // HASH_BYTES} block hashes; a prompt of "
                f"{prompt_len} tokens has {prompt_len // bs} full blocks of {bs} tokens",
                "disaggregated_params.kv_handle")
        return split_hashes(raw)

    def start_pull(self, req: Request) -> None:
        """Pulls the prompt's blocks that the prefix cache did not give it (the first
        num_cached_tokens' worth are its own already), and its token ids if they are read."""
        req.pulling = True
        skip = req.num_cached_tokens // self.bm.block_size
        self.stats.blocks_reused += skip
        n_blocks = self.bm.blocks_needed(req.num_remote_tokens)
        # The CTX compares num_tokens with the lease: send this request's own count.
        handle = msgspec.structs.replace(req.remote.handle, num_tokens=req.num_remote_tokens)
        self.transport.pull(handle, req.block_ids[skip:n_blocks],
                            lambda result: self._done(req, result), skip=skip,
                            with_tokens=req.pull_prompt)

    def _done(self, req: Request, result: PullResult) -> None:   # a transport thread
        hashes = None
        if result.ok and req.pull_prompt:   # hashing a long prompt stays off the engine thread
            result, hashes = self._check_tokens(req, result)
        self.results.put((req, result, hashes))
        self.wake()

    def _check_tokens(self, req: Request, result: PullResult) -> tuple[PullResult, list | None]:
        """The pulled prompt's block hashes once its ids are the handle's prompt (digest),
        of this vocabulary, and hash to the block hashes the request came with (if any)."""
        tokens, bs = result.tokens, self.bm.block_size
        error = hashes = None
        if tokens is None:
            error = f"the {self.config.backend} KV transport brought no prompt token ids"
        elif len(tokens) and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            error = "the context worker sent prompt token ids outside the vocabulary"
        else:
            try:
                hashes = check_relayed_prompt(tokens, req.remote.handle, bs, req.hash_root)
            except InvalidRequestError as exc:
                error = f"the prompt token ids pulled with the KV: {exc.message}"
            if hashes is not None and req.block_hashes and req.block_hashes != hashes:
                error = "the context worker's block hashes are not its prompt's"
        if error is None:
            return result, hashes
        return PullResult(False, error=error, nbytes=result.nbytes, seconds=result.seconds), None

    def finished_pulls(self) -> list[tuple[Request, PullResult]]:
        """Pulls that ended; a request whose prompt came with its KV has it in place of its
        placeholder from here on (and its verified block hashes)."""
        out = []
        while not self.results.empty():
            req, result, hashes = self.results.get()
            req.pulling = False
            self.stats.count(result, self.transport.block_nbytes)
            if not result.ok:   # the endpoint goes to the log only, never to the client
                logger.warning("engine: KV pull of %s from %s failed: %s", req.request_id,
                               req.remote.handle.endpoint, result.error)
            elif hashes is not None:
                req.prompt, req.block_hashes = PromptTokens(result.tokens), hashes
            out.append((req, result))
        return out

    def health(self) -> str | None:
        """None while the KV server and pull threads run; else what stopped."""
        return self.transport.health()

    @property
    def num_leased_blocks(self) -> int:
        return self.leases.num_leased_blocks

    def close(self) -> None:
        self.transport.close()
