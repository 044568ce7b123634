"""The scheduler alone: a real BlockManager, no model, no tokenizer. Each step's "model
output" (a sampled token id for every request that samples) is made up here and fed back
the way EngineCore.step() feeds it (computed(), forks, append_token(), finish()); each test
asserts what was scheduled and where every request is. check() asserts the invariants
engine/queues.py states, after every call that changes state."""

import ast
import pathlib

import numpy as np

import splitserve.engine
from splitserve.config import SchedulerConfig
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.request import NO_BLOCKS, Request, RequestStatus
from splitserve.engine.scheduler import Scheduler
from splitserve.protocol.engine import FinishReason, KVHandle, RemotePrefill, RequestKind
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens

BS = 4          # tokens per block
EOS = 2
TOKEN = 5       # what a request samples unless a test says otherwise
S = RequestStatus


def scheduler(num_blocks=64, budget=16, max_seqs=8, prefix=True) -> Scheduler:
    return Scheduler(SchedulerConfig(budget, max_seqs), BlockManager(num_blocks, BS, prefix))


def request(rid: str, prompt_len: int, *, n=1, first=10, remote=None,
            kind=RequestKind.AGGREGATED, **params) -> Request:
    """The leader of a request whose prompt is first, first + 1, ... (n > 1: it holds its
    siblings, as EngineCore._admit builds them)."""
    prompt = (PromptTokens.placeholder(prompt_len) if first is None else
              PromptTokens(np.arange(first, first + prompt_len, dtype=np.int32)))
    sp = SamplingParams(**{"max_tokens": 8, **params})
    eos = () if sp.ignore_eos else (EOS,)
    siblings = [Request(f"{rid}#{i}", prompt, sp, eos, group_id=rid, index=i) for i in range(1, n)]
    return Request(rid if n == 1 else f"{rid}#0", prompt, sp, eos, group_id=rid, kind=kind,
                   remote=remote, siblings=siblings)


def remote_prefill(prompt_len: int) -> RemotePrefill:
    handle = KVHandle(backend="tcp", endpoint="tcp://127.0.0.1:1", ctx_request_id="ctx",
                      layout="layout", num_tokens=prompt_len)
    return RemotePrefill(handle, [TOKEN])


def add(sched: Scheduler, *requests: Request) -> None:
    for r in requests:
        sched.add(r)
    check(sched)


class Step:
    def __init__(self, out):
        self.out = out
        self.ended: dict[str, FinishReason] = {}
        self.copies: list[tuple[int, int]] = []

    @property
    def scheduled(self) -> dict[str, int]:
        """request id -> tokens, in batch order."""
        return {r.request_id: n for r, n in self.out.scheduled.items()}


def step(sched: Scheduler, tokens: dict[str, int] | None = None) -> Step:
    """One engine step: schedule; every scheduled chunk's KV computed; each request whose
    prompt and output are now all computed forks its siblings (n > 1) and samples
    tokens[its id] (default TOKEN); a request that ends with it is finished."""
    s = Step(sched.schedule())
    check(sched)
    for req, n in s.out.scheduled.items():
        sched.computed(req, n)
    for req in list(s.out.scheduled):
        if req.num_computed_tokens < req.num_tokens:
            continue   # mid-prefill: no logits to sample
        forked = [sib for sib in sched.release_siblings(req)
                  if sched.fork(req, sib, lambda src, dst: s.copies.append((src, dst)))]
        for r in (req, *forked):
            sample(sched, r, (tokens or {}).get(r.request_id, TOKEN), s.ended)
    check(sched)
    return s


def sample(sched: Scheduler, req: Request, token: int, ended: dict, stop_string=None) -> None:
    reason = sched.append_token(req, token, stop_string)
    if reason is not None:
        sched.finish(req, reason)
        ended[req.request_id] = reason


def check(sched: Scheduler, pulling: tuple[Request, ...] = ()) -> None:
    """queues.py's invariants. pulling: finished requests whose KV pull still writes their
    blocks (they hold them until pull_ended())."""
    where: dict[int, str] = {}
    for name, queue, statuses in (("waiting", sched.waiting, {S.WAITING, S.PREEMPTED}),
                                  ("running", sched.running, {S.RUNNING}),
                                  ("transferring", sched.transferring, {S.WAITING_FOR_REMOTE_KV})):
        for r in queue:
            assert r.status in statuses, f"{r} is in {name}"
            assert id(r) not in where, f"{r} is in {where[id(r)]} and {name}"
            where[id(r)] = name
    holders = [r.block_ids for r in pulling]
    for gid, group in sched.groups.items():
        assert not all(r.is_finished for r in group), f"finished group {gid} kept"
        for r in group:
            if r.status == S.WAITING_FOR_FORK:
                assert r in group[0].siblings and id(r) not in where, r
            elif r.is_finished:
                assert id(r) not in where and r not in group[0].siblings, r
                assert r.pulling or not len(r.block_ids), f"finished {r} holds blocks"
            else:
                assert id(r) in where, f"{r} is in no queue"
            if r not in pulling:
                holders.append(r.block_ids)
    queued = [r for q in (sched.waiting, sched.running, sched.transferring) for r in q]
    assert all(r in sched.groups.get(r.group_id, ()) for r in queued)
    bm = sched.bm
    refs = np.bincount(np.concatenate([NO_BLOCKS, *holders]), minlength=bm.num_blocks)
    assert (refs == bm.ref_counts).all(), "a block's references are not its holders'"
    assert bm.num_free_blocks == np.count_nonzero(bm.ref_counts == 0)


