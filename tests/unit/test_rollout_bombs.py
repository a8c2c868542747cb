"""Rollout files built to exhaust the reader's memory: each is rejected with a reason, cheaply.

The bombs are built in tests/rollout_files.py. Here each is refused with its reason in this process;
tests/integration/test_rollout_bomb_memory.py parses each in a fresh process and bounds its peak memory.
"""

from __future__ import annotations

import doctest
import hashlib
from dataclasses import replace

import pytest
from rollout_files import (DEFAULT, LIMITS, delta_prefixes, dictionary_page, forge_footer, huge_footer,
                           long_lists, make_rows, many_row_groups, understate)

import intellect.rl.wire.parquet_bounds as bounds_mod
from intellect.rl.wire.parquet_bounds import LayoutError, read_struct
from intellect.rl.wire.rollouts import (
    RolloutRejected,
    encode_submission,
    load_submission,
    read_submission,
    write_submission,
)
from intellect.storage import RunStorage


def test_the_forging_codec_round_trips():
    data = encode_submission(make_rows())
    assert forge_footer(data, lambda f: f) == data
    assert read_submission(forge_footer(data, lambda f: f), LIMITS) == make_rows()


def test_a_bomb_names_what_it_exceeds():
    with pytest.raises(RolloutRejected, match="too_large: output_tokens.* values in 16 rows"):
        read_submission(long_lists(1 << 16), DEFAULT)
    with pytest.raises(RolloutRejected, match="too_large: proof: pages decompress to"):
        read_submission(dictionary_page("proof", 32 << 20), DEFAULT)
    # a dictionary within the file's total but with values over the per-row bound: caught before it expands
    with pytest.raises(RolloutRejected, match=r"range: proof bytes spans \[4194304"):
        read_submission(dictionary_page("proof", 4 << 20), DEFAULT)
    with pytest.raises(RolloutRejected, match="unreadable: output_tokens.*pages hold .* the footer says 160"):
        read_submission(forge_footer(long_lists(1 << 16), understate("output_tokens", 160, 400)), DEFAULT)
    with pytest.raises(RolloutRejected, match="too_large: .*row groups"):
        read_submission(many_row_groups(20), LIMITS)
    with pytest.raises(RolloutRejected, match="unreadable: proof: page encoding 7 is not accepted"):
        read_submission(delta_prefixes(4, 1 << 10), DEFAULT)


def test_an_oversized_footer_is_refused_before_it_is_parsed():
    with pytest.raises(RolloutRejected, match="too_large: footer of"):
        read_submission(huge_footer(), DEFAULT)


def test_expansion_past_the_decoded_bound_stops_at_that_batch():
    # honest within per-row limits, but over a small total: caught from the dictionary before it expands
    rows = [replace(r, proof=b"\0" * 500) for r in make_rows(16)]
    with pytest.raises(RolloutRejected, match="too_large"):
        read_submission(encode_submission(rows), LIMITS.model_copy(update={"max_decoded_bytes": 4096}))


# ------------------------------------------------------------------ the bounded read from storage


def test_load_reads_at_most_the_cap_and_checks_the_declared_digest(tmp_path):
    store = RunStorage(f"file://{tmp_path}/run")
    rel = write_submission(store, 3, "w1", 0, make_rows())
    data = store.read_bytes(rel)
    digest = hashlib.sha256(data).hexdigest()
    assert load_submission(store, rel, LIMITS, sha256=digest, size=len(data)) == make_rows()
    assert load_submission(store, rel, LIMITS, sha256=digest.upper()) == make_rows()
    for kwargs, reason in [
        ({"sha256": "0" * 64}, "sha256_mismatch"),
        ({"sha256": "not hex"}, "sha256_mismatch"),
        ({"sha256": "é" * 64}, "sha256_mismatch"),
        ({"size": len(data) - 1}, "size_mismatch"),
        ({"size": len(data) + 1}, "size_mismatch"),
    ]:
        with pytest.raises(RolloutRejected) as e:
            load_submission(store, rel, LIMITS, **kwargs)
        assert e.value.reason == reason, kwargs
    small = LIMITS.model_copy(update={"max_file_bytes": len(data) - 1})
    with pytest.raises(RolloutRejected, match="too_large"):
        load_submission(store, rel, small)


def test_an_object_that_grows_while_read_is_cut_at_the_cap(tmp_path, monkeypatch):
    # storage that cannot tell the size up front: the read itself stops one byte past the cap
    store = RunStorage(f"file://{tmp_path}/run")
    rel = write_submission(store, 3, "w1", 0, make_rows())
    store.write_bytes(rel, store.read_bytes(rel) + b"\0" * (1 << 20))
    monkeypatch.setattr(store, "local_path", lambda rel: None)
    monkeypatch.setattr(store.fs, "size", lambda path: None)
    reads = []
    real = store.fs.cat_file
    monkeypatch.setattr(store.fs, "cat_file", lambda *a, **k: reads.append(k) or real(*a, **k))
    limits = LIMITS.model_copy(update={"max_file_bytes": 64 << 10})
    with pytest.raises(RolloutRejected, match="too_large"):
        load_submission(store, rel, limits)
    assert reads == [{"start": 0, "end": (64 << 10) + 1}]


# ------------------------------------------------------------------ the page walker itself


def test_docstring_examples_hold():
    result = doctest.testmod(bounds_mod)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("blob", [b"", b"\x15", b"\x19\xf5", b"\x1c" * 20, b"\x18\xff\xff\xff\x0f", b"\x15\x80" * 8])
def test_malformed_thrift_is_a_layout_error(blob):
    with pytest.raises(LayoutError) as e:
        read_struct(blob)
    assert e.value.reason == "unreadable"
