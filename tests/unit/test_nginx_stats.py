"""What nginx answers itself, counted in /metrics (shmserve.nginx_stats): the file nginx
appends each such status to, read by the reaper's reader, here run alone beside a real nginx as
`shmserve up` renders it (the whole stack: tests/e2e/test_observability.py)."""

from __future__ import annotations

from pathlib import Path

from shmserve import topology
from tests.unit.test_nginx_pages import nginx_of, request
from tests.unit.test_render import make_config, wait_until


def test_what_nginx_answers_itself_reaches_the_counter_by_status(tmp_path):
    """Each request nginx answers itself is a line of its answers file, which the reaper's
    reader (shmserve.nginx_stats), here run alone, counts by status: no frontend counts these,
    and a rate limit's 429s were in no metric (a noted gap). A burst of 3,000 is counted
    whole: datagrams to a unix socket lost a third of such a burst (an outside check)."""
    from concurrent.futures import ThreadPoolExecutor

    from shmserve import nginx_stats

    def count(status):
        return nginx_stats.RESPONSES.labels(status)._value.get()

    cfg = make_config(tmp_path / "run", frontends={"count": 1},
                      nginx={"client_max_body_size": "1k", "rate_limit_per_s": 1,
                             "rate_limit_burst": 1})
    with nginx_of(cfg):
        reader = nginx_stats.Reader(topology.nginx_answers_log(cfg))
        reader.start()
        before = {status: count(status) for status in ("405", "413", "429", "502")}
        statuses = [request(cfg, "POST", "/v1/embeddings", b"{}")[0] for _ in range(4)]
        assert statuses == [502, 502, 429, 429]
        assert request(cfg, "GET", "/metrics")[0] == 502  # not rate limited: a 502 too
        assert request(cfg, "TRACE", "/ready")[0] == 405
        assert request(cfg, "POST", "/v1/embeddings", b"x" * 4096)[0] == 413
        with ThreadPoolExecutor(16) as pool:
            burst = list(pool.map(lambda _: request(cfg, "GET", "/v1/models")[0], range(3000)))
        assert burst.count(429) >= 2990, set(burst)
        want = {"405": 1, "413": 1, "429": 2 + burst.count(429), "502": 3 + burst.count(502)}
        wait_until(lambda: all(count(s) - before[s] >= n for s, n in want.items()), 10)
        reader.stop()
        assert {s: count(s) - before[s] for s in want} == want
        # A reader started again (the reaper restarted) goes on from the saved offset.
        again = nginx_stats.Reader(topology.nginx_answers_log(cfg))
        assert again.offset == reader.offset > 0
        assert request(cfg, "TRACE", "/ready")[0] == 405
        wait_until(lambda: again.poll() == 1, 5)
        assert count("405") - before["405"] == 2
    # nginx logs no alert for any of it, nor a line per refusal (they are counted instead).
    noise = [line for line in (topology.log_dir(cfg) / "nginx.log").read_text().splitlines()
             if "[alert]" in line or "syslog" in line or "limiting requests" in line]
    assert not noise, noise[:3]


def test_the_answers_file_is_emptied_past_its_limit_without_losing_a_count(tmp_path,
                                                                             monkeypatch):
    from shmserve import nginx_stats

    monkeypatch.setattr(nginx_stats, "ROTATE_BYTES", 40)
    path = tmp_path / "answers.log"
    path.write_bytes(b"")
    reader = nginx_stats.Reader(path)
    before = nginx_stats.RESPONSES.labels("429")._value.get()
    with path.open("ab") as nginx:  # as nginx appends: O_APPEND
        nginx.write(b"429\n" * 12)
        nginx.flush()
        assert reader.poll() == 12 and path.stat().st_size == 0 and reader.offset == 0
        nginx.write(b"429\n429")  # the last line not yet whole
        nginx.flush()
        assert reader.poll() == 1 and reader.offset == 4
        nginx.write(b"\n")
        nginx.flush()
        assert reader.poll() == 1
    assert nginx_stats.RESPONSES.labels("429")._value.get() - before == 14
    assert nginx_stats.Reader(path).offset == 8  # saved for the next reader


def test_answers_nginx_cut_are_counted_apart_from_its_own(tmp_path):
    """nginx writes "cut STATUS" for a frontend's answer it did not pass on whole (nginx.conf):
    shmserve_nginx_incomplete_responses_total, not one of nginx's own answers."""
    from shmserve import nginx_stats

    path = tmp_path / "answers.log"
    path.write_bytes(b"")
    reader = nginx_stats.Reader(path)

    def counts():
        return (nginx_stats.RESPONSES.labels("200")._value.get(),
                nginx_stats.INCOMPLETE.labels("200")._value.get(),
                nginx_stats.INCOMPLETE.labels("503")._value.get(),
                nginx_stats.RESPONSES.labels("499")._value.get())
    before = counts()
    path.write_bytes(b"cut 200\n499\ncut 200\ncut 503\ncut x\n")
    assert reader.poll() == 4
    assert [a - b for a, b in zip(counts(), before)] == [0, 2, 1, 1]
    assert reader.unreadable == 1  # "cut x"


def test_the_answers_file_keeps_pages_for_nginx_s_next_lines():
    """With the run directory full, nginx's "cut 200" lines were lost (no page for them), the
    answers a full directory cut among them (an outside check): each poll holds the file's
    next pages (fallocate, the size unchanged), again after the file was emptied. On tmpfs,
    as a Kubernetes memory-backed volume is."""
    import tempfile

    from shmserve import nginx_stats

    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        path = Path(directory) / "answers.log"
        path.write_bytes(b"200\n")
        reader = nginx_stats.Reader(path)
        assert path.stat().st_blocks * 512 < nginx_stats.RESERVED_BYTES
        reader.poll()
        held = path.stat()
        assert held.st_size == 4 and held.st_blocks * 512 >= nginx_stats.RESERVED_BYTES
        with path.open("ab") as nginx:
            nginx.write(b"cut 200\n" * (nginx_stats.ROTATE_BYTES // 8 + 1))
        reader.poll()  # past ROTATE_BYTES: emptied, and held again
        assert path.stat().st_size == 0
        assert path.stat().st_blocks * 512 >= nginx_stats.RESERVED_BYTES