def finished_clean(sched: Scheduler) -> bool:
    bm = sched.bm
    return not sched.groups and bm.num_free_blocks == bm.num_blocks


# -- the batch --------------------------------------------------------------------------------
def test_the_token_budget_goes_to_decodes_first_then_to_prefill_chunks():
    sched = scheduler(budget=16)
    a, b, c = request("a", 6), request("b", 6, first=30), request("c", 30, first=100)
    add(sched, a, b)
    assert step(sched).scheduled == {"a": 6, "b": 6}          # both prompts fit in 16
    add(sched, c)
    first = step(sched)
    assert first.scheduled == {"a": 1, "b": 1, "c": 14}       # decodes first, c gets the rest
    assert first.out.num_tokens == 16
    assert step(sched).scheduled == {"a": 1, "b": 1, "c": 14}
    assert c.num_output_tokens == 0                           # mid-prefill: nothing sampled
    last = step(sched)
    assert last.scheduled == {"a": 1, "b": 1, "c": 2}         # 30 = 14 + 14 + 2
    assert c.output_token_ids == [TOKEN] and c.num_computed_tokens == 30
    assert step(sched).scheduled == {"a": 1, "b": 1, "c": 1}


def test_while_requests_decode_prefill_chunks_take_at_most_their_own_budget():
    sched = Scheduler(SchedulerConfig(16, 8, max_prefill_tokens_while_decoding=4),
                      BlockManager(64, BS, True))
    a, b, c = request("a", 6), request("b", 10, first=30), request("c", 9, first=100)
    add(sched, a)
    assert step(sched).scheduled == {"a": 6}                  # nothing decodes: the whole step
    add(sched, b, c)
    assert step(sched).scheduled == {"a": 1, "b": 4}          # a decodes: b's chunk is 4
    assert sched.num_prefill_tokens == 6 + 9                  # b's rest, c waiting
    assert step(sched).scheduled == {"a": 1, "b": 4}          # c waits its turn
    assert step(sched).scheduled == {"a": 1, "b": 2, "c": 2}  # b's last 2, c the rest of 4
    assert step(sched).scheduled == {"a": 1, "b": 1, "c": 4}
    assert sched.num_prefill_tokens == 3


def test_a_pulled_prompt_is_no_prefill_work_and_waiting_prompts_are():
    sched = scheduler(budget=8)
    pulled = request("p", 12, first=None, remote=remote_prefill(12),
                     kind=RequestKind.GENERATION_ONLY)
    add(sched, pulled, request("a", 20))
    assert sched.num_prefill_tokens == 20
    step(sched)
    assert sched.num_prefill_tokens == 12                     # 8 of a's 20 computed


def test_max_num_seqs_keeps_the_rest_waiting_in_arrival_order():
    sched = scheduler(max_seqs=2)
    add(sched, *(request(rid, 3, first=10 * i) for i, rid in enumerate("xyz")))
    assert step(sched).scheduled == {"x": 3, "y": 3}
    assert [r.request_id for r in sched.waiting] == ["z"]


def test_a_cached_prefix_is_not_computed_again():
    sched = scheduler()
    add(sched, request("a", 13, max_tokens=1))
    assert step(sched).ended == {"a": FinishReason.LENGTH}
    assert finished_clean(sched)                  # freed, but its full blocks stay cached
    same, shared = request("same", 13), request("shared", 10)
    add(sched, same, shared)
    s = step(sched)
    # 13 tokens: 3 full blocks cached, the last token computed (it samples from it); the
    # second shares the first 2 blocks (8 tokens) and computes its last 2.
    assert s.scheduled == {"same": 1, "shared": 2}
    assert (same.num_cached_tokens, shared.num_cached_tokens) == (12, 8)
    assert same.output_token_ids == shared.output_token_ids == [TOKEN]


