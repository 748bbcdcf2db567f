#!/usr/bin/env bash
# The wheels a lent GPU machine needs and cannot fetch, into .whl/ (ignored), for scripts/gpu_check.sh:
# torchrl and tensordict at the pinned versions and the small packages they need that its image lacks,
# for its Python (3.12, x86-64). Run here, where pip reaches the index, then carry .whl with the run:
#
#   bash scripts/gpu_wheels.sh
#   # device run, carry [".whl"]: bash scripts/gpu_check.sh   (it installs .whl/*.whl into /tmp/site)
#
# Environment: GPU_PYTHON_VERSION (default 3.12).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
grep -qxF "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >>.git/info/exclude
mkdir -p .whl
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
# torchrl and tensordict (pinned in requirements.txt), then what their METADATA requires beyond the image's
# packages (torch, numpy, cloudpickle, packaging and zipp are there).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON_VERSION:-3.12}" \
  --implementation cp "${PLATFORMS[@]}" -d .whl \
  torchrl==0.14.1 tensordict==0.14.3 "pyvers>=0.2.3,<0.3.0" "hoptorch>=0.1.4" importlib_metadata lazy-importer orjson
ls -1 .whl/*.whl
du -sh .whl
