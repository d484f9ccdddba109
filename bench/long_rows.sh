#!/bin/bash
# Long rows on this CPU (docs/planner.md, "Long rows"): SmolLM2-135M with LoRA at the longest row one process holds
# under a B GB device budget (recipes.plan longest=true), then 2x and 4x longer on cpu-2 and cpu-4, where the planner
# splits each row over the processes (context parallelism). Three steps each (the first two traced for the peak
# memory, the third for the step time): the measured peak and step against the predicted.
# Usage: B=1.5 bash bench/long_rows.sh   (about 45 minutes on two cores: cpu-4's steps take 10 minutes each)
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-.venv/bin/python}
B=${B:-1.5}
DATA=${TMPDIR:-/tmp}/long_rows.jsonl
OUT=${TMPDIR:-/tmp}/long_rows
$PY - "$DATA" <<'EOF'
import json, random, sys
words = open("README.md").read().split()
rng = random.Random(0)
with open(sys.argv[1], "w") as f:
    for _ in range(8):  # samples longer than any row tried: each row is one document cut at max_seq_len
        f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(40000))}) + "\n")
EOF
L=$($PY -m recipes.plan model=smollm2_135m method=lora flavor=cpu flavor.device_memory_gb="$B" batch_size=1 \
      longest=true 2>&1 | grep -oE "trains \(.*\): [0-9,]+ tokens" | grep -oE "[0-9,]+ tokens" | tr -d ', tokens')
echo "longest one-process row under $B GB: $L"
for k in 1 2 4; do
  flavor=cpu; [ "$k" -gt 1 ] && flavor=cpu-$k
  rm -rf "$OUT-$k"
  /usr/bin/time -f "wall %e s" $PY -m recipes.lora_finetune model=smollm2_135m flavor=$flavor \
    flavor.device_memory_gb="$B" dataset=text dataset.path="$DATA" max_seq_len=$((L * k)) batch_size=1 max_steps=3 \
    logger=stdout sample_max_new_tokens=0 optimizer.warmup_steps=0 output_dir="$OUT-$k" 2>&1 |
    grep -E "Configuration|Step [123]/|Peak tensor|Step time|rror|wall"
done
