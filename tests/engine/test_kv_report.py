"""The engine's report of its cached block hashes: sent when the cache changed, bounded."""

import time

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.kv_report import CacheReporter
from splitserve.protocol.block_hashes import chain_hashes
from splitserve.tokens import PromptTokens
from test_block_manager import computed


def hashes_of(report) -> list[bytes]:
    return [report.hashes[i:i + 16] for i in range(0, len(report.hashes), 16)]


def test_a_report_lists_the_cached_hashes_and_only_when_they_changed():
    bm = BlockManager(num_blocks=16, block_size=4)
    reporter = CacheReporter(bm, every=0.0)
    first = reporter.due()
    assert first is not None and first.total == 0 and first.hashes == b""
    assert reporter.due() is None                       # nothing changed
    tokens = list(range(10))
    computed(bm, tokens)
    report = reporter.due()
    want = chain_hashes(b"", PromptTokens.from_list(tokens).array, 4)
    assert set(hashes_of(report)) == set(want) and report.total == 2 and report.block_size == 4
    assert report.version != first.version
    assert reporter.due() is None


def test_evicting_a_cached_block_changes_the_report():
    bm = BlockManager(num_blocks=3, block_size=4)
    reporter = CacheReporter(bm, every=0.0)
    r = computed(bm, list(range(8)))
    bm.free(r)
    before = reporter.due()
    assert before.total == 2
    computed(bm, list(range(100, 112)), "other")        # takes every block: evicts both
    after = reporter.due()
    assert after.version != before.version
    assert not set(hashes_of(after)) & set(hashes_of(before))


def test_a_report_is_bounded_and_keeps_the_newest_hashes():
    bm = BlockManager(num_blocks=64, block_size=4)
    for i in range(8):
        computed(bm, list(range(1000 * i, 1000 * i + 8)), f"r{i}")
    newest = chain_hashes(b"", PromptTokens.from_list(list(range(7000, 7008))).array, 4)
    report = CacheReporter(bm, every=0.0, limit=3).due()
    assert report.total == 16 and len(hashes_of(report)) == 3
    assert set(newest) <= set(hashes_of(report))


def test_reports_are_at_most_one_per_interval():
    bm = BlockManager(num_blocks=16, block_size=4)
    reporter = CacheReporter(bm, every=0.2)
    assert reporter.due() is not None
    computed(bm, list(range(8)))
    assert reporter.due() is None                       # changed, but too soon
    time.sleep(0.25)
    assert reporter.due().total == 2
