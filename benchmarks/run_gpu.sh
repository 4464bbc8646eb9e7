#!/usr/bin/env bash
# Builds dfccl on a GPU machine and runs the GPU tests and benchmarks, each
# phase under its own time limit, logging to $OUT (default ./gpu-logs).
#   benchmarks/run_gpu.sh [phase ...]     phases: info build smoke tests mp graphs depth torch chaos latency bench
#                                         mpbench hostpath preempt net ab netbench all
#   ab (daemon images alternated, AB_IMAGES="a.fatbin b.fatbin") runs only where AB_IMAGES is set;
#   netbench (the network proxy's lanes alternated) only where named, not with all.
# Each phase's limit and extra arguments come from the environment, e.g.
#   BENCH_LIMIT=600 BENCH_ARGS="--devices 0,1" benchmarks/run_gpu.sh bench
# Tables go to $OUT/<phase>.log; results (JSON, PNG) to $OUT; then
#   python -m dfccl bench --report "$OUT"/dfccl-bench-*.json     # Markdown tables
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
phases=${*:-all}
has() { [[ " $phases " == *" $1 "* || " $phases " == *" all "* ]]; }
step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  # Its own session (no job control here: setsid does not fork, so the pid
  # is the session id), so that ranks it spawned and left behind go with it.
  setsid timeout --signal=KILL "$limit" "$@" > "$OUT/$name.log" 2>&1 &
  local pid=$!
  wait $pid
  local rc=$?
  pkill -KILL -s $pid 2>/dev/null
  echo "[$name] rc=$rc $(( $(date +%s) - t0 ))s"
  tail -n ${TAIL:-15} "$OUT/$name.log"
  return 0
}
# Two processes share one GPU side by side only under MPS (docs/gpu.md); a
# server's quit waits for its clients, which every step has ended by then.
mps_on() { nvidia-cuda-mps-control -d && export DFCCL_TEST_MPS=1 || echo "[mps] no MPS server: processes time-slice"; }
mps_off() { unset DFCCL_TEST_MPS; timeout --signal=KILL 15 bash -c 'echo quit | nvidia-cuda-mps-control' || true; }
if has info; then
  step info 60 bash -c "nvidia-smi -L; nvidia-smi topo -m; $PY -c 'import sys, numpy, cuda.bindings, Cython; print(sys.version); print(\"cuda-bindings\", cuda.bindings.__version__, \"cython\", Cython.__version__)'; $PY -c 'import torch; print(\"torch\", torch.__version__, torch.cuda.device_count())'; ls \$($PY -c 'import site;print(site.getsitepackages()[0])')/nvidia/nccl/lib"
fi
if has build; then
  step build 400 env DFCCL_CUDA_ARCHS=${DFCCL_CUDA_ARCHS:-90} $PY -m pip install --no-build-isolation --no-deps -e .
fi
if has smoke; then
  step smoke 120 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py -k smoke
fi
if has tests; then
  DFCCL_GPU_RESULTS="$OUT/gpu_results.jsonl" DFCCL_GPU_CHAOS_ROUNDS=${CHAOS_ROUNDS:-10} \
    step tests ${TESTS_LIMIT:-300} $PY -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py --timeout=120 -k "not chaos" ${PYTEST_ARGS:-}
fi
if has mp; then
  step mp ${MP_LIMIT:-240} $PY -m pytest -q -p no:cacheprovider tests/sim/test_multiprocess.py --timeout=200 -m gpu
fi
if has graphs; then
  step graphs ${GRAPHS_LIMIT:-240} $PY -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_graphs_gpu.py --timeout=120
fi
if has depth; then
  # Deep queues: two ranks of one process, then two processes under MPS.
  step depth ${DEPTH_LIMIT:-300} $PY -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_queue_depth_gpu.py --timeout=280
  mps_on
  step depth-mps ${DEPTH_MPS_LIMIT:-300} $PY -m pytest -q -rfE -p no:cacheprovider tests/sim/test_multiprocess.py \
    --timeout=280 -k deep_queues_two_processes_on_one_gpu
  mps_off
fi
if has torch; then
  # The torch backend, two processes under MPS: the compiled one (built
  # first, cached) and the Python one.
  mps_on
  step torch-build 300 env DFCCL_TORCH_IMPL=compiled $PY -m dfccl.torch
  for impl in compiled python; do
    step torch-$impl ${TORCH_LIMIT:-420} env DFCCL_TORCH_IMPL=$impl $PY -m pytest -q -rfE -p no:cacheprovider \
      tests/gpu/test_torch_gpu.py --timeout=180 ${TORCH_ARGS:-}
  done
  mps_off
