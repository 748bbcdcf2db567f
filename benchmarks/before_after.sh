#!/usr/bin/env bash
# The hot paths before and after a change, in turns, on one thread: what "no speed lost" is measured with.
#
#   benchmarks/before_after.sh BEFORE [AFTER] [TURNS]      # commits (AFTER defaults to HEAD, TURNS to 2)
#   .venv/bin/python benchmarks/before_after_table.py bench_out/before_after
#
# Each tree is a git worktree under bench_out/before_after/trees, given this checkout's built extension
# (or BEFORE_EXTENSION on the before side: see below).
# Python runs with -S and the tree first on PYTHONPATH, so the editable install of this checkout cannot
# shadow it. Each turn runs every benchmark on "before", then on "after": a loaded machine hits both alike.
# BENCHES overrides the list, e.g. BENCHES="plain_path" for one, or BENCHES="sharded_cost" for the sharded
# store's (uniform rows from 1 to 8 owners; SHARDED_COST_ARGS="--rule windows ..." for others); a name is a
# script of benchmarks/ or of benchmarks/probes/ (gather_cost, owner_cost, ...), looked up in each tree. A change
# in csrc/: build BEFORE's extension and name it in BEFORE_EXTENSION, so that each side runs its own.
# SCRIPTS_FROM=after runs AFTER's benchmark scripts on both sides (a benchmark or an option the change added).
set -euo pipefail
cd "$(dirname "$0")/.."
before=${1:?usage: benchmarks/before_after.sh BEFORE [AFTER] [TURNS]}
after=${2:-HEAD}
turns=${3:-2}
root=bench_out/before_after
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
extension=""
for candidate in "$site"/gear_torchrl/kernels/_C*.so "$site"/gear_torchrl/_C*.so; do
  if [ -e "$candidate" ]; then extension=$candidate; break; fi
done
[ -n "$extension" ] || { echo "no built extension under $site/gear_torchrl: run make build" >&2; exit 1; }
kernel_source=csrc/kernels/cuda/gather_kernel.cuh
py="$PWD/.venv/bin/python"  # the venv's, not the interpreter it links to

declare -A args=(
  [plain_path]="--repeats 7"
  [prioritized_sampling]="--repeats 5"
  [sequence_sampling]="--sizes 100000 1000000 --repeats 5"
  [ndim2]="--repeats 5"
  [shared_insert]="--writers 1 2 --seconds 2 --rounds 3"
  [sharded_cost]="${SHARDED_COST_ARGS:---worlds own 1 2 4 8 --batches 256 4096 --rounds 3}"
  [owner_reply_cost]="--requests 300"
  [gather_cost]="--repeats 15"
  [learner_round_cost]="--repeats 30"
  [receive_cost]="--owners 1 8 --repeats 9"
  [owner_cost]="--rows 16 256 4096 --learners 1 4 --rounds 5"
)
benches=${BENCHES:-plain_path prioritized_sampling sequence_sampling ndim2 shared_insert}

mkdir -p "$root/trees"
for side in before after; do
  commit=$([ "$side" = before ] && echo "$before" || echo "$after")
  tree="$root/trees/$side"
  git worktree remove --force "$tree" 2>/dev/null || true
  git worktree add --detach -q "$tree" "$commit"
  # The extension wherever that tree's loader looks for it (gear_torchrl/ before the kernels folder, kernels/ after).
  built=$([ "$side" = before ] && echo "${BEFORE_EXTENSION:-$extension}" || echo "$extension")
  cp "$built" "$tree/gear_torchrl/$(basename "$extension")"
  [ -d "$tree/gear_torchrl/kernels" ] && cp "$built" "$tree/gear_torchrl/kernels/$(basename "$extension")" \
    && cp "$kernel_source" "$tree/gear_torchrl/kernels/"
done

# One thread per process, as each benchmark asks of torch in its main thread; KEEP_OMP_THREADS=1 leaves the
# other threads (an owner's connections) at OpenMP's default, as a user's processes run.
[ -n "${KEEP_OMP_THREADS:-}" ] || export OMP_NUM_THREADS=1
for turn in $(seq 1 "$turns"); do
  for side in before after; do
    tree=$(realpath "$root/trees/$side")
    scripts=$([ "${SCRIPTS_FROM:-}" = after ] && realpath "$root/trees/after" || echo "$tree")
    out=$(realpath -m "$root/$side.$turn")
    mkdir -p "$out"
    for bench in $benches; do
      echo "turn $turn, $side: $bench"
      script=benchmarks/$bench.py  # a comparison; a probe is under probes/ (at the top in trees before the move)
      [ -e "$scripts/$script" ] || script=benchmarks/probes/$bench.py
      (cd "$tree" && PYTHONPATH="$tree:$scripts/benchmarks:$site" "$py" -S "$scripts/$script" ${args[$bench]} \
        --out "$out/$bench.json" > "$out/$bench.txt" 2>&1) || { echo "  failed: see $out/$bench.txt" >&2; exit 1; }
    done
  done
done
for side in before after; do git worktree remove --force "$root/trees/$side"; done
echo "results: $root/{before,after}.N/*.json"
