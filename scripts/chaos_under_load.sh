#!/usr/bin/env bash
# The multi-rank failure tests, run again beside a CPU burner: a dead or frozen rank must still
# be named, in bounded time, on a machine whose cores are busy with something else. CI runs this
# after the suite so that flakiness under load shows before it lands.
#
#   scripts/chaos_under_load.sh            (from the repository root, after the README's set-up)
set -euo pipefail
cd "$(dirname "$0")/.."

burners=()
for _ in $(seq "$(nproc)"); do
    python3 -c "while True: pass" &
    burners+=($!)
done
trap 'kill "${burners[@]}" 2>/dev/null || true' EXIT

tests=(
    "tests/test_pipeline_errors.py::test_a_rank_that_dies_mid_training_is_an_error_not_a_hang"
    "tests/test_pipeline_errors.py::test_a_frozen_rank_fails_its_peer_after_collective_timeout_s"
    "tests/test_data_parallel.py::test_a_dead_rank_is_an_error_within_the_timeout_named_by_rank_not_only_by_address"
    "tests/test_collectives_pass.py::test_a_dead_tensor_parallel_rank_is_named_on_the_users_mesh"
    "tests/test_collectives_pass.py::test_a_frozen_tensor_parallel_rank_is_named_within_collective_timeout_s"
    "tests/test_local_steps.py::test_a_dead_replica_on_the_ring_is_named_with_the_outer_sync_fragment_and_step"
)
# Bounded: each test bounds its own waits; this bounds the pass.
timeout 900 .venv/bin/python -m pytest -q -p no:cacheprovider "${tests[@]}"
