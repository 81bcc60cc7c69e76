import pytest

from memo import ModelConfig
from memo.config import PRESETS


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
