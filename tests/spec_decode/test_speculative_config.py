"""`--speculative-config` as vLLM reads it: keys, defaults, and what is refused."""

from __future__ import annotations

import pytest

from services.common.speculative_config import SpeculativeConfig, parse_speculative_config


@pytest.mark.parametrize("text,expected", [
    ('{"method": "ngram", "num_speculative_tokens": 4}', SpeculativeConfig("ngram", 4, 5, 5)),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}',
     SpeculativeConfig("ngram", 2, 3, 3)),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2, '
     '"prompt_lookup_max": 4}', SpeculativeConfig("ngram", 2, 2, 4)),
    ('{"method": "suffix"}', SpeculativeConfig("suffix", 24)),
    ('{"method": "suffix", "suffix_decoding_max_tree_depth": 8, '
     '"suffix_decoding_min_token_prob": 0.2}',
     SpeculativeConfig("suffix", 8, suffix_decoding_max_tree_depth=8,
                       suffix_decoding_min_token_prob=0.2)),
    ('{"method": "draft_model", "model": "/models/small", "num_speculative_tokens": 3}',
     SpeculativeConfig("draft_model", 3, model="/models/small")),
    ('{"model": "smollm2", "num_speculative_tokens": 2}',   # a model and no method: a draft
     SpeculativeConfig("draft_model", 2, model="smollm2")),
    ('{"method": "eagle3", "model": "/heads/eagle3", "num_speculative_tokens": 3}',
     SpeculativeConfig("eagle3", 3, model="/heads/eagle3")),
    ('{"method": "mtp", "num_speculative_tokens": 2}', SpeculativeConfig("mtp", 2)),
    ("", None),
])
def test_the_flag_parses_as_vllm_reads_it(text: str, expected: SpeculativeConfig | None) -> None:
    assert parse_speculative_config(text) == expected


@pytest.mark.parametrize("text", [
    "ngram", '{"method": "eagle", "num_speculative_tokens": 2}', '{"method": "ngram"}',
    '{"method": "ngram", "num_speculative_tokens": 0}',
    '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
    '"prompt_lookup_max": 2}',
    '{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}',
    '{"num_speculative_tokens": 2}', '{"method": "suffix", "num_speculative_tokens": "3"}',
    '{"method": "suffix", "suffix_decoding_min_token_prob": 2}',
    '{"method": "draft_model", "num_speculative_tokens": 2}',
    '{"method": "draft_model", "model": "/models/small"}',
    '{"model": 3, "num_speculative_tokens": 2}',
    '{"method": "draft_model", "model": "", "num_speculative_tokens": 2}',
    '{"method": "eagle3", "num_speculative_tokens": 2}',
    '{"method": "eagle3", "model": "/heads/eagle3"}',
    '{"method": "mtp"}', '{"method": "mtp", "model": "/models/mimo", "num_speculative_tokens": 2}',
])
def test_bad_flags_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_speculative_config(text)



@pytest.mark.parametrize("text,error", [
    ('{"method": "eagle3", "num_speculative_tokens": 2}', "eagle3 needs `model`"),
    ('{"method": "eagle3", "model": "/heads/eagle3"}', "eagle3 needs num_speculative_tokens"),
    ('{"method": "eagle", "model": "/heads/eagle3", "num_speculative_tokens": 2}',
     "method must be one of ngram, suffix, draft_model, eagle3, mtp"),
    ('{"method": "mtp"}', "mtp needs num_speculative_tokens"),
])
def test_a_flag_missing_a_key_says_which(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_speculative_config(text)
