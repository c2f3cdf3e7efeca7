#!/usr/bin/env bash
# Everything Sid checks and measures on the H200, in one device call.
#   usage (device tool, carry .carry): bash benchmarks/gpu_suite.sh [STEP ...]
# Steps: tests (the engine's GPU tests, ~160 s) hopper_tests (the Gluon prompt kernel's, sm_90)
#        kernel_tests (the kernels' tests on the GPU: a new machine
#        compiles every variant; 300 s did not cover the three files together)
#        throughput_qwen decode_roofline throughput_llama cost_qwen cost_qwen_m256 cost_llama cost_trained
#        canonical_sweep cost_swept (the cost with the sweep's best canonical attention constants)
#        pass_invariance cost_qwen_m128 (canonical passes of 128 rows only)
#        repro_trained repro_llama serve profile_qwen profile_qwen_lockstep profile_qwen_det profile_llama prefill prefill_qwen
#        pass_costs_qwen pass_costs_llama (passes timed queued or one at a time, at a context or at position 0)
#        host_profile (py-spy samples of the engine's host thread, Qwen at 0 and 100 %; needs the py-spy wheel in .carry/wheels)
#        host_profile_zero (the same at 0 %, for this code and the code in .carry/base)
#        attention (the Triton kernels, both schedules, against the floors: decode, prefill, a chunk after a cached prefix)
#        attention_prefill (its prefill cases alone: on sm_90 the Gluon kernels beside the Triton ones)
#        attention_timeline (each program of a batch-1 / batch-8 decode attention launch: its walk, the fold, the ends)
#        attention_host (a prompt step's attention a layer: host time against GPU time, four compositions)
#        attention_ab (this tree's kernels against a base's, bits and times in one process; AB_BASE names the
#          base's file, made here: git show REV:sid/kernels/paged_attention.py > .carry/base_pa.py; AB_KINDS
#          picks of prompt,decode,riding)
#        gemm_paths (which GEMM path keeps a row's bits at every row count, per shape, and its cost)
#        allreduce (two GPUs, nvidia-h200-x2: NCCL vs the canonical gather-and-sum vs a one-shot all-reduce,
#          rows x 4096 and rows x 8192)
#        tp_cost tp_latency (two GPUs: Llama at TP=1 and TP=2, the cost of determinism on both workloads, and
#          decode step time at batch 1 / 8 / 64 and 32k at batch 1)
#        cost_qwen_tail cost_llama_tail (the cost of determinism on the long-tailed workload: log-normal lengths)
#        base_qwen base_llama (0 % deterministic on the code in .carry/base, the commit a change is measured
#          against, in the same call: git archive BASE sid benchmarks | tar -x -C .carry/base)
#        serve_mixed (online, Llama shape: 8 req/s, 25 % deterministic, each class's TTFT / TPOT / ITL)
#        latency_qwen latency_llama (decode step time, all deterministic vs all normal, batch 1..256 and 32k at batch 1)
#        latency_profile (the same at batch 1 and 8, both models, one round, with each kind's GPU time by kernel)
# Environment: REPEATS (cost_*, default 1), FRACTIONS (cost_*, default all), STEP_LOG=1 (cost_*: time steps by kind),
#   STRATEGY (cost_*: auto, speculate, direct or whole; default auto),
#   LLAMA_REQUESTS, PREFILL_SEQS (default 8).
# `serve` needs the server's packages, absent on the H200 image: carry them as wheels in .whl
# (ignored by git), made here with, for each of fastapi starlette pydantic pydantic_core uvicorn
# annotated-types typing-inspection annotated-doc opentelemetry-api importlib-metadata at the venv's versions:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl NAME==VERSION
# A failing step does not stop the next. Logs and JSON go to a tarball under $OUT; the
# last lines printed are each step's table.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SID_TRAINED_MODEL=$PWD/.carry/models/tiny-pycode-llama
RES=/tmp/sid-results; mkdir -p "$RES"; OUT=${OUT:-out}; mkdir -p "$OUT"
TRAINED=$SID_TRAINED_MODEL
COST_ARGS="${FRACTIONS:+--fractions $FRACTIONS} ${STEP_LOG:+--step-log} ${STRATEGY:+--strategy $STRATEGY}"

