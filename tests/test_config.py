import dataclasses

import pytest

from memo import ModelConfig
from memo.config import PRESETS, model_config_from


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds_and_is_consistent(name):
    c = ModelConfig.preset(name)
    assert c.name == name
    assert c.hidden_size % c.n_heads == 0 and c.n_heads % c.n_kv_heads == 0


def test_paper_presets_match_the_paper_table():
    rows = {
        "gpt-7b": (32, 4096, 16384, 32),
        "gpt-13b": (40, 5120, 20480, 40),
        "gpt-30b": (48, 7168, 28672, 56),
        "gpt-65b": (80, 8192, 32768, 64),
    }
    for name, (n, h, f, a) in rows.items():
        c = ModelConfig.preset(name)
        assert (c.n_layers, c.hidden_size, c.ffn_hidden_size, c.n_heads, c.vocab_size, c.arch) == (
            n,
            h,
            f,
            a,
            50257,
            "gpt",
        )


def test_llama3_uses_grouped_query_attention():
    c = ModelConfig.preset("llama3-8b")
    assert (c.arch, c.n_kv_heads, c.vocab_size) == ("llama", 8, 128256)


def test_gpt_7b_parameter_count_is_about_seven_billion():
    assert 6.4e9 < ModelConfig.preset("gpt-7b").num_parameters() < 7.2e9


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"n_heads": 5}, "n_heads"),
        ({"n_kv_heads": 3}, "n_kv_heads"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"n_layers": -1}, "n_layers"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"ffn_hidden_size": 0}, "ffn_hidden_size"),
        ({"arch": "rnn"}, "arch"),
        ({"norm_eps": 0.0}, "norm_eps"),
    ],
)
def test_invalid_config_raises_value_error_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.preset("tiny", **overrides)


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ValueError, match="unknown model preset 'gpt-9b'.*tiny"):
        ModelConfig.preset("gpt-9b")


# ---- ModelConfig: one validator for presets, model files and Hugging Face config.json -------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"n_heads": "4"}, "`n_heads` must be a positive integer up to 16M, got '4'"),
        ({"hidden_size": True}, "`hidden_size` must be a positive integer up to 16M, got True"),
        ({"n_layers": 2.0}, "`n_layers` must be a positive integer up to 16M, got 2.0"),
        ({"vocab_size": 1 << 40}, "`vocab_size` must be a positive integer up to 16M"),
        ({"kv_channels": 15}, "the head dimension (`kv_channels`) must be even"),
        ({"norm_eps": float("inf")}, "`norm_eps` must be a finite number > 0, got inf"),
        ({"rope_theta": "1e4"}, "`rope_theta` must be a finite number > 0, got '1e4'"),
        ({"qkv_bias": "false"}, "`qkv_bias` must be true or false, got 'false'"),
        ({"sliding_window": 0}, "`sliding_window` must be a positive integer, got 0"),
        ({"rope_scaling": "yarn"}, "`rope_scaling` must be a mapping"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0, "scale": 1}}, "`rope_scaling`: "),
        (
            {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_positions": 64, "beta_fast": "32"}},
            "beta_fast",
        ),
    ],
)
def test_a_field_of_the_wrong_kind_or_range_is_a_value_error_naming_it(overrides, message):
    with pytest.raises(ValueError) as err:
        ModelConfig.preset("tiny", **overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_model_file_error_names_the_file_and_the_field_as_the_file_spells_it():
    tiny = dataclasses.asdict(ModelConfig.preset("tiny"))
    with pytest.raises(ValueError, match=r"^m.yaml: `n_heads` \(4\) must divide `hidden_size` \(66\)$"):
        model_config_from({**tiny, "hidden_size": 66}, "m.yaml")
    with pytest.raises(ValueError, match=r"^config.json: `num_attention_heads` must be a positive integer"):
        model_config_from({**tiny, "n_heads": 0}, "config.json", {"n_heads": "num_attention_heads"})
    with pytest.raises(ValueError, match=r"^m.yaml: unknown field\(s\) \['heads'\]$"):
        model_config_from({**tiny, "heads": 4}, "m.yaml")
    with pytest.raises(ValueError, match=r"^m.yaml: lacks required field\(s\) vocab_size$"):
        model_config_from({k: v for k, v in tiny.items() if k != "vocab_size"}, "m.yaml")
    assert model_config_from(tiny, "m.yaml") == ModelConfig.preset("tiny")
