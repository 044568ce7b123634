"""The NIXL KV transport: GEN reads the CTX's leased blocks straight out of its KV cache.

Each transport owns one NIXL agent (UCX backend). CTX: a lease's runs of blocks are
registered as it begins and deregistered as it ends (acked or expired; LeaseView.watch), and
the reply to a PullRequest (kv.zmq_pull's conversation over ZeroMQ) carries the lease's block
ids, the cache's base address and the agent's *partial* metadata: those registrations only, so
a GEN's agent knows of no other block and refuses a READ outside the lease. NIXL's own
progress thread serves the READs. GEN: the whole cache is registered once as the destination
of READs; that registration's metadata never leaves the process. Pulls from different CTXs run
on different pull threads, so the agent is created in NIXL's strict thread-sync mode. A pull
checks the offer (block size and count, ids, metadata size), loads the lease's metadata (a CTX
agent is dropped and connected afresh every MAX_LOADS_PER_AGENT leases, so stale regions do not
pile up), posts one READ from remote blocks into its own local blocks and polls it to
completion, then checks each block it read against the checksum the reply carries
(kv/checksums.py: the CTX sums a lease's blocks on a thread of its own as the lease starts;
the GEN sums what landed, on its pull thread): a corrupted block fails the pull. Then the
PullAck releases the lease.

What registration enforces depends on the transport under UCX: with RDMA a READ needs the
memory key of a live registration, which the NIC checks; with UCX_TLS=tcp, UCX emulates READs
in software and the serving side does not check registrations (a READ through a deregistered
region's stale metadata still returns its bytes), so there only the GEN's own NIXL library
keeps it to the lease, and the KV channel's authentication is the boundary. Registering costs
microseconds over tcp (0.17 ms and 21 KB of metadata for a lease of 512 scattered blocks,
0.08 ms to deregister them; one run of 512 blocks: ~5 us).

UCX picks its transports from the environment when the agent is created. If the user has not
set them, this module sets UCX_TLS=tcp and, for a loopback host, UCX_NET_DEVICES=lo: that
works on any machine. On a cluster set UCX_TLS (e.g. rc,cuda_copy) and UCX_NET_DEVICES
(e.g. mlx5_0:1) to use RDMA.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys
import threading
import time
import uuid

import numpy as np
import torch

from splitserve.kv.base import LeaseView, register
from splitserve.kv.checksums import SUM_BYTES, check_block, expected_sums
from splitserve.kv.messages import MAX_AGENT_METADATA_BYTES, MAX_REPLY_BYTES, NixlPullReply
from splitserve.kv.sockets import BadReply
from splitserve.kv.zmq_pull import ZmqPullTransport
from splitserve.protocol.engine import KVHandle

logger = logging.getLogger(__name__)

# Leases whose metadata a GEN loads into one CTX agent before it drops that agent (and the
# stale regions NIXL keeps for it) and connects afresh: a reconnect costs a few ms.
MAX_LOADS_PER_AGENT = 256

INSTALL_HINT = ("the nixl KV backend needs the nixl package: install torch first, then "
                "`pip install nixl==1.5.1`; or use the built-in tcp backend")


def _import_nixl():
    try:
        import nixl
    except (ImportError, OSError) as exc:   # OSError: a wheel whose shared libraries fail to load
        raise ImportError(f"{INSTALL_HINT} ({exc})") from exc
    return nixl


def _default_ucx_env(host: str) -> None:
    """UCX reads these when the agent's backend is created; the user's values win."""
    os.environ.setdefault("UCX_TLS", "tcp")
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        loopback = False
    if loopback:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")


# Microseconds NIXL's progress thread waits between polls of UCX. nixl's Python API creates
# agents with 0, and then that thread spins: an idle agent used a whole CPU (measured: 2.99
# CPU-seconds in 3 s), the CPU a worker's engine is pinned to. At 200 us it used 0.06; a
# pull of a lease's blocks takes milliseconds, so the wait is lost in it.
PROGRESS_DELAY_US = 200
_agent_lock = threading.Lock()


def _new_agent(nixl, name: str, config):
    """nixl.nixl_agent(name, config) with its progress thread at PROGRESS_DELAY_US: the
    Python API has no setting for it, so the config it builds is amended on its way to the
    C++ agent."""
    api = sys.modules[nixl.nixl_agent.__module__]   # nixl re-exports it from nixl_cu*._api
    real = api.nixlBind.nixlAgent

    def create(agent_name, agent_config):
        agent_config.pthrDelay = PROGRESS_DELAY_US
        return real(agent_name, agent_config)

    with _agent_lock:
        api.nixlBind.nixlAgent = create
        try:
            return nixl.nixl_agent(name, config)
        finally:
            api.nixlBind.nixlAgent = real


def _make_agent(nixl, name: str):
    ucx = (f"UCX_TLS={os.environ.get('UCX_TLS')} "
           f"UCX_NET_DEVICES={os.environ.get('UCX_NET_DEVICES', '')}")
    # Strict: the pull threads call the agent concurrently (one pull per CTX at a time).
    config = nixl.nixl_agent_config(backends=["UCX"],
                                    sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    try:
        agent = _new_agent(nixl, name, config)
    except Exception as exc:   # nixl says only NIXL_ERR_BACKEND: name what the user can change
        raise RuntimeError(f"could not start NIXL's UCX backend ({exc}) with {ucx}: "
                           f"check that they name transports and devices this machine has") from exc
    if "UCX" not in agent.backends:
        raise RuntimeError("nixl was installed without its UCX plugin: reinstall nixl")
    return agent


def block_runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src starts, dst starts, counts) of the runs where both sides are consecutive block
    ids: one transfer descriptor per run instead of one per block."""
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([[0], breaks])[:len(src)]
    return src[starts], dst[starts], np.diff(starts, append=len(src))


