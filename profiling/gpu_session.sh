#!/usr/bin/env bash
# One lease of a GPU machine: build the extension there, run the GPU tests, run the benchmarks, check the SASS,
# and leave every log under $OUT (or ./gpu_out when $OUT is unset).
#
#   bash profiling/gpu_session.sh [stage ...]
#
# A lease is 15 minutes of device time in all (machine start, every call, idle time; profiling/README.md §5), and
# one call at most 600 s. Two presets fill it, in order of value:
#   lease1  build, the SASS mix, the sdar-8b batch-1 decode row (#3's target), the launcher checks, then every
#           GPU test file, 4 at a time, the decode path first, the files that compile FlexAttention or run whole
#           CLIs last, then the random-configuration tests of every kernel family        (~540 s budget)
#   lease2  build (skipped on the same warm machine), the quick block-attention and unmask benches, then the
#           batch-128 sdar-4b decode row (REFERENCE §5: JetEngine's H200 figure), then packed vs unpacked decoding
#           forwards at batch 64, block 32                                              (budget: what the lease has left)
# Stages: build, prebuilt, tests, sass, kernels (unmask, linear, kv_cache, rms_norm, silu_mul, block_attn --quick,
# grpo_loss), decode1 (sdar-8b batch 1, block 4, graphs on, cuBLAS and the skinny-GEMM kernel), attn_quick,
# unmask_quick, decode128 (sdar-4b, batch 128, block 4, forced TPF 2, graphs on, cuBLAS), pack (sdar-8b, batch 64,
# block 32, forced TPF 4, ragged prompts, graphs on, SamplerConfig.pack auto vs off), decode (bench_decode.py,
# sdar-8b batch 1/8/64, block 4/32, graphs on, cuBLAS and the skinny-GEMM kernel, the reference child capped at
# 240 s), pdl (decode at batch 1 with programmatic dependent launch on and off), optim (bench_optim.py: the optimizer
# step resident vs offloaded), attn_full (every bench_block_attn shape), rl_step (bench_rl_step.py: the RL training
# pass, padded vs packed micro-batches, sdar-1.7b), ncu (Nsight Compute of the unmask and block-attention kernels).
# Default (no stage named): build tests sass kernels, a whole lease's worth and more.
# The build uses $CC / $CXX when set (RESULTS.md, 2026-11-22: launcher messages crashed in a build made with the
# lent image's /opt/gcc; try CC=/usr/bin/gcc CXX=/usr/bin/g++). It is skipped when this machine already has the
# package installed from the same sources (a second call on a warm machine: the install survives between calls;
# the sources' hash is kept in $LRF_INSTALLED_HASH_FILE, default /tmp/lrf_installed_hash).
# Each stage has its own time limit so that one hung stage cannot eat the lease, and the whole command has a
# budget ($GPU_SESSION_BUDGET_S, default 540 s: the device tool kills a call at 600 s, and a killed call returns
# the logs but none of the stages after the kill): a stage gets at most what is left of it, and a stage that
# would get less than 30 s is skipped with a line saying so. $GPU_TEST_LIMIT_S caps each test file (default 150 s).
# The logs are plain text; profiling/results_rows.py turns the bench lines into draft RESULTS.md rows.
# Reusing a build on a fresh machine: the build stage leaves the extension gzipped in $OUT/_C-<hash>.so.gz (the
# uncompressed library is over the 16 MiB a returned file may have; <hash> = src_hash below, of the C++/CUDA
# sources and the build script). Copy it into .prebuilt/ of the checkout (ignored by git), carry .prebuilt, and
# start the next call's stages with `prebuilt` instead of `build`: the library goes into the source tree's
# package and PYTHONPATH points there (same machine image only: same Python, torch and driver). A library built
# from other sources (csrc/ changed since) is refused. The build itself takes ~1-2 minutes on the lent machine's
# 16 cores (8 translation units in parallel; the longest, bindings.cpp, ~35 s on one core here).
set -u
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export MAX_JOBS=${MAX_JOBS:-12} NVCC_THREADS=${NVCC_THREADS:-4} LRF_PTXAS_VERBOSE=1
REPO=$PWD
stages=("$@"); [ ${#stages[@]} -eq 0 ] && stages=(build tests sass kernels)
expanded=()
for s in "${stages[@]}"; do
  case $s in
    lease1) expanded+=(build sass decode1 tests) ;;
    lease2) expanded+=(build attn_quick unmask_quick decode128 pack) ;;
    *) expanded+=("$s") ;;
  esac
