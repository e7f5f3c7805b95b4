"""DenseAssembler: versions served only whole, partial versions on their base, duplicates,
gaps, damaged chunks, and its state across a restart in the middle of a version."""

from __future__ import annotations

import numpy as np
import pytest

from consumers.dense_assembly import DenseAssembler, merge_states
from deltastream.dense_wire import DenseChunk, chunk_version, decode_dense, encode_dense

MODEL = "m"


def _tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"mlp.0.weight": rng.standard_normal((16, 8)).astype(np.float32),
            "mlp.0.bias": rng.standard_normal(16).astype(np.float32),
            "bn.running_mean": rng.standard_normal(8).astype(np.float32)}


def _chunks(tensors: dict, *, seq: int, step: int, epoch: int = 1,
            base_step: int | None = None, max_bytes: int = 700,
            shard: int = 0) -> list[DenseChunk]:
    """Chunks of one version as a predictor decodes them (encoded, then decoded)."""
    cs = chunk_version(tensors, model=MODEL, shard=shard, epoch=epoch, seq=seq, step=step,
                       ts=step * 10**9, base_step=base_step, max_message_bytes=max_bytes)
    return [decode_dense(m) for m in encode_dense(cs)]


def _same(view, tensors: dict) -> bool:
    return sorted(view.tensors) == sorted(tensors) and all(
        np.array_equal(view[k], v) for k, v in tensors.items())


def test_a_version_is_served_only_once_every_chunk_arrived():
    a, t = DenseAssembler(), _tensors(0)
    chunks = _chunks(t, seq=0, step=10)
    assert len(chunks) > 3  # a multi-chunk version
    verdicts = [a.offer(c)[0] for c in chunks]
    assert verdicts == ["taken"] * (len(chunks) - 1) + ["served"]
    v = a.view()
    assert v.version == (1, 10) and v.ts == 10 * 10**9 and _same(v, t)
    with pytest.raises(ValueError):
        v["mlp.0.bias"][0] = 1.0  # read-only


def test_before_the_last_chunk_the_previous_version_stays_served():
    a, t1, t2 = DenseAssembler(), _tensors(1), _tensors(2)
    first = _chunks(t1, seq=0, step=10)
    for c in first:
        a.offer(c)
    held = a.view()
    for c in _chunks(t2, seq=len(first), step=20)[:-1]:
        assert a.offer(c)[0] == "taken"
        assert a.view() is held and _same(a.view(), t1)


def test_a_partial_version_builds_on_its_base_and_shares_unchanged_tensors():
    a, t = DenseAssembler(), _tensors(3)
    full = _chunks(t, seq=0, step=10)
    for c in full:
        a.offer(c)
    changed = {"mlp.0.bias": t["mlp.0.bias"] + 1}
    part = _chunks(changed, seq=len(full), step=20, base_step=10)
    assert [a.offer(c)[0] for c in part][-1] == "served"
    v = a.view()
    assert v.version == (1, 20) and _same(v, {**t, **changed})
    assert v["mlp.0.weight"] is a.view()["mlp.0.weight"]


def test_a_partial_version_whose_base_is_not_held_is_never_served():
    a, t = DenseAssembler(), _tensors(4)
    full = _chunks(t, seq=0, step=10)
    for c in full:
        a.offer(c)
    part = _chunks({"mlp.0.bias": t["mlp.0.bias"] * 2}, seq=len(full), step=30, base_step=20)
    assert [a.offer(c)[0] for c in part][-1] == "unbased"
    assert a.view().version == (1, 10) and a.counters["unbased"] == 1


def test_duplicates_and_replays_are_applied_once():
    a, t = DenseAssembler(), _tensors(5)
    chunks = _chunks(t, seq=0, step=10)
    for c in chunks[:3]:
        a.offer(c)
    assert [a.offer(c)[0] for c in chunks[:3]] == ["duplicate"] * 3
    for c in chunks[3:]:
        a.offer(c)
    assert [a.offer(c)[0] for c in chunks] == ["duplicate"] * len(chunks)
    assert a.counters["duplicates"] == 3 + len(chunks) and _same(a.view(), t)


def test_a_missing_chunk_means_the_version_is_never_served_and_the_gap_is_counted():
    a, t1, t2, t3 = DenseAssembler(), _tensors(6), _tensors(7), _tensors(8)
    first = _chunks(t1, seq=0, step=10)
    for c in first:
        a.offer(c)
    second = _chunks(t2, seq=len(first), step=20)
    missing = 2
    verdicts = [a.offer(c)[0] for i, c in enumerate(second) if i != missing]
    assert verdicts[-1] == "lost" and "served" not in verdicts
    assert a.view().version == (1, 10) and _same(a.view(), t1)
    assert a.counters["gaps"] == 1 and a.counters["missing_chunks"] == 1
    assert a.counters["incomplete"] == 1
    for c in _chunks(t3, seq=len(first) + len(second), step=30):
        a.offer(c)
    assert a.view().version == (1, 30) and _same(a.view(), t3)


