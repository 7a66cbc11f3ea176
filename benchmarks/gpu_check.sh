#!/usr/bin/env bash
# One device call: install, GPU tests, fuzz, big tensors, compute-sanitizer, benchmark.
# Logs go to $OUT/logs.tgz (one archive to carry back), results beside it; a short
# table is printed last. Usage (on the device machine):
#   bash benchmarks/gpu_check.sh [stages...]   stages: tests fuzz big sanitize bench train (default
#   all but train, the PyTorch training example with its loss curves;
#   TESTS_K="expr" runs only the GPU tests pytest -k selects; TEST_WORKERS=N the processes
#   that run them, default 8; CUPYLN_SANITIZE_K="regex" only the sanitizer cases it finds,
#   CUPYLN_SANITIZE_VARIANTS="4,5" only those variants, SANITIZE_TOOLS="racecheck" only that
#   tool, SANITIZE_JOBS=N the (case, variant) pairs over N processes),
#   multi (two or more GPUs: tests/test_multi_gpu.py and examples/data_parallel.py), and the
#   experiments (benchmarks/tools/) host (host_breakdown.py: cupyln.torch's modules against
#   torch's), tune (tune.py), leave_out (leave_out.py: forwards
#   without beta / gamma), floor (copy_floor.py: copies of each large shape's
#   bytes), ncu (Nsight Compute sections of one forward and backward, ncu_case.py;
#   NCU_CASE="op M N dtype"), ncu_src (warp-state samples per SASS instruction of the kernels
#   matching NCU_KERNEL in that case: ncu_sass.csv, summed up by sass.py),
#   small (kernel durations of the small shapes under Nsight Compute, all providers and
#   planner variants, small_kernels.py) and stalls (their warp stall reasons)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache}
# Carried compile cache from an earlier call, if any (saves the NVRTC time).
[ -f .cupy_cache/cache.tgz ] && mkdir -p "$CUPY_CACHE_DIR" && tar xzf .cupy_cache/cache.tgz -C "$CUPY_CACHE_DIR"
stages=${*:-tests fuzz big sanitize bench}
summary=()
# Wheels carried in .whl/ (Liger-Kernel for the benchmark; nbformat, nbclient, ipykernel and their
# dependencies for the notebook test, built for the device's Python: `pip download --python-version
# 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 ...`).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$OUT/wheels.log" 2>&1 && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation . >"$OUT/install.log" 2>&1 \
  || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"

run() {  # name, command...
  local name=$1; shift
  local t0=$(date +%s)
  timeout "${STAGE_TIMEOUT:-0}" "$@" >"$OUT/$name.log" 2>&1  # STAGE_TIMEOUT (s): 0 for none
  local rc=$?
  local last
  last=$(grep -E "passed|failed|error|ERROR SUMMARY|GPU\(s\)" "$OUT/$name.log" | tail -n 1)
  summary+=("$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$last")")
}

# The tests and fuzz stages run in TEST_WORKERS processes on the one GPU (pytest-xdist, where
# installed; 0: one process). Most of the suite's time is NVRTC compiling the specializations
# the tests reach, on one CPU core per process (one process: about ten minutes).
workers=()
if [ "${TEST_WORKERS:-8}" != 0 ] && python3 -c "import xdist" 2>/dev/null; then
  workers=(-n "${TEST_WORKERS:-8}")
