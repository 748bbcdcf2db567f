#!/usr/bin/env bash
# One command on a fresh GPU machine: install carried wheels, build the
# extension with CUDA, run tests/gpu, the GPU gather benchmark and the gather
# tests under compute-sanitizer memcheck. Logs and JSON go to $OUT (default
# ./gpu_out); a one-screen summary is printed at the end.
#
#   scripts/gpu_check.sh                        # everything
#   GPU_CHECK_STEPS="build tests" scripts/gpu_check.sh
#
# Steps: build, tests (tests/gpu, tutorial 6 included), bench (the gather kernel,
# benchmarks/gpu_gather.py), prioritized (benchmarks/gpu_prioritized_sampling.py),
# storage (benchmarks/gpu_storage_sampling.py, two row sizes), sharded (benchmarks/sharded_cost.py,
# uniform rows from 1, 2, 4 and 8 owners on this machine's cores, the learner's batches on the CPU and
# then on the GPU), sharded_windows (the same for 64-step windows), many_learners (one owner serving 1, 2
# and 4 learners), learner_alone (benchmarks/probes/learner_round_cost.py: the learner's own CPU per batch from 1
# to 8 owners, replies queued, with the raw floor and its sends), owner_growth (benchmarks/probes/owner_growth.py:
# stores over 1, 2, 4 and 8 owners in one job, sampled in the same turns, plain and 4 or 8 batches ahead),
# learner (benchmarks/transformer_learner.py: a transformer learner fed by five feeds while actors write; about
# two minutes at its default sizes; GPU_CHECK_LEARNER_ARGS appended), memcheck.
# Carried wheels: .whl/*.whl (torchrl, tensordict and their small deps; scripts/gpu_wheels.sh downloads them)
# are installed for the tests; .whl/peer/*.whl, a torchrl + tensordict built for the
# machine's own torch, let the prioritized benchmark time TorchRL's C++ trees.
#
# Environment: PYTHON (default python3), GEAR_TORCHRL_CUDA_ARCHS (default 90),
# CUDA_HOME (default: where nvcc is), GPU_CHECK_STEPS (default
# "build tests bench prioritized storage sharded memcheck"), GPU_CHECK_BENCH_ARGS (extra benchmark args),
# GPU_CHECK_MEMCHECK_K (pytest -k for the memcheck run), GPU_CHECK_TIMEOUT_{TESTS,BENCH,MEMCHECK}
# (seconds per step; 400, 400, 500).
# Exit status: 0 when every step that ran passed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
ROOT=$PWD
OUT="${OUT:-$ROOT/gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
STEPS="${GPU_CHECK_STEPS:-build tests bench prioritized storage sharded memcheck}"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
status=0
note() { echo "== $*" | tee -a "$SUMMARY"; }
has_step() { [[ " $STEPS " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1

# ---- facts about the machine ----------------------------------------------
NVCC="$(command -v nvcc || true)"
[[ -z "$NVCC" && -x /usr/local/cuda/bin/nvcc ]] && NVCC=/usr/local/cuda/bin/nvcc
export CUDA_HOME="${CUDA_HOME:-$(dirname "$(dirname "${NVCC:-/usr/local/cuda/bin/nvcc}")")}"
export PATH="$CUDA_HOME/bin:$PATH"
{
  date -u
  nvidia-smi || true
  "$PY" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())"
  "$NVCC" --version || true
  cmake --version || true
  "$PY" -m pip list 2>/dev/null | grep -iE "^(torch|scikit.build.core|cmake|ninja|pybind11|pytest|cupy|numpy|torchrl|tensordict) " || true
  nproc
  free -g || true
  command -v g++ && g++ -v 2>&1 | grep -oE "with-static-standard-libraries|gcc version.*"
} >"$OUT/env.txt" 2>&1
note "env: $(grep -m1 -E '^torch ' "$OUT/env.txt"); nvcc $("$NVCC" --version 2>/dev/null | grep -oE 'release [0-9.]+'); $(cmake --version 2>/dev/null | head -1)"

# ---- carried wheels (.whl/*.whl, e.g. torchrl + tensordict) ----------------
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$ROOT"/.whl/*.whl \
      >"$OUT/wheels.log" 2>&1; then
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    note "wheels: installed $(ls "$ROOT"/.whl/*.whl | wc -l) carried wheels into /tmp/site"
  else
    note "wheels: install FAILED (see wheels.log)"; status=1
  fi
fi

PEER_SITE=""
if compgen -G "$ROOT/.whl/peer/*.whl" >/dev/null; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/peer-site \
      "$ROOT"/.whl/peer/*.whl >>"$OUT/wheels.log" 2>&1; then
    PEER_SITE=/tmp/peer-site
    note "wheels: TorchRL for this machine's torch in $PEER_SITE (the prioritized benchmark's peer)"
  else
    note "wheels: peer install FAILED (see wheels.log)"
  fi
fi

# ---- build ------------------------------------------------------------------
if has_step build; then
  export GEAR_TORCHRL_CUDA=ON GEAR_TORCHRL_CUDA_ARCHS="${GEAR_TORCHRL_CUDA_ARCHS:-90}"
  export CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)"
  # CMakeLists.txt links libstdc++.so.6 by name: on the lent GPU image g++'s
  # libstdc++.so symlink dangles and a static copy would otherwise be linked.
  STDCXX_SO="$(g++ -print-file-name=libstdc++.so 2>/dev/null || true)"
  if [[ -n "$STDCXX_SO" && ! -e "$STDCXX_SO" ]]; then
    note "toolchain: g++'s $STDCXX_SO is missing or dangling (handled by CMakeLists.txt)"
  fi
  t0=$SECONDS
  if "$PY" -m pip install --no-build-isolation --no-deps -v -e "$ROOT" >"$OUT/build.log" 2>&1; then
    note "build: ok in $((SECONDS - t0)) s (GEAR_TORCHRL_CUDA_ARCHS=$GEAR_TORCHRL_CUDA_ARCHS)"
    SO="$(find "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')/gear_torchrl" -name '_C*.so' | head -1)"
    [[ -n "$SO" ]] && note "build: $SO defines $(nm -DC --defined-only "$SO" | grep -c 'std::basic_ostream') std::basic_ostream symbols (0 = libstdc++ is shared)"
  else
    note "build: FAILED in $((SECONDS - t0)) s (see build.log)"; tail -40 "$OUT/build.log"; status=1
    STEPS=""  # nothing else can run
  fi
fi

# Plugins that may import torchrl (a root conftest) must not stop the kernel
# tests on a machine without it.
PYTEST_ARGS=(-p no:cacheprovider -W ignore::pytest.PytestUnknownMarkWarning)
if ! "$PY" -c "import torchrl, tensordict" >/dev/null 2>&1; then
  PYTEST_ARGS+=(--noconftest)
fi

# ---- tests --------------------------------------------------------------------
if has_step tests; then
  t0=$SECONDS
  timeout "${GPU_CHECK_TIMEOUT_TESTS:-400}" "$PY" -m pytest tests/gpu -v -rs "${PYTEST_ARGS[@]}" >"$OUT/tests.log" 2>&1
  rc=$?
  note "tests: rc=$rc in $((SECONDS - t0)) s: $(tail -1 "$OUT/tests.log")"
  grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/tests.log" | head -20 | tee -a "$SUMMARY"
  [[ $rc -ne 0 && $rc -ne 5 ]] && status=1  # 5: nothing ran (no GPU): the skip reason is above
fi

# ---- benchmark ------------------------------------------------------------------
if has_step bench; then
  t0=$SECONDS
  # shellcheck disable=SC2086
  timeout "${GPU_CHECK_TIMEOUT_BENCH:-400}" "$PY" benchmarks/gpu_gather.py --out "$OUT/gpu_gather.json" ${GPU_CHECK_BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
  rc=$?
  note "bench: rc=$rc in $((SECONDS - t0)) s"
  cat "$OUT/bench.log" | tee -a "$SUMMARY"
  [[ $rc -ne 0 ]] && status=1
fi

# ---- user-level benchmarks: priorities on the GPU, batches through TorchRL's buffer ----
run_bench() {  # name, script, args...
  local name=$1 script=$2; shift 2
  t0=$SECONDS
  (cd "$ROOT/benchmarks" && timeout "${GPU_CHECK_TIMEOUT_BENCH:-400}" "$PY" "$script" "$@") >"$OUT/$name.log" 2>&1
  rc=$?
  note "$name: rc=$rc in $((SECONDS - t0)) s"
  tee -a "$SUMMARY" <"$OUT/$name.log"
  [[ $rc -ne 0 ]] && status=1
}
if has_step prioritized; then
  run_bench prioritized gpu_prioritized_sampling.py --out "$OUT/gpu_prioritized.json" ${PEER_SITE:+--torchrl-site "$PEER_SITE"}
fi
if has_step storage; then
  run_bench storage gpu_storage_sampling.py --out "$OUT/gpu_storage.json"
  run_bench storage_atari gpu_storage_sampling.py --rows 50000 --obs 4 84 84 --out "$OUT/gpu_storage_atari.json"
fi

# ---- the sharded store where every process has a core; a learner on the GPU --------------
# GPU_CHECK_SHARDED_ARGS is appended to each run (argparse keeps the last value: a tiny size for a trial).
SHARDED_ARGS=(${GPU_CHECK_SHARDED_ARGS:-})
if has_step sharded; then
  run_bench sharded_rows sharded_cost.py --worlds own 1 2 4 8 --rounds 3 --out "$OUT/sharded_rows.json" \
    "${SHARDED_ARGS[@]}"
  run_bench sharded_rows_gpu sharded_cost.py --worlds own 1 2 4 8 --rounds 3 --learner-device cuda \
    --out "$OUT/sharded_rows_gpu.json" "${SHARDED_ARGS[@]}"
fi
if has_step sharded_windows; then
  run_bench sharded_windows sharded_cost.py --rule windows --worlds 1 2 4 8 --rounds 3 \
    --out "$OUT/sharded_windows.json" "${SHARDED_ARGS[@]}"
fi
if has_step many_learners; then  # one owner serving 1, 2 and 4 learners, each with a core
  run_bench many_learners many_learners.py --owners 1 --learners 1 2 4 --batches 256 --rounds 3 \
    --out "$OUT/many_learners.json" "${SHARDED_ARGS[@]}"
fi

if has_step learner; then  # the transformer learner end to end: TorchRL's feeds against the store's, padded and packed
  run_bench learner transformer_learner.py --out "$OUT/transformer_learner.json" ${GPU_CHECK_LEARNER_ARGS:-}
fi

if has_step owner_growth; then  # the learner's growth from 1 to 8 owners, every world in the same turns
  run_bench owner_growth probes/owner_growth.py --rounds 5 --ahead 4 8 --out "$OUT/owner_growth.json"
fi
if has_step learner_alone; then  # the learner's own cost per owner added, no owner competing
  run_bench learner_alone probes/learner_round_cost.py --repeats 60 --out "$OUT/learner_round_cost.json"
fi

# ---- compute-sanitizer memcheck over the gather tests -----------------------------
if has_step memcheck; then
  SAN="$(command -v compute-sanitizer || true)"
  if [[ -z "$SAN" ]]; then
    note "memcheck: compute-sanitizer not found; skipped"
  else
    t0=$SECONDS
    # Every kernel path (vector widths, padding, wrap, mask, many columns,
    # odd offsets) without the slow multi-GiB cases.
    MEMCHECK_K="not large and not cupy and not every_dtype and not 65536 and not register_errors and not tutorial and not shared_store"
    # No caching allocator: out-of-bounds accesses past a tensor are then
    # outside any allocation, so memcheck sees them.
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${GPU_CHECK_TIMEOUT_MEMCHECK:-500}" "$SAN" --tool memcheck --error-exitcode 3 --leak-check no \
      "$PY" -m pytest tests/gpu -q -x "${PYTEST_ARGS[@]}" \
      -k "${GPU_CHECK_MEMCHECK_K:-$MEMCHECK_K}" >"$OUT/memcheck.log" 2>&1
    rc=$?
    note "memcheck: rc=$rc in $((SECONDS - t0)) s: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1); $(grep -E '(passed|failed)' "$OUT/memcheck.log" | tail -1)"
    [[ $rc -ne 0 ]] && status=1
  fi
fi

note "gpu_check: status=$status (logs in $OUT)"
exit $status