def _descs(base: int, block_bytes: int, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """(N, 3) uint64 rows of (address, length, device id 0): NIXL's DRAM descriptor list."""
    out = np.zeros((len(starts), 3), dtype=np.uint64)
    out[:, 0] = np.uint64(base) + starts.astype(np.uint64) * np.uint64(block_bytes)
    out[:, 1] = counts.astype(np.uint64) * np.uint64(block_bytes)
    return out


@register("nixl")
class NixlTransport(ZmqPullTransport):
    reply_type = NixlPullReply

    def __init__(self, kv_cache: torch.Tensor, layout: str, host: str = "127.0.0.1",
                 **options):
        # The agent before the ZeroMQ context (super().__init__): a failure leaves no context open.
        platform = options.get("platform")
        if platform is not None and not platform.nixl_memory:
            raise ValueError(f"KV backend nixl: a {platform.name} KV cache is not registered with "
                             "NIXL yet; use --kv-backend tcp")
        nixl = _import_nixl()
        assert kv_cache.is_contiguous()
        _default_ucx_env(host)
        self.agent_name = f"splitserve-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent = _make_agent(nixl, self.agent_name)
        self.reg = self.agent.register_memory(kv_cache)   # as a READ's destination only
        self._leased: dict[str, tuple] = {}   # ctx_request_id -> (registration, partial metadata)
        self._leased_lock = threading.Lock()
        self._remote: dict[str, str] = {}     # endpoint -> loaded agent name
        self._loads: dict[str, int] = {}      # endpoint -> leases loaded since it connected
        self._remote_lock = threading.Lock()
        super().__init__(kv_cache, layout, host, **options)

    # -- CTX side -------------------------------------------------------------------------
    def start(self, leases: LeaseView) -> str:
        leases.watch(self._lease_started, self._lease_ended)
        endpoint = super().start(leases)
        logger.info("kv-nixl: agent %s (UCX_TLS=%s UCX_NET_DEVICES=%s)", self.agent_name,
                    os.environ.get("UCX_TLS"), os.environ.get("UCX_NET_DEVICES", "all"))
        return endpoint

    def _lease_started(self, ctx_request_id: str, blocks: np.ndarray) -> None:
        """Registers the lease's runs of blocks (engine thread): all a GEN's READ may name."""
        self._lease_ended(ctx_request_id)   # an id leased again: its old lease is gone
        starts, _, counts = block_runs(blocks, blocks)
        reg = self.agent.register_memory(_descs(self.kv_cache.data_ptr(), self.block_nbytes,
                                                starts, counts), self.platform.nixl_memory)
        try:
            metadata = self.agent.get_partial_agent_metadata(reg, True, ["UCX"])
        except Exception:
            self.agent.deregister_memory(reg)
            raise
        with self._leased_lock:
            self._leased[ctx_request_id] = (reg, metadata)

    def _lease_ended(self, ctx_request_id: str) -> None:
        """Deregisters the lease's blocks before the engine frees them (engine thread)."""
        with self._leased_lock:
            entry = self._leased.pop(ctx_request_id, None)
        if entry is not None:
            try:
                self.agent.deregister_memory(entry[0])
            except Exception as exc:   # the engine must still free the blocks
                logger.error("kv-nixl: could not deregister lease %s's blocks: %s",
                             ctx_request_id, exc)

    def _offer(self, ctx_request_id: str, blocks: np.ndarray) -> tuple[NixlPullReply, list]:
        with self._leased_lock:
            entry = self._leased.get(ctx_request_id)
        if entry is None:   # ended since the lookup
            return NixlPullReply(ctx_request_id=ctx_request_id, error=f"unknown or expired "
                                 f"ctx_request_id {ctx_request_id!r}"), []
        return NixlPullReply(
            ctx_request_id=ctx_request_id, agent_name=self.agent_name, agent_metadata=entry[1],
            base_addr=self.kv_cache.data_ptr(), block_bytes=self.block_nbytes,
            block_ids=blocks.tolist(),
            block_sums=self.lease_sums.sums(ctx_request_id, blocks)), []

    def agent_metadata(self) -> bytes:
        # The reply to a PullRequest carries the metadata, so KVHandles (relayed per request
        # by the orchestrator) stay small.
        return b""

    # -- GEN side -------------------------------------------------------------------------
    def _max_frame(self) -> int:
        # The reply: metadata, and at most the whole cache's block ids (9 msgpack bytes each)
        # and checksums.
        return (MAX_REPLY_BYTES + MAX_AGENT_METADATA_BYTES
                + (9 + SUM_BYTES) * self.kv_cache.shape[0])

    def _receive(self, handle: KVHandle, reply: NixlPullReply, frames: list, dst: np.ndarray,
                 deadline: float) -> int:
        _check_offer(reply, frames, dst, self.block_nbytes)
        sums = expected_sums(reply.block_sums, len(dst))
        if len(dst):
            self._read(self._remote_agent(handle.endpoint, reply), reply, dst, deadline)
        for i, (block, want) in enumerate(zip(dst.tolist(), sums)):
            check_block(i, memoryview(self.block_bytes(block).numpy()), want)
        return len(dst) * self.block_nbytes

    def _remote_agent(self, endpoint: str, reply: NixlPullReply) -> str:
        """Loads the lease's metadata into the CTX agent's; a restarted CTX comes back with a
        new name."""
        with self._remote_lock:
            known = self._remote.get(endpoint)
            if known is not None and (known != reply.agent_name or
                                      self._loads[endpoint] >= MAX_LOADS_PER_AGENT):
                self._forget(endpoint)
            self.agent.add_remote_agent(reply.agent_metadata)   # connects on the first one
            self._remote[endpoint] = reply.agent_name
            self._loads[endpoint] = self._loads.get(endpoint, 0) + 1
        return reply.agent_name

    def _forget(self, endpoint: str) -> None:
        """Drops an endpoint's agent (the caller holds _remote_lock)."""
        name = self._remote.pop(endpoint, None)
        self._loads.pop(endpoint, None)
        if name in self._remote.values():
            return   # still reached through another endpoint
        if name is not None:
            try:
                self.agent.remove_remote_agent(name)   # also disconnects from it
            except Exception as exc:
                logger.warning("kv-nixl: could not drop remote agent %s: %s", name, exc)

    def _read(self, remote: str, reply: NixlPullReply, dst: np.ndarray, deadline: float) -> None:
        """One READ of every run of blocks; returns once the bytes are in the local cache."""
        srcs, dsts, counts = block_runs(np.array(reply.block_ids, dtype=np.int64), dst)
        local = self.agent.get_xfer_descs(_descs(self.kv_cache.data_ptr(), self.block_nbytes,
                                                 dsts, counts), self.platform.nixl_memory)
        far = self.agent.get_xfer_descs(_descs(reply.base_addr, self.block_nbytes, srcs, counts), "DRAM")
        what = f"NIXL read of {len(dst)} KV blocks from agent {remote}"
        try:
            xfer = self.agent.initialize_xfer("READ", local, far, remote)
        except Exception as exc:
            raise RuntimeError(f"{what} could not be set up: {exc}") from exc
        try:
            state, error = self._wait(xfer, deadline), ""
        except Exception as exc:   # some failures raise, e.g. NIXL_ERR_REMOTE_DISCONNECT
            state, error = "ERR", f": {exc}"
        if state == "DONE":
            xfer.release()
            return
        self._abandon(xfer, remote)
        if state == "PROC":
            raise TimeoutError(f"{what} did not finish within {self.timeout:.0f} s")
        raise RuntimeError(f"{what} failed{error} (UCX_TLS={os.environ.get('UCX_TLS')})")

    def _wait(self, xfer, deadline: float) -> str:
        """Posts the READ and polls it: DONE, ERR, or PROC if the deadline passed first."""
        state, pause = self.agent.transfer(xfer), 5e-5
        while state == "PROC" and time.monotonic() < deadline and not self.pool.stop.is_set():
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)   # short reads finish fast; long ones need no spin
            state = self.agent.check_xfer_state(xfer)
        return state

    def _abandon(self, xfer, remote: str) -> None:
        """Ends a failed or late READ so it cannot land in blocks the engine frees and reuses,
        and drops the connection so the next pull to that agent starts afresh."""
        try:
            xfer.release()   # cancels it if still in flight; raises if it cannot
            released = True
        except Exception as exc:
            released = False
            logger.error("kv-nixl: could not cancel a READ from %s (%s); disconnecting", remote, exc)
        with self._remote_lock:
            for endpoint in [e for e, name in self._remote.items() if name == remote]:
                self._forget(endpoint)   # disconnecting aborts what is still in flight
        if not released:
            try:
                xfer.release()
            except Exception as exc:
                logger.error("kv-nixl: a READ from %s is still not released: %s", remote, exc)

    def close(self) -> None:
        super().close()   # joins the pull threads first
        with self._remote_lock:
            for endpoint in list(self._remote):
                self._forget(endpoint)
        for ctx_request_id in list(self._leased):
            self._lease_ended(ctx_request_id)
        self.agent.deregister_memory(self.reg)


def _check_offer(reply: NixlPullReply, frames: list, dst: np.ndarray, block_nbytes: int) -> None:
    """Raises BadReply unless the offer is exactly dst's count of blocks of our size."""
    if frames:
        raise BadReply(f"the context worker's reply came with {len(frames)} unexpected frames")
    if reply.block_bytes != block_nbytes or len(reply.block_ids) != len(dst):
        raise BadReply(f"the context worker offered {len(reply.block_ids)} KV blocks of "
                       f"{reply.block_bytes} bytes, expected {len(dst)} of {block_nbytes}")
    if len(dst) and (not reply.agent_name or not reply.agent_metadata or reply.base_addr <= 0
                     or min(reply.block_ids) < 0 or max(reply.block_ids) >= 1 << 40):
        raise BadReply("the context worker's offer names no agent, no address, or block ids "
                       "out of range")
    if len(reply.agent_metadata) > MAX_AGENT_METADATA_BYTES:
        raise BadReply(f"the context worker's agent metadata is {len(reply.agent_metadata)} bytes")