fi
for s in $stages; do
  case $s in
    tests) # cupyln.torch's C++ layer built first, then its Python layer alone as well
      CUPYLN_TORCH_NATIVE=wait run tests python3 -m pytest -m "not slow" -q -p no:cacheprovider \
        "${workers[@]}" ${TESTS_K:+-k "$TESTS_K"} tests/test_gpu_*.py tests/test_torch.py \
        tests/test_torch_native.py tests/test_hf.py tests/test_readme.py tests/test_notebooks.py
      CUPYLN_TORCH_NATIVE=0 run torch_py python3 -m pytest -q -p no:cacheprovider \
        ${TESTS_K:+-k "$TESTS_K"} tests/test_torch.py ;;
    train) run train python3 examples/train_torch.py --json "$OUT/train.json" \
             --plot "$OUT/train.png" ;;
    fuzz) # -v: each property's result is in the log as it ends, even if the stage times out
      CUPYLN_HYPOTHESIS_PROFILE=fuzz CUPYLN_FUZZ_EXAMPLES=${FUZZ_EXAMPLES:-2000} \
        run fuzz python3 -m pytest -v -p no:cacheprovider "${workers[@]}" tests/test_gpu_*.py \
        -k fuzz ;;
    big) run big python3 -m pytest -m slow -q -p no:cacheprovider tests/test_gpu_*.py ;;
    multi) export NCCL_NVLS_ENABLE=0
      run multi python3 -m pytest -m multi_gpu -q -p no:cacheprovider tests/test_multi_gpu.py
      run example python3 examples/data_parallel.py ;;
    sanitize)  # SANITIZE_JOBS=N: the pairs split over N processes (racecheck is slow)
      jobs=${SANITIZE_JOBS:-1}
      for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
        names=()
        for ((i = 0; i < jobs; i++)); do
          name=san_$tool$([ "$jobs" = 1 ] || echo "_$i"); names+=("$name")
          (CUPYLN_SANITIZE_SHARD=$i/$jobs run "$name" compute-sanitizer --tool "$tool" \
             --error-exitcode 9 python3 benchmarks/sanitize_cases.py
           printf '%s\n' "${summary[-1]}" >"$OUT/$name.sum") &
        done
        wait
        for name in "${names[@]}"; do
          summary+=("$(cat "$OUT/$name.sum")"); rm -f "$OUT/$name.sum"
        done
      done ;;
    host) run host python3 benchmarks/tools/host_breakdown.py ;;
    tune) run tune python3 benchmarks/tools/tune.py ;;
    leave_out) run leave_out python3 benchmarks/tools/leave_out.py ;;
    floor) run floor python3 benchmarks/tools/copy_floor.py ;;
    ncu) run ncu ncu --clock-control none --section SpeedOfLight --section Occupancy \
           --section WarpStateStats --section LaunchStats --section SchedulerStats \
           --section InstructionStats -k regex:norm_ \
           python3 benchmarks/tools/ncu_case.py ${NCU_CASE:-layernorm 131072 4096 bfloat16} ;;
    ncu_src)  # warp-state samples per SASS instruction of the kernels NCU_KERNEL matches
      run ncu_src ncu --clock-control none --section WarpStateStats --section SourceCounters \
        --section SpeedOfLight -k "regex:${NCU_KERNEL:-norm_bwd}" -o "$OUT/ncu_src" -f \
        python3 benchmarks/tools/ncu_case.py ${NCU_CASE:-layernorm 4096 16384 float16}
      ncu --import "$OUT/ncu_src.ncu-rep" --page source --csv --print-source sass \
        >"$OUT/ncu_sass.csv" 2>"$OUT/ncu_sass.err.log"
      ncu --import "$OUT/ncu_src.ncu-rep" --page details >"$OUT/ncu_details.log" 2>&1
      python3 benchmarks/tools/sass.py stalls "$OUT/ncu_sass.csv" 25 >"$OUT/ncu_stalls.log" 2>&1 ;;
    small|stalls) set=$([ "$s" = stalls ] && echo stalls)
      run "${s}_ncu" ncu --csv --metrics "$(python3 benchmarks/tools/small_kernels.py --metrics $set)" \
        --print-units base --profile-from-start off --log-file "$OUT/$s.csv" \
        python3 benchmarks/tools/small_kernels.py "$OUT/${s}_cases.txt"
      python3 benchmarks/tools/small_kernels.py --table "$OUT/${s}_cases.txt" "$OUT/$s.csv" \
        >"$OUT/$s.log" 2>&1 ;;
    bench) run bench python3 -m cupyln bench --out "$OUT/bench.json" --plot "$OUT/bench.png"
      # the targets, and each pass against this card's current record
      old=benchmarks/results/$(grep -q H200 "$OUT/gpu.txt" && echo h200 || echo h100).json
      [ -f "$OUT/bench.json" ] && python3 benchmarks/targets.py "$OUT/bench.json" "$old" -v \
        >"$OUT/targets.log" 2>&1 ;;
  esac
done
mkdir -p "$OUT/cache" && tar czf "$OUT/cache/cache.tgz" -C "$CUPY_CACHE_DIR" . 2>/dev/null
echo; echo "==== failures (first lines) ===="
grep -h -E "^(FAILED|ERROR)|Error:|Invalid|Race" "$OUT"/*.log 2>/dev/null | head -n 25
[ -f "$OUT/tune.log" ] && { echo; echo "==== tune ===="; cat "$OUT/tune.log"; }
[ -f "$OUT/ncu_stalls.log" ] && { echo; echo "==== ncu_src (samples per instruction) ===="; cat "$OUT/ncu_stalls.log"; }
[ -f "$OUT/targets.log" ] && { echo; echo "==== targets ===="; cat "$OUT/targets.log"; }
[ -f "$OUT/leave_out.log" ] && { echo; echo "==== leave_out ===="; cat "$OUT/leave_out.log"; }
[ -f "$OUT/host.log" ] && { echo; echo "==== host ===="; cat "$OUT/host.log"; }
[ -f "$OUT/small.log" ] && { echo; echo "==== small (ncu kernel durations) ===="; cat "$OUT/small.log"; }
[ -f "$OUT/stalls.log" ] && { echo; echo "==== stalls (ncu, small shapes) ===="; cat "$OUT/stalls.log"; }
echo; echo "==== summary ===="
printf '%s\n' "${summary[@]}"
# Every log goes into one archive, so that a run leaves few files to copy back.
# (Only the kinds present: a missing pattern made tar, and so the script, exit with status 2.)
(cd "$OUT" && shopt -s nullglob && logs=(./*.log ./*.txt ./*.csv) \
  && { [ ${#logs[@]} -eq 0 ] || tar czf logs.tgz --remove-files "${logs[@]}"; })
