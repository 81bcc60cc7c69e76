import pytest

from memo import ActivationPolicy, ModelConfig, Transformer
from memo.policy import AlphaProblem, solve_alpha, split_row


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


def test_last_two_layers_stay_on_device_unless_asked():
    assert ActivationPolicy("memo", alpha=0.5).offloaded_layers(6) == [0, 1, 2, 3]
    assert ActivationPolicy("memo", alpha=0.5, offload_last_layers=True).offloaded_layers(6) == list(range(6))
    assert ActivationPolicy("none").offloaded_layers(6) == []


def test_split_row_floors_so_the_copy_never_exceeds_alpha():
    assert split_row(0.37, 37) == 13  # 13.69 tokens -> 13
    assert split_row(1.0, 37) == 37 and split_row(0.0, 37) == 0
    assert split_row(0.5, 10) == 5


def _problem(**kw):
    base = dict(
        input_bytes=100,
        attention_bytes=100,
        other_bytes=1000,
        bandwidth=1000.0,
        layer_seconds=1.0,
        host_budget=10**9,
        offloaded_layers=10,
    )
    base.update(kw)
    return AlphaProblem(**base)


def test_alpha_is_set_by_copy_time_when_bandwidth_binds():
    # (200 + a*1000) / 1000 <= 0.7  ->  a = 0.5
    p = _problem(layer_seconds=0.7)
    a = solve_alpha(p)
    assert a == pytest.approx(0.5)
    assert (p.input_bytes + p.attention_bytes + a * p.other_bytes) / p.bandwidth == pytest.approx(p.layer_seconds)


def test_alpha_is_set_by_host_memory_when_budget_binds():
    # 10 * (200 + a*1000) <= 4000 -> a = 0.2
    p = _problem(host_budget=4000)
    a = solve_alpha(p)
    assert a == pytest.approx(0.2)
    assert p.offloaded_layers * (200 + a * 1000) == pytest.approx(p.host_budget)


def test_alpha_is_one_when_neither_constraint_binds():
    assert solve_alpha(_problem(layer_seconds=100.0)) == 1.0


def test_alpha_is_zero_when_even_the_input_copy_is_not_hidden():
    assert solve_alpha(_problem(layer_seconds=0.1)) == 0.0


def test_host_budget_below_the_alpha_zero_need_is_an_error():
    with pytest.raises(ValueError, match="host memory cannot hold the offload"):
        solve_alpha(_problem(host_budget=1999))
    assert solve_alpha(_problem(host_budget=2000)) == 0.0