fi
if has chaos; then
  DFCCL_GPU_RESULTS="$OUT/gpu_results.jsonl" DFCCL_GPU_CHAOS_ROUNDS=${CHAOS_ROUNDS:-100} \
    step chaos ${CHAOS_LIMIT:-300} $PY -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py --timeout=280 -k chaos
fi
# Speed against NCCL is `dfccl bench` (nccl-tests' flags): NCCL runs one
# thread per GPU (--mode thread, CuPy) or one process per GPU (--mode process,
# torch.distributed), never one thread driving every GPU.
if has latency; then
  # dfccl's own breakdown (Work.stats, daemon profile, queue depth), then one
  # collective waited for (-z 1) against NCCL in both modes.
  step latency ${LATENCY_LIMIT:-120} $PY benchmarks/bench_latency.py --out "$OUT" ${LATENCY_ARGS:-}
  for mode in thread process; do
    step latency-$mode ${LATENCY_Z_LIMIT:-240} $PY -m dfccl bench all_reduce -z 1 -b 8 -e 1M -f 2 -n 200 -w 20 \
      --mode $mode --no-progress --out "$OUT" ${LATENCY_Z_ARGS:-}
  done
fi
if has bench; then
  step bench ${BENCH_LIMIT:-450} $PY -m dfccl bench all -b 8 -e 512M -f 4 --mode thread --no-progress \
    --out "$OUT" ${BENCH_ARGS:-}
fi
if has mpbench; then
  step mpbench ${MPBENCH_LIMIT:-450} $PY -m dfccl bench all -b 8 -e 512M -f 4 --mode process --no-progress \
    --out "$OUT" ${MPBENCH_ARGS:-}
fi
if has hostpath; then
  step hostpath ${HOSTPATH_LIMIT:-120} $PY benchmarks/bench_host_path.py --out "$OUT" ${HOSTPATH_ARGS:-}
fi
if has preempt; then
  step preempt ${PREEMPT_LIMIT:-120} $PY benchmarks/bench_preemption.py --out "$OUT" ${PREEMPT_ARGS:-}
fi
if has net; then
  # Ranks on "different hosts": two processes under MPS through the network
  # proxy over UCX (the [net] extra), TCP on loopback.
  mps_on
  step net-build 120 $PY -m dfccl.net
  step net ${NET_LIMIT:-300} $PY -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_net_gpu.py --timeout=280
  mps_off
fi
if [[ " $phases " == *" netbench "* ]]; then
  # The proxy's lanes alternated against ucx_perftest (docs/performance-log.md,
  # sections 49 and 50): NET_LANES lane counts x NET_BPC bytes per channel, two rounds.
  mps_on
  for round in 1 2; do
    for lanes in ${NET_LANES:-1 2}; do
      for bpc in ${NET_BPC:-1048576 524288}; do
        DFCCL_NET_LANES=$lanes step netbench$round-lanes$lanes-bpc$bpc ${NETBENCH_LIMIT:-90} $PY benchmarks/bench_net.py \
          --backend cuda --sizes ${NET_SIZES:-1048576,4194304} --iters 20 --repeats 1 \
          --option bytes_per_channel=$bpc --out "$OUT"
      done
    done
  done
  mps_off
fi
if has ab && [ -n "${AB_IMAGES:-}" ]; then
  # Daemon images alternated in one run, two rounds (docs/profiling.md,
  # "Another daemon image"): AB_IMAGES="before.fatbin after.fatbin"; each
  # round runs every image's small-message bench, then its step profile
  # (counted only by an image built with DFCCL_STEP_PROFILE=1).
  for round in 1 2; do
    for img in $AB_IMAGES; do
      name=ab$round-$(basename "$img" | tr -c 'A-Za-z0-9._\n-' _)
      DFCCL_DAEMON_IMAGE=$img step $name-bench ${AB_LIMIT:-120} $PY -m dfccl bench all_reduce -b 8 -e 64K -f 8192 \
        -n 300 -w 30 --devices ${AB_DEVICES:-0,0} --no-nccl --no-progress --out "$OUT"
      DFCCL_DAEMON_IMAGE=$img step $name-profile ${AB_LIMIT:-120} $PY benchmarks/profile_daemon.py \
        --devices ${AB_DEVICES:-0,0} --size 8 --iters 2000 --out "$OUT"
    done
  done
fi
