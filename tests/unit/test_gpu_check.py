"""scripts/gpu_check.py's reading of a stack's /metrics and its stages' failures (the rest of it
needs a GPU, or runs as `--dry-run` by hand)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import gpu_check  # noqa: E402
from gpu_check import pipeline_means  # noqa: E402

METRICS = """\
# TYPE shmserve_stage_duration_seconds histogram
shmserve_stage_duration_seconds_sum{model="m",stage="tokenize"} 2.0
shmserve_stage_duration_seconds_count{model="m",stage="tokenize"} 1000.0
shmserve_stage_duration_seconds_sum{model="m",stage="inference"} 30.0
shmserve_stage_duration_seconds_count{model="m",stage="inference"} 1000.0
# TYPE shmserve_batch_texts histogram
shmserve_batch_texts_sum{model="m",worker="0"} 2000.0
shmserve_batch_texts_count{model="m",worker="0"} 10.0
shmserve_batch_texts_sum{model="m",worker="1"} 1000.0
shmserve_batch_texts_count{model="m",worker="1"} 10.0
# TYPE shmserve_batch_forward_seconds histogram
shmserve_batch_forward_seconds_sum{model="m",worker="0"} 0.3
shmserve_batch_forward_seconds_count{model="m",worker="0"} 20.0
"""


def test_means_per_request_and_per_pass_over_every_worker():
    assert pipeline_means(METRICS) == {"tokenize_ms": 2.0, "inference_ms": 30.0,
                                       "texts_per_pass": 150.0, "forward_ms_per_pass": 15.0}


def test_a_failed_stage_is_recorded_and_the_run_goes_on():
    report = {}

    def fails():
        raise SystemExit("locust failed (1)")
    assert gpu_check.stage(report, "served minilm", fails) is None
    assert report["errors"] == {"served minilm": "SystemExit: locust failed (1)"}


def test_an_interrupt_ends_the_run_and_is_recorded():
    """`timeout -s INT` at the lent machine's limit: no further stage starts (the stacks stop
    through their context managers), and main writes what was measured."""
    report = {}

    def interrupted():
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        gpu_check.stage(report, "served bert-base", interrupted)
    assert report["errors"] == {"served bert-base": "KeyboardInterrupt"}
