"""Under logging.format json (the test env's) every line a frontend or a worker writes is one
JSON object, its startup failures included: a log shipper takes the lines that start with `{`
(README, Observability). The processes run as supervisord runs them, stderr into the same
file. An outside check found a frontend whose tokenizer.json did not load writing only plain
tracebacks, and a worker loading through transformers writing transformers' load report as
~25 lines of text with terminal escapes."""

import json
import shutil
import subprocess
import sys

from safetensors.numpy import load_file, save_file

from shmserve import startwait
from tests.conftest import tiny_overrides
from tests.integration.conftest import run_config
from tests.integration.test_pool import start_worker
from tests.stack import REPO
from tests.tinymodel import build_tiny_other


def _json_lines(path) -> list[dict]:
    text = path.read_text()
    assert text and all(line.startswith("{") for line in text.splitlines()), text[-3000:]
    return [json.loads(line) for line in text.splitlines()]


def test_a_frontend_that_cannot_load_its_tokenizer_says_which_in_a_json_line(tmp_path,
                                                                            tiny_model):
    model = shutil.copytree(tiny_model, tmp_path / "models" / "badtok")
    tokenizer = model / "tokenizer.json"
    tokenizer.write_bytes(tokenizer.read_bytes()[:1000])
    cfg = run_config(tmp_path, tiny_overrides(model))
    log = cfg.run_dir / "frontend-0.log"
    with log.open("ab") as out:
        done = subprocess.run([sys.executable, "-m", "frontend", "--config",
                               str(cfg.run_dir / "config.json"), "--index", "0"], cwd=REPO,
                              stdout=out, stderr=subprocess.STDOUT, timeout=60, check=False)
    assert done.returncode == 1
    failed, = [line for line in _json_lines(log) if line["level"] == "error"]
    why = (f"model 'tiny': {tokenizer} does not load as a tokenizer "
           "(EOF while parsing a string at line 1 column 1000)")
    assert (failed["message"], failed["process"], failed["error_type"], failed["error"]) == (
        "frontend.failed", "frontend-0", "ModelSourceError", why)
    # What `shmserve up --wait` says of a program that keeps exiting as it starts:
    assert startwait.last_error(log.read_text().splitlines()) == f"ModelSourceError: {why}"


def test_transformers_load_report_is_one_json_line_at_its_level(tmp_path):
    """A Qwen3 checkpoint (loaded through transformers) with a layer's tensors deleted:
    transformers logs its load report, then the worker refuses the damaged copy."""
    model = build_tiny_other(tmp_path / "models" / "qwen", "qwen3", pooling="last")
    tensors = load_file(model / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.startswith("layers.1.")},
              model / "model.safetensors", metadata={"format": "pt"})
    cfg = run_config(tmp_path, tiny_overrides(model))
    worker = start_worker(cfg)
    try:
        assert worker.wait(120) == 1
    finally:
        worker.kill()
    lines = _json_lines(cfg.run_dir / "worker.log")
    report, = [line for line in lines if line["logger"].startswith("transformers")]
    assert report["level"] == "warning" and report["process"] == "worker-0"
    assert report["message"].startswith("Qwen3Model LOAD REPORT from: ")
    assert "| MISSING |" in report["message"] and "\x1b" not in report["message"]
    failed = lines[-1]
    assert (failed["message"], failed["error_type"]) == ("worker.failed", "ModelSourceError")
    assert "a damaged or partial copy" in failed["error"]
