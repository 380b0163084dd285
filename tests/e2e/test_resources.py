"""A frontend's resources from the outside, on the suite's shared tiny stack: the room of its
run directory and /dev/shm in every scrape, and the heap a large request grew given back once
idle (metrics and logs at large: test_observability.py)."""

from __future__ import annotations

import time

from frontend import heap
from tests.e2e.test_observability import scrape, total


def test_the_run_directorys_and_dev_shms_room_are_read_at_scrape_time(tiny_stack):
    """A full run directory loses log lines and metric updates, a full /dev/shm refuses
    requests: their room is in every scrape (deploy/grafana/alerts.yml alerts on it)."""
    import os

    samples = scrape(tiny_stack)
    for volume, path in (("run_dir", tiny_stack.run_dir), ("shm", "/dev/shm")):
        fs = os.statvfs(path)
        size = total(samples, "shmserve_filesystem_size_bytes", volume=volume)
        avail = total(samples, "shmserve_filesystem_avail_bytes", volume=volume)
        assert size == fs.f_blocks * fs.f_frsize, (volume, size)
        # what the suite writes beside it moves the free bytes a little between the reads
        assert 0 < avail <= size and abs(avail - fs.f_bavail * fs.f_frsize) < 256 << 20, (
            volume, avail, fs.f_bavail * fs.f_frsize)


def test_a_frontend_gives_back_the_heap_of_a_large_request_once_idle(tiny_stack):
    """A request of 281,600 characters (frontend.heap.TRIM_CHARS and over) is followed, once
    nothing is in flight, by glibc's malloc_trim on that frontend, logged with its resident
    memory before and after (a frontend kept 1.6-1.9 GB after large requests: an outside
    check)."""
    time.sleep(2 * heap.IDLE_CHECK_S + 1)  # a trim an earlier test's request left pending
    tiny_stack.begin_test()
    long_word = "a" * 4400  # one [UNK]: past the wordpiece limit of 100 characters a word
    status, _, body = tiny_stack.post_json("/v1/embeddings", {"input": [long_word] * 64})
    assert status == 200, body
    trimmed, = tiny_stack.logged(("frontend-0", "frontend-1"), "frontend.heap_trimmed", 1)
    assert 0 < trimmed["resident_mb_after"] <= trimmed["resident_mb_before"], trimmed
    status, _, body = tiny_stack.post_json("/v1/embeddings", {"input": ["short"] * 64})
    assert status == 200, body
    time.sleep(2 * heap.IDLE_CHECK_S + 1)  # a small request: no other trim
    assert len(tiny_stack.logged(("frontend-0", "frontend-1"), "frontend.heap_trimmed", 1)) == 1
