"""KV faults armed from outside the process (kv/faults.py, SPLITSERVE_KV_FAULTS): a CTX's tcp
transport takes each into the one answer it strikes, real transports on loopback; every one
fails the pull or only slows it, never gives the GEN wrong KV, and leaves nothing held."""

import json
import time

import pytest

from splitserve.engine.request import FinishReason
from splitserve.kv.faults import FaultPlan, arm, collect
from splitserve.protocol.engine import RemotePrefill

from disagg_utils import GREEDY, PROMPT, engine, handoff, tokens, wait_for_release
from engine_requests import add_request
from kv_fault_utils import assert_healthy, greedy_reference, pull_with

LEASE = 2.0


@pytest.fixture(scope="module")
def fault_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("kv-faults"))


@pytest.fixture(scope="module")
def pair(tiny_source, fault_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPLITSERVE_KV_FAULTS", fault_dir)
        ctx = engine(tiny_source, "tcp", lease=LEASE)
    gen = engine(tiny_source, "tcp", prefix_caching=False)
    yield ctx, gen, greedy_reference(ctx)
    for e in (ctx, gen):
        e.remote_kv.close()


def pull_stepping_both(ctx, gen, rid):
    """Decodes PROMPT on gen from a fresh handoff, stepping the CTX too (its leases expire
    on its own engine thread); the request's final delta and its tokens."""
    delta = handoff(ctx, rid)
    add_request(gen, rid, PROMPT, GREEDY,
                remote=RemotePrefill(delta.kv_handle, delta.token_ids, delta.logprobs))
    out, deadline = [], time.monotonic() + 20
    while gen.has_unfinished_requests() or gen.pending:
        out += gen.step()
        ctx.step()
        assert time.monotonic() < deadline
        time.sleep(0.002)
    return out[-1], tokens(out)


@pytest.mark.parametrize("kind, error", [
    ("kv_cut", "frames"), ("kv_duplicate", "corrupted"), ("kv_reorder", "corrupted"),
    ("kv_bitflip", "corrupted")])
def test_a_frame_fault_fails_the_pull_and_a_fresh_prefill_gets_the_right_text(
        pair, fault_dir, kind, error):
    ctx, gen, want = pair
    arm(fault_dir, f"1-{kind}", kind, pick=0.4)
    final, _ = pull_stepping_both(ctx, gen, f"bad-{kind}")
    assert final.finish_reason == FinishReason.ERROR and error in final.error, final
    assert final.token_ids == []    # not one token decoded from the faulty KV
    assert collect(fault_dir) == ([kind], 0)
    assert_healthy(gen)
    assert pull_with(gen, f"retry-{kind}", handoff(ctx, f"retry-{kind}")) == want
    wait_for_release(ctx, timeout=LEASE + 5)
    assert ctx.remote_kv.num_leased_blocks == 0


def test_a_delayed_answer_only_slows_the_pull(pair, fault_dir):
    ctx, gen, want = pair
    arm(fault_dir, "2-delay", "kv_delay", pick=0.0, seconds=0.5)
    t0 = time.monotonic()
    final, got = pull_stepping_both(ctx, gen, "late")
    assert time.monotonic() - t0 >= 0.5
    assert final.finish_reason != FinishReason.ERROR and got == want
    assert collect(fault_dir) == (["kv_delay"], 0)
    wait_for_release(ctx)
    assert_healthy(gen)


def test_an_answer_sent_after_its_lease_expired_never_decodes_wrong_kv(pair, fault_dir):
    ctx, gen, want = pair
    arm(fault_dir, "3-expiry", "kv_lease_expiry", pick=0.0, seconds=LEASE + 1.0)
    final, got = pull_stepping_both(ctx, gen, "expired")
    # Its blocks were freed while the answer waited: the bytes arrive intact (nothing wrote
    # them since) and decode to the right text, or the pull fails; never other text.
    assert got == want or (final.finish_reason == FinishReason.ERROR and got == []), final
    assert collect(fault_dir) == (["kv_lease_expiry"], 0)
    assert ctx.remote_kv.num_leased_blocks == 0    # expired, and the late ack freed nothing twice
    assert_healthy(gen)


def test_a_fault_strikes_one_answer_of_one_process_and_only_where_it_applies(tmp_path):
    d = str(tmp_path)
    one, two = FaultPlan(d, "one"), FaultPlan(d, "two")
    frames = [b"a" * 8, b"b" * 8, b"c" * 8]
    arm(d, "1", "kv_reorder", pick=0.9)
    assert one.strike(frames[:1]) == frames[:1]     # a reorder needs two frames: left armed
    assert one.strike(frames) == [b"a" * 8, b"c" * 8, b"b" * 8]
    assert two.strike(frames) == frames             # taken: nothing left for another
    arm(d, "2", "kv_cut", pick=0.5)
    assert two.strike(frames) == [b"a" * 8, b"bbbb"]
    arm(d, "3", "kv_bitflip", pick=0.0)
    flipped = one.strike(frames)
    assert sum(bin(x ^ y).count("1") for f, g in zip(frames, flipped) for x, y in zip(f, g)) == 1
    arm(d, "4", "kv_duplicate", pick=0.0)
    assert one.strike(frames) == [b"a" * 8, b"a" * 8, b"c" * 8]
    (tmp_path / "armed-junk").write_text("not json")
    (tmp_path / "armed-other").write_text(json.dumps({"kind": "kv_meltdown"}))
    arm(d, "5", "kv_cut", pick=0.0)
    assert one.strike([]) == []                     # no frames to cut (a nixl offer)
    assert collect(d) == (["kv_reorder", "kv_cut", "kv_bitflip", "kv_duplicate"], 3)
    with pytest.raises(ValueError, match="unknown KV fault"):
        arm(d, "6", "kv_meltdown", pick=0.0)


def test_without_the_variable_no_transport_takes_faults(pair):
    ctx, gen, _ = pair
    assert isinstance(ctx.remote_kv.transport.faults, FaultPlan)
    assert gen.remote_kv.transport.faults is None
