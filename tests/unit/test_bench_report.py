"""What the benchmark scripts print and write (scripts/bench.py, scripts/burst.py), and the
ports their stacks take (tests.stack.free_port, shared with the tests)."""

import json
import socket
import sys

import pytest

from tests.stack import REPO, free_port

sys.path.insert(0, str(REPO / "scripts"))

import bench  # noqa: E402
import benchparity  # noqa: E402
import benchreport  # noqa: E402
import burst  # noqa: E402


def summary(**extra):
    ratio = {"median": 0.9, "min": 0.8, "max": 1.0}
    return {"machine": "2 cores", "when": "now", "command": "scripts/bench.py", "setup": "x",
            "closed_loop": {"short": {"served_vs_in_process": ratio, "served_texts_per_s": 1.0,
                                      "served_p50_ms": 1, "served_p99_ms": 2,
                                      "in_process_texts_per_s": 1.0}},
            "parity": {"shmserve": 0.99995, "other": 1.0}, **extra}


def test_the_parity_lines_are_not_read_as_rows_of_the_table_above():
    lines = benchreport.markdown(summary()).splitlines()
    first = next(i for i, line in enumerate(lines) if "Parity" in line)
    assert lines[first - 1] == "" and lines[first - 2].startswith("| short")
    assert [line for line in lines if "Parity" in line] == [
        "- Parity, shmserve: minimum cosine to sentence-transformers fp32 0.999950.",
        "- Parity, other: minimum cosine to sentence-transformers fp32 1.000000."]


def test_a_note_of_too_few_rounds_closes_the_report():
    last = benchreport.markdown(summary(note="1 round(s): few")).splitlines()[-1]
    assert last == "1 round(s): few"


def test_a_sweep_whose_saturations_moved_says_so():
    """An outside check's sweep on a loaded machine measured saturations of 189, 80, 55 and
    115 requests/s before its four points, so its 75% offered less than its 25%, unsaid."""
    points = [{"saturation_rps": rate} for rate in (189.0, 80.0, 55.0, 115.0)]
    said = bench.saturations_disagree(points)
    assert said and "3.4x" in said and "189, 80, 55, 115" in said
    assert bench.saturations_disagree([{"saturation_rps": r} for r in (300, 280, 250, 310)]) \
        is None  # within 1.5x: the drift a sweep is made to live with


def test_burst_prints_latencies_in_milliseconds():
    line = burst.describe({"statuses": {200: 3, 429: 1}, "ok_p50_s": 0.0123, "ok_max_s": 0.0456,
                           "p50_429_s": 0.002, "last_429_s": None,
                           "goodput_texts_per_s": 10.0})
    assert "200s p50 12 ms max 46 ms" in line and "429s at p50 2 ms last - ms" in line, line
    # no answer (status 0) apart from the other statuses, where it was lumped in
    line = burst.describe({"statuses": {200: 3, 503: 2, 0: 1}, "ok_p50_s": None,
                           "ok_max_s": None, "p50_429_s": None, "last_429_s": None,
                           "goodput_texts_per_s": 1.0})
    assert line.startswith("200/504/429/other/no answer 3/0/0/2/1,"), line
    # sockets this process could not open are not the server's missing answers (an outside
    # check as an ordinary user, whose soft limit of 1,024 open files cut a 1,100 burst)
    line = burst.describe({"statuses": {200: 3, -1: 4}, "ok_p50_s": None, "ok_max_s": None,
                           "p50_429_s": None, "last_429_s": None, "goodput_texts_per_s": 1.0})
    assert line.startswith("200/504/429/other/no answer 3/0/0/0/0,"), line
    assert "4 not sent: this process ran out of open files (ulimit -n" in line, line


def test_burst_tells_this_process_running_out_of_files_from_no_answer():
    import errno

    import aiohttp

    cause = OSError(errno.EMFILE, "Too many open files")
    err = aiohttp.ClientOSError(*cause.args)
    assert burst.out_of_files(err)
    wrapped = aiohttp.ClientConnectionError("cannot connect")
    wrapped.__cause__ = cause
    assert burst.out_of_files(wrapped)
    assert not burst.out_of_files(aiohttp.ServerDisconnectedError())
    assert not burst.out_of_files(OSError(errno.ECONNREFUSED, "refused"))


