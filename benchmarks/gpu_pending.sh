# The GPU checks of the checkpoint and data paths, one part per call (each fits in 10 minutes);
# results go under $OUT (or ./gpu-pending). Their figures on an H200:
# docs/performance.md, "H200 host, 1 GB of state". Run them again after changing those paths.
#
#   bash benchmarks/gpu_pending.sh tests        # every GPU test (~4 min): attention kernels,
#                                               # packed varlen paths, pinned data batches,
#                                               # CUDA checkpoint staging
#   bash benchmarks/gpu_pending.sh checkpoint   # the checkpoint benchmark on the host, hashing
#                                               # on a second thread and inline (~5 min)
#   bash benchmarks/gpu_pending.sh checkpoint-cuda   # the same with the state on the GPU (~2 min)
#
# On the device machine, first make the project's wheels and the kernel bundle importable
# (../shared/tools/device-wheels.sh and gpu-kernels-bundle.sh build them here; carry them):
#   mkdir -p /tmp/site && tar xJf bundle/site.tar.xz -C /tmp/site
#   pip install -q --no-deps --no-index --target /tmp/wh .wheels/*.whl
#   export PYTHONPATH=$PWD:/tmp/wh:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
set -euo pipefail
OUT=${OUT:-gpu-pending}
mkdir -p "$OUT"
PY=${PY:-python3}
case "${1:-}" in
  tests)
    $PY -m pytest -m gpu tests -q -rs \
      --junitxml "$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log" ;;
  checkpoint)
    for thread in auto off; do
      $PY benchmarks/checkpoint.py --size-mb 1000 --repeats 5 --async-steps 3 \
        --hash-thread "$thread" --json "$OUT/checkpoint-host-$thread.json" \
        2>&1 | tee "$OUT/checkpoint-host-$thread.log"
    done ;;
  checkpoint-cuda)
    $PY benchmarks/checkpoint.py --size-mb 1000 --repeats 5 --async-steps 3 --device cuda \
      --json "$OUT/checkpoint-cuda.json" 2>&1 | tee "$OUT/checkpoint-cuda.log" ;;
  *)
    echo "usage: bash benchmarks/gpu_pending.sh tests|checkpoint|checkpoint-cuda" >&2
    exit 2 ;;
esac
