"""CPU sets (consumers.cpus): parsing, checking against the CPUs allowed, pinning a thread."""

from __future__ import annotations

import os
import threading

import pytest

from consumers.cpus import check_cpus, format_cpus, parse_cpus, pin_thread

linux = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity")


@pytest.mark.parametrize("spec, want", [
    ("0", {0}), ("0-2,6", {0, 1, 2, 6}), (" 3 , 1-2 ", {1, 2, 3}), ("4-4", {4}),
    ([2, 0, 2], {0, 2}), (range(3), {0, 1, 2}),
])
def test_cpu_lists_parse(spec, want):
    assert parse_cpus(spec) == frozenset(want)


@pytest.mark.parametrize("spec, match", [
    ("", "'' in ''"), ("a", "'a' in 'a'"), ("3-1", "'3-1'"), ("-1", "'-1'"), ("1,,2", "''"),
    ("0-70000", "below 65536"), ([], "between 1"), ([True], "≥ 0, got True"),
    ([-1], "≥ 0, got -1"), ([1.0], "got 1.0"), (5, "expected a list"),
])
def test_bad_cpu_lists_are_refused_naming_the_bad_part(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_cpus(spec)


def test_cpu_lists_format_as_ranges():
    assert format_cpus({0, 1, 2, 6, 8, 9}) == "0-2,6,8-9"
    assert format_cpus([5]) == "5"
    for spec in ("0-2,6,8-9", "1", "0,2,4"):
        assert format_cpus(parse_cpus(spec)) == spec


@linux
def test_only_cpus_this_process_may_use_pass_the_check():
    allowed = os.sched_getaffinity(0)
    assert check_cpus(format_cpus(allowed)) == allowed
    beyond = max(allowed) + 1
    with pytest.raises(ValueError, match=f"{beyond} not among the CPUs this process may run "
                                         rf"on \({format_cpus(allowed)}\)"):
        check_cpus([beyond])


@linux
def test_pinning_applies_to_the_calling_thread_and_the_threads_it_starts():
    main_cpus = os.sched_getaffinity(0)
    one = {min(main_cpus)}
    seen = {}

    def child() -> None:
        seen["child"] = os.sched_getaffinity(0)

    def worker() -> None:
        seen["before"] = pin_thread(one)
        seen["pinned"] = os.sched_getaffinity(0)
        t = threading.Thread(target=child)
        t.start()
        t.join()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"before": main_cpus, "pinned": one, "child": one}
    assert os.sched_getaffinity(0) == main_cpus  # other threads keep theirs


@linux
def test_a_refused_pin_is_a_clear_error_and_changes_nothing():
    """A CPU that went away after the check (offline, a narrowed cgroup)."""
    mine = os.sched_getaffinity(0)
    with pytest.raises(ValueError, match=rf"cpus: cannot run on 9999 \(.+\); this process may "
                                         rf"run on {format_cpus(mine)}"):
        pin_thread({9999})
    assert os.sched_getaffinity(0) == mine
