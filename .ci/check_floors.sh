#!/usr/bin/env bash
# Dependency floors: installs the lowest version pyproject.toml allows of every runtime dependency
# and of the eval extra into a fresh virtual environment, then runs the CPU tests that use them.
# Needs the package index and about 15 minutes, so it is not part of .ci/run. Run it after raising
# or lowering a floor:
#   bash .ci/check_floors.sh [VENV_DIR]        (default /tmp/ttr-floors)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-/tmp/ttr-floors}
rm -rf "$venv"
python3 -m venv "$venv"
# every "NAME>=X" of [project] dependencies and the eval extra, as "NAME==X" (torch excepted, below;
# tomli only matters before Python 3.11)
python3 - > "$venv/floors.txt" <<'PY'
import re, sys
if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for req in project["dependencies"] + project["optional-dependencies"]["eval"]:
    m = re.match(r"^([A-Za-z0-9_.-]+)>=([^;,\s]+)\s*(;.*)?$", req)
    if m and m.group(1) not in ("torch", "tomli"):
        print(f"{m.group(1)}=={m.group(2)}")
PY
cat "$venv/floors.txt"
# torch: the CPU build 2.13.0 (an unpinned torch pulls several GB of CUDA packages); its floor,
# 2.11, is the torch of the GPU runs
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q -c "$venv/floors.txt" -e ".[test,eval]"
"$venv/bin/pip" list 2>/dev/null | grep -iE "^(torch|triton|numpy|transformers|accelerate|safetensors|sentencepiece|tokenizers|tqdm|lm.eval|datasets) "
TRITON_INTERPRET=1 "$venv/bin/python" -m pytest tests/models tests/train tests/eval tests/test_cli.py \
  tests/kernels/test_delta.py tests/kernels/test_gla.py -m "not gpu and not slow" -q -p no:cacheprovider