done
stages=("${expanded[@]}")

BUDGET=${GPU_SESSION_BUDGET_S:-540}
TEST_LIMIT=${GPU_TEST_LIMIT_S:-150}
HASH_FILE=${LRF_INSTALLED_HASH_FILE:-/tmp/lrf_installed_hash}
stage() {  # stage NAME LIMIT_S LOGFILE CMD...
  local name=$1 limit=$2 log=$3; shift 3
  local left=$((BUDGET - SECONDS - 5))
  if [ "$left" -lt 30 ]; then
    echo "=== $name: skipped, ${left}s left of the ${BUDGET}s budget" | tee -a "$OUT/$log"
    return 124
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s)" | tee -a "$OUT/$log"
  timeout -k 10 "$limit" "$@" >>"$OUT/$log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/$log"
  return $rc
}

src_hash() { (cd "$REPO" && find csrc setup.py -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-12); }
so_path() { (cd /tmp && python3 -c 'import torch, lightningrl_fast._C as c; print(c.__file__)' 2>/dev/null); }  # torch first: _C links libc10

for s in "${stages[@]}"; do
  case $s in
    build)
      if [ -n "$(so_path)" ] && [ "$(cat "$HASH_FILE" 2>/dev/null)" = "$(src_hash)" ]; then
        echo "build: skipped, this machine has lightningrl_fast installed from these sources ($(src_hash))" \
          | tee -a "$OUT/build.log"
        continue
      fi
      { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
        nvcc --version | tail -n 2; python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'
      } >"$OUT/build.log" 2>&1
      stage build 300 build.log python3 -m pip install --no-build-isolation --no-deps -v . || exit 1
      src_hash >"$HASH_FILE"
      # The built library travels back so a later call can reuse it (the `prebuilt` stage; see the header).
      gzip -c "$(so_path)" >"$OUT/_C-$(src_hash).so.gz" 2>/dev/null
      # The launcher-message crash of the first lease (RESULTS.md): which libstdc++ the extension was linked
      # against and which one the process actually loads (a newer compiler's headers over an older runtime
      # would explain number formatting -- std::num_put -- crashing while string-only messages work).
      { ${CXX:-c++} --version | head -n 1; ldd "$(so_path)" | grep -E "stdc\+\+|gcc_s"
        (cd /tmp && python3 -c 'import torch, lightningrl_fast._C; print([l.split()[-1] for l in open("/proc/self/maps") if "stdc++" in l][:1])')
      } >"$OUT/libstdcxx.log" 2>&1
      grep -E "ptxas info|spill|Used [0-9]+ registers|stack frame" "$OUT/build.log" | sort -u | tail -n 60 ;;
    prebuilt)
      gz=$REPO/.prebuilt/_C-$(src_hash).so.gz
      [ -f "$gz" ] || { echo "prebuilt: no $gz: carry .prebuilt with the build of these sources" \
                             "(present: $(ls "$REPO/.prebuilt" 2>/dev/null | tr '\n' ' '))"; exit 1; }
      { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
        python3 -c 'import torch, sysconfig; print("torch", torch.__version__, torch.version.cuda, sysconfig.get_config_var("EXT_SUFFIX"))'
      } >"$OUT/build.log" 2>&1
      suffix=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
      gunzip -c "$gz" >"$REPO/lightningrl_fast/_C$suffix" || exit 1
      export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
      (cd /tmp && python3 -c 'import torch, lightningrl_fast._C as c; print(c.__file__, c.has_cuda(), c.cuda_archs())') \
        >>"$OUT/build.log" 2>&1 || { tail -n 20 "$OUT/build.log"; exit 1; }
      tail -n 1 "$OUT/build.log" ;;
    tests)
      # One pytest process per file, from a directory outside the checkout (so the installed package with _C is
      # the one imported): a crash in one file loses only that file's results.
      # The launcher-check tests run first, in a process of their own: on the lent image a launcher error message
      # with a number in it crashed the process (RESULTS.md, 2026-11-22), which would lose the tests beside it.
      # $GPU_TESTS narrows the files (e.g. "unmask block_attn"); the default is every file with GPU tests, the
      # decode path first (its CUDA-graph tests have not all run on hardware) and last the files that compile
      # FlexAttention per shape or run whole CLIs (minutes): a budget spent early skips those, not the decode tests
      order="sampler unmask block_attn linear kv_cache rms_norm silu_mul grpo_loss optim generate checkpoint
             masked_attn logprobs sft train distributed"
      files=(); for t in ${GPU_TESTS:-$order}; do files+=("$REPO/python_tests/test_$t.py"); done
      if [ -z "${GPU_TESTS:-}" ]; then  # any other file with GPU tests, after those
        for f in "$REPO"/python_tests/test_*.py; do
          case " ${files[*]} " in *" $f "*) ;; *) files+=("$f") ;; esac
        done
      fi
      # per-test time limits when pytest-timeout is there (it is on the lent image; the stage runs without it too)
      per_test=(); python3 -c 'import pytest_timeout' 2>/dev/null && per_test=(--timeout 100)
      (cd /tmp && stage "launcher checks" 120 tests.log python3 -m pytest "${files[@]}" -q -rfE \
          -p no:cacheprovider "${per_test[@]/100/60}" -k "launcher_checks")
      # $GPU_TEST_JOBS files at a time (default 4: the machine has 16 cores and the tests are small on the GPU),
      # each a `stage` of its own (at most $GPU_TEST_LIMIT_S, at most what the budget has left when it starts) with
      # its own log under tests_parts/; -v, so a file cut off at its limit still reports each test it finished.
      # The logs are joined in file order.
      parts=$OUT/tests_parts; mkdir -p "$parts"
      for f in "${files[@]}"; do
        # a file with GPU tests other than random-configuration ones (those run in the last stage below)
        awk '/mark\.gpu/ {g = 1} g && /^def test_/ {print; g = 0}' "$f" 2>/dev/null | grep -qv random_config || continue
        while [ "$(jobs -rp | wc -l)" -ge "${GPU_TEST_JOBS:-4}" ]; do wait -n; done
        name=$(basename "$f")
        (cd /tmp && stage "tests $name" "$TEST_LIMIT" "tests_parts/$name.log" python3 -m pytest "$f" -m gpu -v -rfE \
            --durations 5 -p no:cacheprovider "${per_test[@]}" -k "not launcher_checks and not random_config") &
      done
      wait
      # Last, every family's random-configuration tests (test_gpu_random_config: the GPU's share of the draws the
      # emulator tests make), in one process: they never cost a fixed test its place in the budget.
      (cd /tmp && stage "tests random configurations" "$TEST_LIMIT" "tests_parts/random_config.log" python3 -m pytest \
          "${files[@]}" -m gpu -v -rfE --durations 5 -p no:cacheprovider "${per_test[@]}" -k "random_config")
      for f in "${files[@]}" random_config; do
        log=$parts/$(basename "$f").log
        [ -f "$log" ] && cat "$log" >>"$OUT/tests.log"
      done
      rm -rf "$parts"
      grep -E "^=== tests|passed|failed|error" "$OUT/tests.log" | tail -n 30 ;;
    sass)
      so=$(so_path)
      [ -n "$so" ] || { echo "sass: lightningrl_fast._C does not import"; exit 1; }
      objdump=$(command -v cuobjdump || echo "$CUDA_HOME/bin/cuobjdump")
      full=$(mktemp)  # the whole SASS once (tens of MB), then one pass per kernel family
      { timeout 60 "$objdump" --dump-sass "$so" >"$full"
        timeout 30 "$objdump" --list-elf "$so"
        for k in block_attn unmask lm_head group_normalize kv_cache linear_kernel rms_norm qk_norm_rope silu_mul; do
          echo "--- $k: instruction mix"
          awk -v k="$k" '/Function :/ {on = index($0, k) > 0} on' "$full" \
            | grep -oE '^\s+/\*[0-9a-f]{4}\*/\s+[A-Z][A-Z0-9_.]+' | awk '{print $2}' | sed 's/\..*//' \
            | sort | uniq -c | sort -rn | head -n 25
        done
      } >"$OUT/sass.log" 2>&1
      rm -f "$full"
      grep -cE "HMMA|HGMMA" "$OUT/sass.log" ;;
    kernels)
      # bench_unmask times 3 modes per row count (greedy, two-level and per-token sampling) + 3 more at 32 / 1024
      # rows, each with the reference and its torch.compile: the longest of the kernel benches
      stage bench_unmask.py 300 bench.log python3 profiling/bench_unmask.py
      for b in bench_linear.py bench_kv_cache.py bench_rms_norm.py bench_silu_mul.py "bench_block_attn.py --quick" \
          bench_grpo_loss.py; do
        stage "$b" 150 bench.log python3 profiling/$b
      done
      grep -E '^\{"bench"' "$OUT/bench.log" | cut -c1-400 ;;
    decode1)
      # #3's target row: sdar-8b, batch 1, block 4, graphs on, both decode GEMMs, steady-state rate included
      stage bench_decode1 200 bench_decode1.log python3 profiling/bench_decode.py --config sdar-8b --batches 1 \
        --blocks 4 --graphs on --impl kernels --gemm cublas,kernel --repeats 2 --new-tokens 128 ;;
    attn_quick)
      # with the KV-split sweep of the decode rows (the data to tune kernels::block_attn_num_splits, #5 at batch 1)
      stage "bench_block_attn.py --quick" 150 bench.log python3 profiling/bench_block_attn.py --quick \
        --splits 1,2,4,8,16,32,64 ;;
    unmask_quick)
      # greedy and two-level sampling (the default) at 32 / 1024 / 8192 rows, no torch.compile column (minutes)
      stage "bench_unmask.py quick" 120 bench.log python3 profiling/bench_unmask.py --no-compile --rows 32,1024,8192 \
        --modes greedy,sample,sample-flat ;;
    decode128)
      # REFERENCE §5 names JetEngine at 5000+ tok/s for SDAR-4B, block 4, batch 128 on an H200 (real prompts, its
      # own TPF): the same shapes with random weights at a forced TPF of 2 (the figure scales with the TPF)
      stage bench_decode128 150 bench_decode128.log python3 profiling/bench_decode.py --config sdar-4b --batches 128 \
        --blocks 4 --tpf 2 --graphs on --impl kernels --gemm cublas --repeats 2 --new-tokens 256 ;;
    pack)
      # packed decoding forwards (sampler.py: the GEMMs on the rows' chunk tokens, not on [rows, 2 x block]) against
      # the unpacked step, where they should pay: a large working set of block-32 rows (compute-bound GEMMs)
      stage bench_decode_pack 200 bench_decode_pack.log python3 profiling/bench_decode.py --config sdar-8b \
        --batches 64 --blocks 32 --tpf 4 --graphs on --impl kernels --gemm cublas --pack auto,off --repeats 1 \
        --new-tokens 128 --ragged ;;
    optim)
      stage bench_optim.py 150 bench.log python3 profiling/bench_optim.py ;;
    attn_full)
      stage bench_block_attn 420 bench_attn_full.log python3 profiling/bench_block_attn.py --splits 1,4,16,64 ;;
    decode)
      # kernels first (their rows are printed as each finishes), then the reference ops in a child process
      # $DECODE_ARGS replaces the default shapes (e.g. "--batches 1,8 --impl kernels")
      stage bench_decode 540 bench_decode.log python3 profiling/bench_decode.py --config sdar-8b \
        ${DECODE_ARGS:---batches 1,8,64 --blocks 4,32 --graphs on --gemm cublas,kernel --repeats 3 --new-tokens 256 --child-timeout 240} ;;
    pdl)
      # programmatic dependent launch on / off (LRF_PDL=0) at batch 1, with both decode GEMMs
      stage bench_decode_pdl 300 bench_decode_pdl.log python3 profiling/bench_decode.py --config sdar-8b \
        --batches 1 --blocks 4 --graphs on --impl kernels --gemm cublas,kernel --pdl on,off --repeats 3 \
        --new-tokens 256 ;;
    rl_step)
      # first calls compile FlexAttention (forward + backward) per row length: a few per path and layout
      stage bench_rl_step 420 bench_rl_step.log python3 profiling/bench_rl_step.py ${RL_STEP_ARGS:-} ;;
    ncu)
      stage ncu 300 ncu.log bash profiling/ncu_kernels.sh "$OUT/ncu_kernels" ;;  # report + csv come back under $OUT
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