def test_a_full_version_of_the_step_whose_partial_version_lost_its_tail_is_served():
    # DensePublisher.flush(step) after a tick's partial version of the same step: two
    # versions share (epoch, step); chunk 0 of the second starts it, whatever the first left
    a, t1 = DenseAssembler(), _tensors(10)
    first = _chunks(t1, seq=0, step=10)
    for c in first:
        a.offer(c)
    t2 = {**t1, "mlp.0.weight": t1["mlp.0.weight"] + 1}
    part = _chunks({"mlp.0.weight": t2["mlp.0.weight"]}, seq=len(first), step=20,
                   base_step=10)
    assert len(part) > 1
    assert "served" not in [a.offer(c)[0] for c in part[:-1]]  # its last chunk is lost
    full = _chunks(t2, seq=len(first) + len(part), step=20)
    verdicts = [a.offer(c)[0] for c in full]
    assert verdicts == ["taken"] * (len(full) - 1) + ["served"]
    assert a.view().version == (1, 20) and _same(a.view(), t2)
    assert a.counters["incomplete"] == 1 and a.counters["missing_chunks"] == 1


def test_a_chunk_that_contradicts_its_version_is_refused_and_the_version_lost():
    a, t = DenseAssembler(), _tensors(9)
    chunks = _chunks(t, seq=0, step=10)
    a.offer(chunks[0])
    c = chunks[1]
    bad = DenseChunk(**{**c.__dict__, "shape": (c.shape[0] + 1, *c.shape[1:])})
    kind, why = a.offer(bad)
    assert kind == "refused" and "shape" in why
    assert [a.offer(c)[0] for c in chunks[2:]][-1] == "lost"
    assert a.view() is None


def test_a_stale_epoch_is_skipped():
    a = DenseAssembler()
    for c in _chunks(_tensors(10), seq=0, step=10, epoch=2):
        a.offer(c)
    assert {a.offer(c)[0] for c in _chunks(_tensors(11), seq=0, step=50, epoch=1)} \
        == {"stale"}
    assert a.view().version == (2, 10)


@pytest.mark.parametrize("cut", [0, 1, 3])
def test_state_in_the_middle_of_a_version_resumes_exactly(cut):
    t1, t2 = _tensors(12), _tensors(13)
    stream = _chunks(t1, seq=0, step=10)
    stream += _chunks(t2, seq=len(stream), step=20)
    whole = DenseAssembler()
    for c in stream:
        whole.offer(c)
    at = len(stream) - 4 + cut  # inside the second version
    first = DenseAssembler()
    for c in stream[:at]:
        first.offer(c)
    again = DenseAssembler.from_state(first.state())
    assert again.view().version == (1, 10)
    for c in stream[at - 2:]:  # the replay re-reads a little before the cut
        again.offer(c)
    assert again.view().version == whole.view().version == (1, 20)
    assert _same(again.view(), t2) and again.state() == whole.state()


def test_malformed_state_is_refused():
    with pytest.raises(ValueError, match="dense state"):
        DenseAssembler.from_state(b"\x81\xa7version\x09")


def test_a_tensor_too_large_to_assemble_is_refused_not_allocated():
    a = DenseAssembler()
    c = _chunks(_tensors(14), seq=0, step=10)[0]
    huge = DenseChunk(**{**c.__dict__, "shape": (1 << 40,)})
    kind, why = a.offer(huge)
    assert kind == "refused" and "elements" in why and a.view() is None


def test_merged_states_of_two_shards_serve_both_and_resume_the_version_being_built():
    t0, t1, t2 = _tensors(20), _tensors(21), _tensors(22)
    a0, a1 = DenseAssembler(), DenseAssembler()
    first = _chunks(t0, seq=0, step=10, shard=0)
    for c in first:
        a0.offer(c)
    second = _chunks(t2, seq=len(first), step=20, shard=0)
    for c in second[:2]:  # shard 0 is in the middle of its next version
        a0.offer(c)
    for c in _chunks(t1, seq=0, step=12, shard=1):
        a1.offer(c)
    merged = DenseAssembler.from_state(merge_states([("a", a0.state()), ("b", a1.state())]))
    assert merged.shards() == {0, 1}
    assert _same(merged.view(0), t0) and _same(merged.view(1), t1)
    assert [merged.offer(c)[0] for c in second[2:]][-1] == "served"  # resumed, not lost
    assert _same(merged.view(0), t2) and merged.counters["gaps"] == 0
    assert merged.offer(second[0])[0] == "duplicate"  # the seqs came along too


def test_merged_states_refuse_a_shard_held_twice_naming_both():
    a, b = DenseAssembler(), DenseAssembler()
    for c in _chunks(_tensors(23), seq=0, step=10):
        a.offer(c)
    b.offer(_chunks(_tensors(24), seq=0, step=11)[0])  # shard 0 building here
    with pytest.raises(ValueError, match="shard 0 has state in both x and y"):
        merge_states([("x", a.state()), ("y", b.state())])
    with pytest.raises(ValueError, match="^z: dense state: malformed"):
        merge_states([("x", a.state()), ("z", b"junk")])
