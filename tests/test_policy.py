import pytest

from memo import ActivationPolicy, ModelConfig, Transformer
from memo.policy import (
    DEFAULT_TILE_TOKENS,
    PlanProblem,
    host_bytes,
    least_host,
    offloaded,
    plan_seconds,
    reloaded,
    solve_plan,
    split_row,
)


def test_alpha_out_of_range_is_rejected_with_the_flag_name():
    with pytest.raises(ValueError, match=r"`--alpha` must be in \[0, 1\], got 1.3"):
        ActivationPolicy("memo", alpha=1.3)


def test_alpha_with_a_strategy_that_does_not_swap_is_rejected():
    with pytest.raises(ValueError, match="only to strategy 'memo'"):
        ActivationPolicy("full", alpha=0.5)


def test_unknown_strategy_is_rejected():
    with pytest.raises(ValueError, match="--strategy"):
        ActivationPolicy("offload")


def test_per_layer_alpha_must_match_the_depth():
    with pytest.raises(ValueError, match="lists 3 values for a model of 4 layers"):
        Transformer(ModelConfig.preset("tiny"), ActivationPolicy("memo", alpha=[0.1, 0.2, 0.3]))


def test_a_plan_must_name_known_modes_and_match_the_depth():
    with pytest.raises(ValueError, match="`--plan` modes must be keep, memo, checkpoint, got 'swap'"):
        ActivationPolicy("memo", plan=("memo", "swap"))
    with pytest.raises(ValueError, match="lists 3 modes for a model of 4 layers"):
        Transformer(ModelConfig.preset("tiny"), ActivationPolicy("memo", plan=("memo",) * 3))
    with pytest.raises(ValueError, match="`--plan` applies only to strategy 'memo'"):
        ActivationPolicy("full", plan=("memo",))
    with pytest.raises(ValueError, match="`--tile-tokens` must be positive"):
        ActivationPolicy("memo", tile_tokens=0)


def test_last_buffered_layer_of_each_parity_keeps_its_buffer_unless_asked():
    assert offloaded(["memo"] * 6) == [True] * 4 + [False] * 2
    assert offloaded(["memo"] * 6, offload_last_layers=True) == [True] * 6
    assert offloaded(["keep"] * 6) == [False] * 6
    # a keep layer uses no buffer: layer 1's buffer is next written by layer 5 (not 3), layer 2's by layer 4
    assert reloaded(["memo", "memo", "memo", "keep", "checkpoint", "memo"]) == [True, True, True, False, False, False]
    assert offloaded(["checkpoint", "memo", "keep", "keep"]) == [False] * 4


def test_split_row_floors_so_the_copy_never_exceeds_alpha():
    assert split_row(0.37, 37) == 13  # 13.69 tokens -> 13
    assert split_row(1.0, 37) == 37 and split_row(0.0, 37) == 0
    assert split_row(0.5, 10) == 5


def test_tile_length_is_the_default_or_the_sequence_when_shorter():
    assert ActivationPolicy("memo", alpha=0.5).tile_for(100) == 100
    assert ActivationPolicy("memo", alpha=0.5).tile_for(1 << 20) == DEFAULT_TILE_TOKENS
    assert ActivationPolicy("none", tile_tokens=96).tile_for(1000) == 96


def _problem(**kw):
    """Ten layers, two of which keep their buffers: 8 send input + attention (100 + 100) and α of 1000."""
    base = dict(
        n_layers=10,
        input_bytes=100,
        attention_bytes=100,
        other_bytes=1000,
        local_bytes=0,
        keep_bytes=10**6,
        bandwidth=1000.0,
        layer_seconds=1.0,
        backward_seconds=2.0,
        attention_seconds=0.8,
        qkv_seconds=0.05,
        mlp_seconds=0.1,
        host_budget=10**9,
        slack=0.0,  # the fastest plan: what the tests below compute by hand
    )
    base.update(kw)
    return PlanProblem(**base)


def _alpha(p):
    modes, alphas = solve_plan(p)
    assert modes == ["memo"] * p.n_layers
    return alphas[0]


