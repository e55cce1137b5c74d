"""The quiz: expected values come from labkit and match the chapter; checks never raise."""
import math

import numpy as np
import pytest

from labkit import quiz

# The chapter's figures (or labkit's where the chapter rounds), each within its tolerance.
CHAPTER = {"ridge": 295, "intensity_gap": 2000, "crossover": 30_633, "long_prompt_ratio": 31,
           "score_matrix_gb": 28.8, "kv_kib_per_token": 128, "decode_slowdown": 5.3,
           "compute_bound_batch": 150, "logits_gib": 3.9, "chat_decode_pct": 95,
           "static_utilisation_pct": 100 * (2475 / 5) / 2000}


@pytest.mark.parametrize("name, value", CHAPTER.items())
def test_the_chapters_answer_is_right(name, value):
    assert "right" in quiz.check(name, value), quiz.check(name, value)


def test_the_stall_is_seconds_at_forty_percent_of_peak():
    assert 5.0 < quiz.QUESTIONS["stall_s"].expected() < 5.6  # chapter counting: 2NP + 4LP²d
    assert "right" in quiz.check_stall_s(5.3)


@pytest.mark.parametrize("name", quiz.QUESTIONS)
def test_every_question_has_a_check_function_and_a_working(name):
    check = getattr(quiz, f"check_{name}")
    assert "not answered yet" in check(None)
    expected = quiz.QUESTIONS[name].expected()
    assert "right" in check(expected) and "right" in check(np.float64(expected))
    assert "not yet" in check(expected * 10) and "Reconsider" in check(expected * 10)
    assert "too small" in check(expected / 10)
    working = quiz.show_answer(name)
    assert name in working and any(ch.isdigit() for ch in working)


@pytest.mark.parametrize("answer", ["295", [295], True, float("nan"), math.inf, {"a": 1}, object()])
def test_wrong_types_get_a_message_not_an_exception(answer):
    message = quiz.check_ridge(answer)
    assert message.startswith("ridge: expected")


def test_zero_negative_and_unknown():
    assert "wrong sign or is zero" in quiz.check_ridge(0)
    assert "wrong sign or is zero" in quiz.check_ridge(-295)
    assert "unknown question" in quiz.check("nope", 1) and "unknown question" in quiz.show_answer("nope")
