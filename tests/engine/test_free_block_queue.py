import numpy as np
from hypothesis import given, settings, strategies as st

from splitserve.engine.free_block_queue import FreeBlockQueue


def test_pops_skip_removed_blocks_and_pushes_append():
    q = FreeBlockQueue(6)
    q.remove(np.array([1, 3]))
    blocks = q.pop(3)
    assert blocks.dtype == np.int64 and blocks.tolist() == [0, 2, 4] and len(q) == 1
    q.push(np.array([3, 0]))
    assert q.order() == [5, 3, 0]


def test_squeezing_out_holes_keeps_the_order():
    q = FreeBlockQueue(4)                        # room for 8 slots
    for _ in range(3):                           # each round writes 4 more slots
        blocks = q.pop(4)
        q.push(blocks[::-1].copy())
    q.remove(np.array([2]))                      # queue: 3, 1, 0 with a hole after 3
    blocks = q.pop(1)
    q.push(blocks)                               # no room left: the hole is squeezed out
    assert blocks.tolist() == [3] and q.order() == [1, 0, 3] and len(q) == 3
    assert q.pop(3).tolist() == [1, 0, 3]


ops = st.lists(st.tuples(st.sampled_from(["pop", "remove", "push"]), st.integers(0, 99)),
               max_size=80)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_queue_matches_a_list(ops):
    q, model, taken = FreeBlockQueue(8), list(range(8)), []
    for op, k in ops:
        if op == "pop" and model:
            n = k % len(model) + 1
            blocks = q.pop(n)
            assert blocks.tolist() == model[:n]
            taken += blocks.tolist()
            del model[:n]
        elif op == "remove" and model:
            gone = model[k % len(model)::3]      # several blocks from the middle on
            q.remove(np.array(gone))
            model = [b for b in model if b not in gone]
            taken += gone
        elif op == "push" and taken:
            back = taken[k % len(taken):][::-1]
            q.push(np.array(back))
            model += back
            taken = [b for b in taken if b not in back]
        assert q.order() == model and len(q) == len(model)