def test_alpha_is_set_by_copy_time_when_bandwidth_binds():
    # (200 + a*1000) / 1000 <= 0.7  ->  a = 0.5
    p = _problem(layer_seconds=0.7)
    a = _alpha(p)
    assert a == pytest.approx(0.5)
    assert (p.input_bytes + p.attention_bytes + a * p.other_bytes) / p.bandwidth == pytest.approx(p.layer_seconds)


def test_alpha_is_set_by_host_memory_when_budget_binds():
    # 8 * (200 + a*1000) <= 3200 -> a = 0.2
    p = _problem(host_budget=3200)
    a = _alpha(p)
    assert a == pytest.approx(0.2)
    assert host_bytes(p, ["memo"] * 10, [a] * 10) == pytest.approx(p.host_budget)


def test_alpha_is_one_when_neither_constraint_binds():
    assert _alpha(_problem(layer_seconds=100.0)) == 1.0


def test_alpha_is_zero_when_even_the_input_copy_is_not_hidden():
    assert _alpha(_problem(layer_seconds=0.1)) == 0.0


def test_a_short_host_gives_up_memo_layers_one_at_a_time():
    # at alpha = 0 the 8 sending layers need 1600; each checkpointed one needs 100 less
    for budget, checkpointed in ((1600, 0), (1599, 1), (1500, 1), (1499, 2), (900, 7)):
        modes, alphas = solve_plan(_problem(host_budget=budget))
        assert modes == ["checkpoint"] * checkpointed + ["memo"] * (10 - checkpointed), budget
        assert host_bytes(_problem(), modes, alphas) <= budget
    with pytest.raises(ValueError, match="host memory cannot hold the offload: the layer inputs alone need 800"):
        solve_plan(_problem(host_budget=799))


def test_checkpointing_wins_over_alpha_only_when_attention_is_cheap():
    # 2000 bytes: all memo at alpha 0.05, or one checkpointed layer buying alpha 0.0625 on the other seven
    costly, cheap = _problem(host_budget=2000), _problem(host_budget=2000, attention_seconds=0.0, qkv_seconds=0.0)
    assert solve_plan(costly)[0].count("checkpoint") == 0
    assert solve_plan(cheap)[0].count("checkpoint") > 0


def test_the_device_budget_keeps_the_last_layers():
    modes, alphas = solve_plan(_problem(device_budget=3 * 10**6 + 5))
    assert modes == ["memo"] * 7 + ["keep"] * 3
    assert alphas[-3:] == [1.0] * 3


def test_a_fixed_plan_solves_alpha_alone():
    plan = ["checkpoint", "memo", "keep", "memo"]
    modes, alphas = solve_plan(_problem(n_layers=4, layer_seconds=0.7), plan)
    assert modes == plan
    assert alphas == [0.0, pytest.approx(0.5), 1.0, 1.0]  # layer 3 keeps its buffer: nothing of it to send


def test_the_plan_pins_the_least_host_within_the_slack_of_the_fastest():
    # every plan of the solver's family at α on a 1/1000 grid: the least host whose seconds are within the slack
    p = _problem(layer_seconds=3.0, slack=0.01)
    fastest = plan_seconds(p, *solve_plan(_problem(layer_seconds=3.0)))
    allowed = fastest + 0.01 * 10 * (3.0 + 2.0)
    grid = [
        host_bytes(p, modes, alphas)
        for c in range(9)
        for a in (i / 1000 for i in range(1001))
        for modes in [["checkpoint"] * c + ["memo"] * (10 - c)]
        for alphas in [[0.0] * c + [a] * (8 - c) + [1.0, 1.0]]
        if plan_seconds(p, modes, alphas) <= allowed
    ]
    modes, alphas = solve_plan(p)
    assert plan_seconds(p, modes, alphas) <= allowed + 1e-9
    assert host_bytes(p, modes, alphas) <= min(grid) * 1.001
    assert host_bytes(p, modes, alphas) < 0.7 * host_bytes(p, *solve_plan(_problem(layer_seconds=3.0)))
    assert least_host(p) == 800  # eight checkpointed layers send their inputs alone
