#!/usr/bin/env bash
# Runs benchmark commands on a GPU machine, each in its own process with its own time limit, keeping logs.
#   bash benchmarks/gpu_run.sh NAME:SECONDS:ARGS... (ARGS for benchmarks/throughput.py, 'parity', or a
#   script and its args, e.g. benchmarks/loss_parity.py --config ...; ARGS may
#   begin with VAR=VALUE words, set for that run alone, e.g. XLA_FLAGS=--xla_dump_to=/tmp/d)
# The calls measured on a GPU are listed on docs/performance.md (training against PyTorch, then generation:
#   bash benchmarks/gpu_run.sh generate:420:"benchmarks/generate.py --family llama --batches 1,32 --max_load 4").
# Logs (and each throughput run's JSON) go to /tmp/shardzoo_bench, packed into $OUT/all.tgz at the end when $OUT is
# set (the device tool returns at most 8 files). Wheels in .whl/ are installed first if present: the GPU image (Python
# 3.12) lacks ml_collections, grain and grain's array_record, portpicker and googleapis-common-protos, and reaches no
# registry, so before the first call run, here (.whl/ is git-ignored), and name .whl in the device tool's carry:
#   for p in ml_collections==1.1.0 grain==0.2.18 array_record==0.8.6 portpicker==1.6.0 googleapis-common-protos==1.76.0
#   do pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform any -d .whl $p; done
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
LOGS=/tmp/shardzoo_bench; mkdir -p "$LOGS"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" 2>&1 | tail -1
for run in "$@"; do
  name=${run%%:*}; rest=${run#*:}; secs=${rest%%:*}; args=${rest#*:}
  echo "=== $name ($secs s): $args"
  envs=(); set -f; words=($args); set +f
  while [ ${#words[@]} -gt 0 ] && [[ ${words[0]} =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; do envs+=("${words[0]}"); words=("${words[@]:1}"); done
  if [ "${words[0]}" = parity ]; then cmd=(python3 benchmarks/attention_parity.py "${words[@]:1}")
  elif [[ ${words[0]} == *.py ]]; then cmd=(python3 "${words[@]}")
  else cmd=(python3 benchmarks/throughput.py "${words[@]}" --out "$LOGS/$name.json"); fi
  env "${envs[@]}" timeout "$secs" "${cmd[@]}" > "$LOGS/$name.log" 2>&1; echo "exit $?" >> "$LOGS/$name.log"
  grep -v -E "^[IW][0-9]{4} |Warning|warnings.warn|^  warnings|UserWarning" "$LOGS/$name.log" | tail -${TAIL:-16}
done
if [ -n "$OUT" ]; then tar czf "$OUT/all.tgz" -C "$LOGS" .; fi