def test_out_of_blocks_the_newest_request_is_preempted_and_later_recomputed():
    # 6 blocks of 4: two 8-token prompts decoding 8 tokens each need 4 blocks apiece.
    sched = scheduler(num_blocks=6, prefix=False)
    a, b = request("a", 8, ignore_eos=True), request("b", 8, first=50, ignore_eos=True)
    add(sched, a, b)
    steps = [step(sched) for _ in range(5)]
    assert all(not s.out.preempted for s in steps)             # 3 blocks each so far
    s = step(sched)                                            # token 13 needs a 4th block
    assert s.out.preempted == [b] and s.scheduled == {"a": 1}
    assert b.status == S.PREEMPTED and sched.waiting[0] is b
    assert len(b.block_ids) == 0 and b.num_computed_tokens == 0 and b.num_output_tokens == 5
    while not a.is_finished:
        step(sched)
    resumed = step(sched)
    assert resumed.scheduled == {"b": 13}      # its prompt and output recomputed at once
    assert b.status == S.RUNNING and b.num_output_tokens == 6
    while sched.groups:
        step(sched)
    assert a.num_output_tokens == b.num_output_tokens == 8 and finished_clean(sched)


def test_n_siblings_wait_for_the_leaders_prefill_then_fork_sharing_its_blocks():
    sched = scheduler()
    leader = request("n3", 10, n=3)
    sibs = list(leader.siblings)
    add(sched, leader)
    assert len(sched.groups["n3"]) == 3 and list(sched.waiting) == [leader]
    assert all(s.status == S.WAITING_FOR_FORK for s in sibs)
    s = step(sched)
    assert s.scheduled == {"n3#0": 10}                         # the prompt is computed once
    assert all(r.status == S.RUNNING and r.output_token_ids == [TOKEN] for r in sibs)
    full = leader.block_ids[:2]                                # 10 tokens: 2 full blocks ...
    assert (sched.bm.ref_counts[full] == 3).all()
    partial = int(leader.block_ids[2])                         # ... and a partial one, copied
    assert s.copies == [(partial, int(sibs[0].block_ids[2])), (partial, int(sibs[1].block_ids[2]))]
    assert step(sched).scheduled == {"n3#0": 1, "n3#1": 1, "n3#2": 1}


def test_a_sibling_without_a_free_block_waits_and_is_recomputed_from_the_cache():
    sched = scheduler(num_blocks=3)
    leader = request("n2", 10, n=2, max_tokens=2)
    sib = leader.siblings[0]
    add(sched, leader)
    step(sched)                                  # 10 tokens take all 3 blocks: none to fork
    assert sib.status == S.WAITING and list(sched.waiting) == [sib]
    assert step(sched).ended == {"n2#0": FinishReason.LENGTH}
    s = step(sched)                              # the leader's 2 full blocks are cached
    assert s.scheduled == {"n2#1": 2} and sib.num_cached_tokens == 8
    step(sched)
    assert sib.num_output_tokens == 2 and finished_clean(sched)


# -- generation_only --------------------------------------------------------------------------
def test_a_generation_only_request_pulls_its_kv_without_budget_then_decodes():
    sched = scheduler(budget=2)
    a, b = request("a", 1, max_tokens=3), request("b", 1, first=40, max_tokens=3)
    add(sched, a, b)
    step(sched)
    step(sched)
    gen = request("gen", 12, first=None, remote=remote_prefill(12),
                  kind=RequestKind.GENERATION_ONLY)
    add(sched, gen)
    s = step(sched)
    assert s.scheduled == {"a": 1, "b": 1}       # the decodes take the whole budget ...
    assert s.out.pulls == [gen]                  # ... and the pull starts all the same
    assert gen.status == S.WAITING_FOR_REMOTE_KV and list(sched.transferring) == [gen]
    assert len(gen.block_ids) == 3 and gen.num_computed_tokens == 0
    gen.pulling = True                           # (the transport writes its blocks now)
    s = step(sched)
    assert not s.scheduled and not s.out.pulls and gen.status == S.WAITING_FOR_REMOTE_KV
    gen.pulling = False
    assert sched.pull_ended(gen)
    sched.kv_arrived(gen)
    check(sched)
    assert gen.status == S.RUNNING and gen.num_computed_tokens == 12 and gen.remote is None
    sample(sched, gen, TOKEN, {})                # the context worker's first token
    assert step(sched).scheduled == {"gen": 1} and gen.num_output_tokens == 2


def test_a_request_aborted_while_its_kv_arrives_frees_its_blocks_when_the_pull_ends():
    sched = scheduler()
    gen = request("gen", 8, first=None, remote=remote_prefill(8), kind=RequestKind.GENERATION_ONLY)
    add(sched, gen)
    step(sched)
    gen.pulling = True
    sched.finish(gen, FinishReason.ABORT)
    check(sched, pulling=(gen,))
    assert gen.status == S.FINISHED_ABORTED and not sched.groups and len(gen.block_ids) == 2
    gen.pulling = False
    assert not sched.pull_ended(gen)
    assert finished_clean(sched)