def test_the_harness_raises_its_soft_open_files_limit_to_the_hard_one():
    import resource

    from tests.stack import raise_open_files

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        got = raise_open_files()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == got
        if hard != resource.RLIM_INFINITY:
            assert got == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_shmserve_ports_keeps_the_stacks_in_a_range_and_skips_a_taken_port(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        monkeypatch.setenv("SHMSERVE_PORTS", f"{port}-{min(port + 40, 65535)}")
        chosen = free_port()
        assert port < chosen <= port + 40
    monkeypatch.setenv("SHMSERVE_PORTS", f"{port}-{port}")  # released: free again
    assert free_port() == port
    for wrong in ("18200", "b-c", "9-1", "0-10"):
        monkeypatch.setenv("SHMSERVE_PORTS", wrong)
        with pytest.raises(ValueError, match="SHMSERVE_PORTS"):
            free_port()


def test_a_port_of_the_range_is_not_given_twice_before_its_stack_binds_it(monkeypatch,
                                                                          tmp_path):
    """Free when asked is not free seconds later, when the stack's nginx binds it: two test
    processes took the same port of a 50-port range (an outside check, EADDRINUSE)."""
    from tests import stack

    monkeypatch.setattr(stack, "CLAIMS", tmp_path / "claims")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("SHMSERVE_PORTS", f"{port}-{port}")
    assert free_port() == port
    with pytest.raises(RuntimeError, match="no free port"):  # claimed, though still unbound
        free_port()
    monkeypatch.setattr(stack, "CLAIM_S", 0.0)  # claims age out
    assert free_port() == port


def test_the_null_pipelines_line_names_its_settings_and_failed_requests():
    """A null stack answering 429s read as a lower capacity alone (an outside check)."""
    null = {"requests_per_s": 12.0, "api": "openai", "users": 8, "requests": 2000,
            "failures": 1964}
    text = benchreport.markdown(summary(null=null))
    assert "null model, 1 text per request (openai, 8 users): 12 requests/s answered; 1964 " \
           "of 2000 requests failed." in text
    text = benchreport.markdown(summary(null={**null, "failures": 0}))
    assert "(openai, 8 users): 12 requests/s answered." in text


def test_the_table_has_the_comparisons_columns_only_in_a_run_with_one():
    s = summary()
    s["closed_loop"]["short"].update(served_requests=537, served_failures=0)
    alone = benchreport.markdown(s).splitlines()
    assert alone[3].endswith("| served / in-process |") and alone[4].count("---") == 7
    assert alone[5].endswith("| 0 of 537 | 1.0 | 0.90 (0.80-1.00) |"), alone[5]
    s["closed_loop"]["short"].update(other_texts_per_s=45.3, other_requests=4,
                                     other_failures=0,
                                     served_vs_other={"median": 5.6, "min": 5, "max": 6})
    s["compared"] = "baseline"
    both = benchreport.markdown(s).splitlines()
    assert both[3].endswith("| baseline texts/s | baseline failed | served / baseline |")
    assert both[5].endswith("| 45.3 | 0 of 4 | 5.60 (5.00-6.00) |"), both[5]


def test_the_machine_line_names_the_gpus_the_workers_run_on(tmp_path, monkeypatch):
    import benchmachine
    from shmserve import topology

    assert benchmachine.gpu_description([]) == "no GPU"
    for i, model in enumerate(("NVIDIA H100 80GB HBM3", "NVIDIA H200")):
        (tmp_path / f"0000:0{i}:00.0").mkdir()
        (tmp_path / f"0000:0{i}:00.0" / "information").write_text(
            f"Model: \t\t {model}\nIRQ:   1\n")
    monkeypatch.setattr(topology, "DRIVER_GPUS", tmp_path)
    assert benchmachine.gpu_description(["1"]) == "GPU 1: NVIDIA H200"


def test_the_parity_line_names_the_comparison_as_the_table_does():
    lines = benchreport.markdown(summary(compared="baseline")).splitlines()
    assert "- Parity, baseline: minimum cosine to sentence-transformers fp32 1.000000." in lines


def test_bad_arguments_are_refused_before_any_stack_starts(tmp_path):
    """A negative --rate drew negative gaps and the arrivals loop never ended (memory without
    bound; an outside check saw the kernel kill ab.py at 20 GB, its two stacks left running);
    others failed only at the end of a run, or as tracebacks."""
    import argparse

    import benchkit

    assert benchkit.rate("0") == 0.0 and benchkit.rate("12.5") == 12.5
    assert benchkit.text_range("1-128") == "1-128" and benchkit.text_range("32") == "32"
    assert bench.compared("http://127.0.0.1:9000/") == "http://127.0.0.1:9000"
    assert bench.compared("baseline") == "baseline"
    good = tmp_path / "corpus.json"
    good.write_text('["a sentence", "another"]')
    assert benchkit.corpus_file(str(good)) == good
    for kind, wrong in ((benchkit.rate, "-5"), (benchkit.rate, "nan"), (benchkit.rate, "inf"),
                        (benchkit.seconds, "0"), (benchkit.seconds, "-1"),
                        (benchkit.text_range, "abc"), (benchkit.text_range, "5-2"),
                        (benchkit.text_range, "0"), (bench.compared, "nonsense"),
                        (bench.compared, "ftp://x"), (benchkit.corpus_file, "/no/such.json")):
        with pytest.raises(argparse.ArgumentTypeError):
            kind(wrong)
    for text in ('{"a": 1}', "[]", "[1, 2]"):
        good.write_text(text)
        with pytest.raises(argparse.ArgumentTypeError, match="a JSON list of strings"):
            benchkit.corpus_file(str(good))
    with pytest.raises(ValueError, match="a rate of -5"):
        benchkit.open_loop_window("http://127.0.0.1:9", -5, 1, good)


@pytest.mark.parametrize("script, argv", [
    ("batcher_bench.py", ["--sizes", "64,0"]), ("batcher_bench.py", ["--passes", "0"]),
    ("batcher_bench.py", ["--rounds", "-1"]),
    ("packed_ab.py", ["--chunk", "0"]), ("packed_ab.py", ["--window", "0"]),
    ("packed_ab.py", ["--corpus", "/no/such.json"]),
    ("dtype_parity.py", ["--batch", "0"]), ("dtype_parity.py", ["--dtypes", "fp64"]),
    ("dtype_parity.py", ["--corpus", "/no/such.json"]),
])
def test_the_in_process_scripts_refuse_bad_arguments_in_their_usage(script, argv):
    """A zero or a bad value was a traceback after the model loaded (a ZeroDivisionError, an
    empty table), not a usage line."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(REPO / "scripts" / script), *argv],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "usage:" in done.stderr and "Traceback" not in done.stderr


def test_failed_requests_are_in_the_table_and_said_to_be_in_the_latencies():
    """Failures were in results.json only: a run where 97% of the requests got 429 read as a
    fast server (an outside check)."""
    rounds = [{"served": {"texts_per_s": 30.0, "requests_per_s": 30.0, "p50_ms": 18,
                          "p99_ms": 150, "requests": 2113, "failures": 2052},
               "in_process": {"texts_per_s": 80.0},
               "other": {"texts_per_s": 0.0, "requests_per_s": 0.0, "p50_ms": 5, "p99_ms": 9,
                         "requests": 500, "failures": 500}}]
    s = bench.summarize(rounds)
    assert (s["served_failures"], s["served_requests"]) == (2052, 2113)
    assert s["served_vs_other"] is None  # the other side answered nothing: no ratio
    report = benchreport.markdown(summary(closed_loop={"short": s}))
    row = next(line for line in report.splitlines() if line.startswith("| short"))
    assert "| 2052 of 2113 (97%) |" in row and "| 500 of 500 (100%) | - |" in row
    assert "p50 and p99 are locust's over every request, the failed ones included" in report


def test_a_stage_that_fails_after_the_windows_is_reported_and_the_report_written():
    s = summary()
    with benchreport.stage(s, "parity check"):
        raise OSError("HTTP Error 503: Service Unavailable")
    assert s["errors"] == {"parity check": "OSError: HTTP Error 503: Service Unavailable"}
    assert "The parity check did not complete: OSError: HTTP Error 503" in benchreport.markdown(s)


def test_a_compared_url_is_probed_before_any_window_and_its_v1_form_taken():
    """A URL that never answered 200 ended the run in a ZeroDivisionError after every window;
    an OpenAI base URL (…/v1) posted to /v1/v1/embeddings (an outside check)."""
    import benchkit

    assert bench.compared("http://127.0.0.1:9/v1/") == "http://127.0.0.1:9"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    with pytest.raises(SystemExit, match=r"--compare's server http://127.0.0.1:\d+: POST "
                                         r"/v1/embeddings failed"):
        benchkit.probe(f"http://127.0.0.1:{port}", "--compare's server")


def test_an_open_loop_window_with_no_answer_has_no_latency_and_counts_its_failures(tmp_path):
    import json
    import math

    import benchkit

    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps(["a text"]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    window = benchkit.open_loop_window(f"http://127.0.0.1:{port}", 20.0, 0.5, corpus)
    assert window["failures"] == window["requests"] > 0 and window["requests_per_s"] == 0
    assert math.isnan(window["p50_ms"]) and math.isnan(window["p99_ms"])
    # what was sent, beside the rate asked (a short window's draw falls short of it)
    assert window["sent_per_s"] == window["requests"] / 0.5
    s = summary(sweep=[{"fraction": 0.25, "saturation_rps": 100.0, "offered_rps": 25.0,
                        **window}])
    row = next(line for line in benchreport.markdown(s).splitlines() if line.startswith("| 25%"))
    assert row.startswith(f"| 25% of saturation | 100 | 25 | {window['sent_per_s']:.1f} | "
                          "0.0 | nan | nan |"), row
    assert benchkit.failed(window) == f", {window['requests']} of {window['requests']} " \
                                      "requests failed"


def test_the_latency_plot_draws_its_points_by_throughput():
    """In the sweep's order, a point that achieved less than the one before drew the lines back
    on themselves (an outside check)."""
    points = [{"fraction": f, "requests_per_s": r, "p50_ms": 10.0, "p99_ms": 30.0}
              for f, r in ((0.25, 30.0), (0.5, 20.7), (0.75, 60.0), (1.0, 80.0))]
    assert [p["fraction"] for p in benchreport.by_throughput(points)] == [0.5, 0.25, 0.75, 1.0]


def test_the_model_named_for_the_bench_goes_with_every_parity_request(monkeypatch):
    """SHMSERVE_BENCH_MODEL (bench.py --model) named the model in locust's requests only; a
    strict OpenAI-compatible server would have refused parity's (an outside check)."""
    import json as json_mod

    import benchkit

    sent = []

    class Answer:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            return json_mod.dumps({"data": [{"index": 0, "embedding": [1.0, 0.0]}]}).encode()

    monkeypatch.setattr(benchkit.urllib.request, "urlopen",
                        lambda req, timeout: sent.append(json_mod.loads(req.data)) or Answer())
    monkeypatch.setenv("SHMSERVE_BENCH_MODEL", "e5")
    benchkit.fetch_vectors("http://127.0.0.1:9", ["x"])
    monkeypatch.delenv("SHMSERVE_BENCH_MODEL")
    benchkit.fetch_vectors("http://127.0.0.1:9", ["x"])
    assert [body.get("model") for body in sent] == ["e5", None]


def test_a_stack_serving_another_model_than_the_ceiling_is_said_so():
    from shmserve import config

    cfg = config.load(env="test")
    first = cfg.models[0].name
    assert benchparity.other_model(cfg, first) is None
    said = benchparity.other_model(cfg, "tiny")
    assert "'tiny'" in said and repr(first) in said and "compares two models" in said


def test_the_report_is_written_after_each_stage_and_marked_unfinished_until_the_last(
        tmp_path, capsys):
    s = summary()
    benchreport.save(s, tmp_path / "run", unfinished=True)
    written = (tmp_path / "run" / "results.md").read_text()
    assert written.splitlines()[-1].startswith("Unfinished: written before the run's end")
    assert "unfinished" in json.loads((tmp_path / "run" / "results.json").read_text())
    assert "the report so far" in capsys.readouterr().err
    s["null"] = {"requests_per_s": 2500.0}
    benchreport.save(s, tmp_path / "run", unfinished=False)
    final = (tmp_path / "run" / "results.md").read_text()
    assert "Unfinished" not in final and "2500 requests/s" in final
    assert "unfinished" not in json.loads((tmp_path / "run" / "results.json").read_text())
