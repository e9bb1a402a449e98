"""The tiny GPT trained data-parallel on 2 gloo ranks: compressed gradients reach the
uncompressed loss (issue #8: within 2% after a fixed number of steps)."""

from ccfx.demo_dp import format_dp_demo, run_dp_demo

SMALL_GPT = {"n_layer": 2, "n_embd": 64, "n_head": 4, "block_size": 32}


def test_tiny_gpt_with_powersgd_and_int8_gradients_trains_within_2_percent():
    result = run_dp_demo(world=2, steps=150, codec=["powersgd:rank=4,ef", "int8"],
                         batch_per_rank=8, model=SMALL_GPT, lr=6e-3, timeout_s=400)
    base, *compressed = result.runs
    assert base.final_loss() < base.losses[0] - 0.5, "the uncompressed run did not learn"
    for run in compressed:
        # "within 2%": not worse than the uncompressed loss by more than 2% (it may be lower)
        gap = (run.final_loss() - base.final_loss()) / base.final_loss()
        assert gap <= 0.02, (run.name, run.final_loss(), base.final_loss())
        assert sum(run.wire_bytes) < sum(base.wire_bytes) / 3
    text = format_dp_demo(result)
    assert "powersgd" in text and "gradient buckets" in text


def test_tiny_gpt_with_local_steps_h50_int8_trains_within_3_percent_of_per_step():
    """Issue #11: H = 50 local steps with int8 pseudo-gradients, after the same tokens as
    per-step data parallel, evaluated on held-out batches after the last sync. The outer step
    is FedAvg's (lr 1, no momentum): from a random init, six outer steps do not warm DiLoCo's
    Nesterov momentum up (measured: +4.6 % with lr 0.7 / momentum 0.9, +0.9 % with this;
    DiLoCo itself starts from a pretrained model). ~400x fewer bytes per step."""
    local = {"name": "H=50 int8", "sync_every": 50, "outer_codec": "int8", "outer_lr": 1.0,
             "outer_momentum": 0.0}
    result = run_dp_demo(world=2, steps=300, codec=[local], batch_per_rank=8, model=SMALL_GPT,
                         lr=6e-3, timeout_s=400, eval_batches=4)
    base, run = result.runs
    assert base.eval_loss < base.losses[0] - 1.0, "per-step data parallel did not learn"
    gap = (run.eval_loss - base.eval_loss) / base.eval_loss
    assert gap <= 0.03, (run.eval_loss, base.eval_loss)
    assert sum(run.wire_bytes) * 100 < sum(base.wire_bytes)