# -- endings ----------------------------------------------------------------------------------
def test_a_request_ends_on_eos_a_stop_token_a_stop_string_or_max_tokens():
    sched = scheduler()
    eos, stop_id, stop_str, length, ignore = (
        request("eos", 3), request("stop_id", 3, first=20, stop_token_ids=(7,)),
        request("stop_str", 3, first=30), request("length", 3, first=40, max_tokens=2),
        request("ignore", 3, first=50, ignore_eos=True, max_tokens=2))
    add(sched, eos, stop_id, stop_str, length, ignore)
    s = step(sched, {"eos": EOS, "stop_id": 7, "ignore": EOS})
    assert s.ended == {"eos": FinishReason.STOP, "stop_id": FinishReason.STOP}
    assert (eos.stop_reason, stop_id.stop_reason) == (None, 7)
    ended = {}
    out = sched.schedule()   # stop_str: the stop string the detokenizer matched ends it
    for req, n in out.scheduled.items():
        sched.computed(req, n)
        sample(sched, req, TOKEN, ended, stop_string="end" if req is stop_str else None)
    check(sched)
    assert ended == {"stop_str": FinishReason.STOP, "length": FinishReason.LENGTH,
                     "ignore": FinishReason.LENGTH}
    assert stop_str.stop_reason == "end" and ignore.output_token_ids == [EOS, TOKEN]
    assert eos.status == S.FINISHED_STOPPED and length.status == S.FINISHED_LENGTH
    assert finished_clean(sched)


def test_a_context_only_request_hands_off_after_its_first_token():
    sched = scheduler()
    ctx = request("ctx", 5, kind=RequestKind.CONTEXT_ONLY)
    add(sched, ctx)
    assert step(sched).ended == {"ctx": FinishReason.HANDOFF}
    assert ctx.status == S.FINISHED_HANDOFF and finished_clean(sched)


def test_an_abort_ends_a_request_wherever_it_is_and_its_unforked_siblings_with_it():
    sched = scheduler(budget=8)
    running, waiting, group = request("run", 4), request("wait", 20, first=40), request("n", 6, n=3)
    sibs = list(group.siblings)
    add(sched, running, group, waiting)
    step(sched)                          # run (4) and n's leader (4 of 6) are scheduled
    assert running.status == group.status == S.RUNNING and waiting.status == S.WAITING
    for r in (waiting, running, group):
        sched.finish(r, FinishReason.ABORT)
        check(sched)
    assert all(r.status == S.FINISHED_ABORTED for r in (running, waiting, group, *sibs))
    assert finished_clean(sched) and not sched.waiting and not sched.running


# -- ownership --------------------------------------------------------------------------------
ENGINE = pathlib.Path(splitserve.engine.__file__).parent
OWNERS = {"scheduler.py", "queues.py", "request.py"}     # request.py: its constructor
STATE = {"status", "num_computed_tokens", "siblings", "output_token_ids"}
QUEUES = {"waiting", "running", "transferring", "groups", "siblings", "output_token_ids"}
MUTATORS = {"append", "appendleft", "extend", "insert", "remove", "pop", "popleft", "clear"}


def state_changes(tree: ast.AST) -> list[str]:
    """Assignments to a request's state, and calls that change a queue, in one module."""
    found = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else
                   node.targets if isinstance(node, ast.Delete) else [])
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and sub.attr in STATE:
                    found.append(f"line {node.lineno}: sets .{sub.attr}")
                if (isinstance(sub, ast.Subscript) and isinstance(sub.value, ast.Attribute)
                        and sub.value.attr in QUEUES):
                    found.append(f"line {node.lineno}: writes .{sub.value.attr}[...]")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr in QUEUES):
            found.append(f"line {node.lineno}: .{node.func.value.attr}.{node.func.attr}()")
    return found


def test_only_the_scheduler_changes_a_requests_state():
    offenders = {}
    for path in sorted(ENGINE.glob("*.py")):
        if path.name not in OWNERS:
            found = state_changes(ast.parse(path.read_text()))
            if found:
                offenders[path.name] = found
    assert offenders == {}, "state changed outside the scheduler (engine/queues.py)"


def test_the_ownership_check_sees_a_state_change():
    code = "def fork(self, sib):\n    sib.status = 3\n    self.scheduler.running.append(sib)\n"
    assert state_changes(ast.parse(code)) == ["line 2: sets .status",
                                              "line 3: .running.append()"]