run_step() {
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$RES/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$RES/summary.txt"
  tail -n 16 "$RES/$name.log" >> "$RES/summary.txt"
  # After every step, so a call cut short by its time limit still brings back what ran.
  tar czf "$OUT/results.tar.gz" -C "$RES" . && cp "$RES/summary.txt" "$OUT/summary.txt"
}

step() {
  case $1 in
    tests) run_step tests 300 python3 -m pytest -q -x tests/test_gpu.py ;;
    hopper_tests) run_step hopper_tests 300 python3 -m pytest -q tests/test_hopper_prefill.py ;;
    kernel_tests) run_step kernel_tests 540 python3 -m pytest -q -x tests/test_kernels.py tests/test_layer_kernels.py ;;
    throughput_qwen) run_step throughput_qwen 200 python3 benchmarks/throughput.py --model qwen3-0.6b --peer --lockstep --out "$RES" ;;
    throughput_llama) run_step throughput_llama 200 python3 benchmarks/throughput.py --model llama-3.1-8b --lockstep --out "$RES" ;;
    decode_roofline) run_step decode_roofline 200 python3 benchmarks/decode_roofline.py --model llama-3.1-8b --out "$RES" ;;
    cost_qwen) run_step cost_qwen 400 python3 benchmarks/determinism_cost.py --model qwen3-0.6b --repeats "${REPEATS:-1}" $COST_ARGS --out "$RES/qwen" ;;
    cost_qwen_m256) run_step cost_qwen_m256 300 python3 benchmarks/determinism_cost.py --model qwen3-0.6b --canonical-rows 256 --repeats "${REPEATS:-1}" --fractions 0,0.5,1.0 --out "$RES/qwen_m256" ;;
    cost_qwen_m128) run_step cost_qwen_m128 300 python3 benchmarks/determinism_cost.py --model qwen3-0.6b --max-canonical-rows 128 --repeats "${REPEATS:-1}" $COST_ARGS --out "$RES/qwen_m128" ;;
    pass_invariance) run_step pass_invariance 120 python3 benchmarks/pass_invariance.py --out "$RES" ;;
    canonical_sweep) run_step canonical_sweep 200 python3 benchmarks/canonical_sweep.py --out "$RES/sweep" ;;
    cost_swept) run_step cost_swept_qwen 150 python3 benchmarks/determinism_cost.py --model qwen3-0.6b --repeats 1 --fractions 0,0.02,0.1,0.5,1.0 --canonical-config "$RES/sweep/canonical_best.json" --out "$RES/swept_qwen"
      run_step cost_swept_llama 240 python3 benchmarks/determinism_cost.py --model llama-3.1-8b --repeats 1 --fractions 0,0.5,1.0 --canonical-config "$RES/sweep/canonical_best.json" --out "$RES/swept_llama" ;;
    cost_llama) run_step cost_llama 580 python3 benchmarks/determinism_cost.py --model llama-3.1-8b --requests "${LLAMA_REQUESTS:-256}" --repeats "${REPEATS:-1}" $COST_ARGS --out "$RES/llama" ;;
    cost_trained) run_step cost_trained 200 python3 benchmarks/determinism_cost.py --model "$TRAINED" --max-len 400 --repeats 1 $COST_ARGS --out "$RES/trained" ;;
    repro_trained) run_step repro_trained 200 python3 -m sid repro --model "$TRAINED" --device cuda --out "$RES/repro_trained" ;;
    serve) python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
      export PYTHONPATH=$PYTHONPATH:/tmp/site && run_step serve 400 python3 benchmarks/serve.py --model llama-3.1-8b --out "$RES" ;;
    repro_llama) run_step repro_llama 300 python3 -m sid repro --model /tmp/sid-preset-llama-3.1-8b --load-format dummy --device cuda --max-model-len 2048 --max-tokens 32 --long-prompt 512 --out "$RES/repro_llama" ;;
    prefill) run_step prefill 120 python3 benchmarks/prefill.py --model llama-3.1-8b --seqs "${PREFILL_SEQS:-8}" --out "$RES" ;;
    prefill_qwen) run_step prefill_qwen 120 python3 benchmarks/prefill.py --model qwen3-0.6b --seqs "${PREFILL_SEQS:-8}" --out "$RES" ;;
    pass_costs_qwen) run_step pass_costs_qwen 150 python3 benchmarks/pass_costs.py --model qwen3-0.6b --out "$RES/pass_costs_qwen" ;;
    pass_costs_llama) run_step pass_costs_llama 200 python3 benchmarks/pass_costs.py --model llama-3.1-8b --out "$RES/pass_costs_llama" ;;
    host_profile) python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .carry/wheels/py_spy-*.whl &&
      run_step host_profile 200 /tmp/pyspy/bin/py-spy record --nonblocking -r 100 --format raw -o "$RES/host_profile.txt" -- \
        python3 benchmarks/determinism_cost.py --model qwen3-0.6b --repeats 1 --fractions 0,1.0 --out "$RES/host_profile" ;;
    host_profile_zero) python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .carry/wheels/py_spy-*.whl &&
      for code in current base; do
        src=$PWD; [ $code = base ] && src=$PWD/.carry/base
        run_step host_zero_$code 200 env PYTHONPATH=$src /tmp/pyspy/bin/py-spy record --nonblocking -r 50 --format raw \
          -o "$RES/host_zero_$code.txt" -- python3 $src/benchmarks/determinism_cost.py --model qwen3-0.6b --fractions 0 \
          --repeats 2 --out "$RES/host_zero_$code"
      done ;;
    attention) run_step attention 400 python3 benchmarks/attention.py --out "$RES" ;;
    attention_prefill) run_step attention_prefill 300 python3 benchmarks/attention.py --kinds prefill --out "$RES" ;;
    attention_ab) run_step attention_ab 500 python3 benchmarks/attention_ab.py --base-file "${AB_BASE:-.carry/base_pa.py}" \
      --kinds "${AB_KINDS:-prompt,decode,riding}" --out "$RES" ;;
    attention_timeline) run_step attention_timeline 200 python3 benchmarks/attention_timeline.py --batches 1,8 --out "$RES" ;;
    attention_host) run_step attention_host 120 python3 benchmarks/attention_host.py --out "$RES" ;;
    cost_qwen_tail) run_step cost_qwen_tail 400 python3 benchmarks/determinism_cost.py --model qwen3-0.6b --workload lognormal --repeats "${REPEATS:-1}" $COST_ARGS --out "$RES/qwen_tail" ;;
    cost_llama_tail) run_step cost_llama_tail 500 python3 benchmarks/determinism_cost.py --model llama-3.1-8b --workload lognormal --repeats "${REPEATS:-1}" $COST_ARGS --out "$RES/llama_tail" ;;
    cost_llama_base_recheck) run_step cost_llama_recheck 300 python3 benchmarks/determinism_cost.py --model llama-3.1-8b --fractions 0,0.02 --repeats 2 --out "$RES/llama_recheck" ;;
    qwen_zero) run_step qwen_zero 200 python3 benchmarks/determinism_cost.py --model qwen3-0.6b --fractions 0 --repeats 3 --out "$RES/qwen_zero"
      run_step base_qwen_zero 200 env PYTHONPATH=$PWD/.carry/base python3 .carry/base/benchmarks/determinism_cost.py --model qwen3-0.6b --fractions 0 --repeats 3 --out "$RES/base_qwen_zero" ;;
    base_qwen) run_step base_qwen 200 env PYTHONPATH=$PWD/.carry/base python3 .carry/base/benchmarks/determinism_cost.py --model qwen3-0.6b --fractions 0 --repeats 1 --out "$RES/base_qwen" ;;
    base_llama) run_step base_llama 300 env PYTHONPATH=$PWD/.carry/base python3 .carry/base/benchmarks/determinism_cost.py --model llama-3.1-8b --fractions 0 --repeats 1 --out "$RES/base_llama" ;;
    serve_mixed) python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
      export PYTHONPATH=$PYTHONPATH:/tmp/site && run_step serve_mixed 400 python3 benchmarks/serve.py --model llama-3.1-8b --rates 8 --deterministic-fractions 0.25 --num-prompts 160 --out "$RES" ;;
    gemm_paths) run_step gemm_paths 300 python3 benchmarks/gemm_paths.py --out "$RES" ;;
    tp_cost) for tp in 1 2; do for w in uniform lognormal; do
        run_step tp${tp}_cost_$w 400 python3 benchmarks/determinism_cost.py --model llama-3.1-8b --tensor-parallel-size $tp \
          --workload $w --repeats 1 --fractions "${FRACTIONS:-0,0.1,1.0}" --out "$RES/tp${tp}_$w"
      done; done ;;
    tp_latency) for tp in 1 2; do
        run_step tp${tp}_latency 300 python3 benchmarks/latency.py --model llama-3.1-8b --tensor-parallel-size $tp \
          --batches 1,8,64 --rounds 1 --out "$RES/tp${tp}_latency"
      done ;;
    allreduce) run_step allreduce 200 python3 benchmarks/allreduce.py --out "$RES"
      run_step allreduce_70b 200 python3 benchmarks/allreduce.py --hidden 8192 --out "$RES/70b" ;;
    latency_qwen) run_step latency_qwen 400 python3 benchmarks/latency.py --model qwen3-0.6b --rounds "${REPEATS:-1}" --out "$RES/latency_qwen" ;;
    latency_llama) run_step latency_llama 500 python3 benchmarks/latency.py --model llama-3.1-8b --rounds "${REPEATS:-1}" --out "$RES/latency_llama" ;;
    latency_profile) for m in qwen3-0.6b llama-3.1-8b; do
        run_step latency_profile_$m 300 python3 benchmarks/latency.py --model $m --batches 1,8 --long-context 0 --rounds 1 \
          --profile --out "$RES/latency_profile_$m"
      done ;;
    profile_qwen) run_step profile_qwen 200 python3 benchmarks/step_profile.py --model qwen3-0.6b --out "$RES" ;;
    profile_qwen_lockstep) run_step profile_qwen_lockstep 200 python3 benchmarks/step_profile.py --model qwen3-0.6b --no-async-scheduling --out "$RES/lockstep" ;;
    profile_qwen_det) run_step profile_qwen_det 200 python3 benchmarks/step_profile.py --model qwen3-0.6b --deterministic 1.0 --out "$RES/det" ;;
    profile_llama) run_step profile_llama 200 python3 benchmarks/step_profile.py --model llama-3.1-8b --out "$RES" ;;
    *) echo "unknown step $1" ;;
  esac
}

nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee "$RES/summary.txt"
# The device's copy of the tree carries a stale .git: name the sources by their digest
# (here: find sid -name '*.py' | LC_ALL=C sort | xargs cat | sha1sum) to match a run with a commit.
echo "sources $(find sid -name '*.py' | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-12)" | tee -a "$RES/summary.txt"
# The GPU's clocks, power and throttle reasons every 250 ms, to tell a slow GPU from a slow host.
SMI=clocks_event_reasons.active; nvidia-smi --query-gpu=$SMI --format=csv >/dev/null 2>&1 || SMI=clocks_throttle_reasons.active
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,$SMI --format=csv -lms 250 > "$RES/smi.csv" 2>&1 &
SMI_PID=$!
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from common import model_dir; model_dir('llama-3.1-8b'); model_dir('qwen3-0.6b')"
for s in "${@:-tests throughput_qwen decode_roofline throughput_llama}"; do
  for one in $s; do step "$one"; done
done
kill $SMI_PID 2>/dev/null
tar czf "$OUT/results.tar.gz" -C "$RES" .
cp "$RES/summary.txt" "$OUT/summary.txt"
cat "$RES/summary.txt"
