#!/usr/bin/env bash
# The layout planner from the command line: which pipeline x data layout, codecs and local
# steps a 1.4 B-parameter GPT should use on 64 GPUs in 8 nodes, two groups of nodes 1 Gbit/s
# apart. Nothing is allocated: the model is built on the meta device (examples/gpt1b.py).
#
#     bash examples/plan.sh
#
# Other inputs: --cluster examples/cluster64.toml (the same GPUs, no slow split), --model
# examples/gpt1b.py:gpt_1b_big_batch (4x the batch: only with each block recomputed or a
# pipeline do the activations fit),
# --json (the chosen options only), --target STEPS (also the time to reach them).
# In Python: ccfx.plan_parallel(model, example_inputs, "examples/cluster64_split.toml").
set -euo pipefail
cd "$(dirname "$0")/.."                   # the paths below are the repository's

ccfx plan --cluster examples/cluster64_split.toml --model examples/gpt1b.py:gpt_1b --top 3
