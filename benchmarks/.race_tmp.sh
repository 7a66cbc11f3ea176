python3 -m pip install -q --no-deps --no-build-isolation . >/dev/null 2>&1
export CUPY_CACHE_DIR=/tmp/cupy_cache; mkdir -p $CUPY_CACHE_DIR; tar xzf .cupy_cache/cache.tgz -C $CUPY_CACHE_DIR
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
R='^rmsnorm 20x131072 float32$'; L='^layernorm 16x262144 bfloat16$'
lane() { for p in "$@"; do k=${p%:*}; v=${p##*:}; t0=$(date +%s)
  CUPYLN_SANITIZE_K="$([ $k = R ] && echo "$R" || echo "$L")" CUPYLN_SANITIZE_VARIANTS=$v \
  compute-sanitizer --tool racecheck --error-exitcode 9 python3 benchmarks/sanitize_cases.py >$OUT/race_$k$v.log 2>&1
  echo "$k$v rc=$? $(( $(date +%s)-t0 ))s $(grep -E 'worst|SUMMARY' $OUT/race_$k$v.log | tr '\n' ' ')"; done; }
export -f lane; export R L
timeout ${T:-560} bash -c "lane L:5 R:6 & lane L:6 R:7 & lane L:7 & wait"
