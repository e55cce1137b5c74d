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


def test_an_answer_counted_the_kernels_way_is_told_apart_from_a_wrong_one():
    from labkit import roofline as r
    kernel_crossover = r.crossover_tokens(quiz._setting()[0], r.KERNEL)
    line = quiz.check_crossover(kernel_crossover)
    assert line.startswith("crossover: counted differently") and "30,633" in line and "not yet" not in line
    assert quiz.check_long_prompt_ratio(24.9).startswith("long_prompt_ratio: counted differently")
    assert quiz.check_crossover(1000).startswith("crossover: not yet")


def test_the_stall_question_accepts_either_count_and_says_which():
    assert quiz.check_stall_s(3.4).startswith("stall_s: right, counting what the kernels execute")
    assert quiz.check_stall_s(5.34).startswith("stall_s: right —")
    assert "5.34 s counting as the chapter does" in quiz.show_answer("stall_s")


def test_large_answers_are_written_without_an_exponent():
    assert "e+" not in quiz.check_crossover(53_247) and "53,247" in quiz.check_crossover(53_247)
    absurd = quiz.check_ridge(1e300)  # ... short of an absurd one, whose 301 digits filled the cell
    assert "1e+300 FLOP/byte" in absurd and len(absurd) < 300


@pytest.mark.parametrize("name", list(quiz.CHOICES))
def test_each_judgement_question_has_a_computed_answer_among_its_options(name):
    choice = quiz.CHOICES[name]
    assert choice.answer() in choice.options
    assert quiz.check_choice(name, choice.answer()).startswith(f"{name}: right")
    for wrong in (o for o in choice.options if o != choice.answer()):
        assert quiz.check_choice(name, wrong).startswith(f"{name}: not this one")
    assert "not answered yet" in quiz.check_choice(name, None)
    assert "not one of the options" in quiz.check_choice(name, "something else")
    assert choice.answer() in quiz.show_choice_answer(name)


def test_the_judgement_answers_follow_the_formulas():
    assert quiz.CHOICES["regime_long_chat"].answer() == "mixed"  # 52 % of the read
    assert quiz.CHOICES["lever_loaded_batch"].answer() == "an fp8 KV cache"  # 81 %
    assert quiz.CHOICES["phase_prompt"].answer() == "arithmetic (compute-bound)"
    assert quiz.CHOICES["chunk_size"].answer() == "2,048 tokens"
    assert quiz.check_choice("nonsense", 1).startswith("unknown question")


def test_lesson_04s_streamed_weights_count_is_told_apart_in_the_cache_read_question():
    """Lesson 04 offers two counts of the weights a step reads (all 16.06 GB, or the 15.01 GB a step
    streams): an answer from the second was 'not yet', 1.057x off, with a hint that did not say why."""
    feedback = quiz.check("decode_slowdown", 5.58)
    assert "counted differently" in feedback and "streams" in feedback
    assert quiz.check("decode_slowdown", 5.28).startswith("decode_slowdown: right")


def test_questions_ask_for_the_unit_they_check():
    """'How many bytes ...' with a KiB check sent the literal answer, 131,072, to 'not yet'."""
    for name, question in quiz.QUESTIONS.items():
        for unit in ("bytes", "GB", "GiB", "KiB"):
            if unit != question.unit and f"the {unit} " in question.ask:
                pytest.fail(f"{name} asks for {unit} but checks {question.unit}: {question.ask}")


def test_a_judgement_pick_is_read_whatever_its_case_and_spacing():
    """'Mixed' was 'not one of the options' where 'mixed' is."""
    name = next(iter(quiz.CHOICES))
    right = quiz.CHOICES[name].answer()
    assert quiz.check_choice(name, f"  {right.upper()} ").startswith(f"{name}: right — {right}:")
    assert "is not one of the options" in quiz.check_choice(name, "something else")
