"""Edges of the target's recommended sampling settings read as a request's defaults: a top_k
of the vocabulary's size is one a request may give, so the router starts with it; one more
fails the start, naming it (as the request would be refused)."""

import pytest

from deployments import generation_defaults


def test_a_recommended_top_k_of_the_vocabulary_size_is_taken_and_one_more_refused(
        monkeypatch):
    settings = {"top_k": 32}
    monkeypatch.setattr(generation_defaults, "recommended_sampling", lambda model: settings)
    assert generation_defaults.recommended_defaults("target", 32) == {"top_k": 32}
    with pytest.raises(ValueError, match=r"top_k: above the vocabulary size \(31\)"):
        generation_defaults.recommended_defaults("target", 31)
    settings.clear()  # no settings: OpenAI's defaults, nothing to check
    assert generation_defaults.recommended_defaults("target", 31) == {}
