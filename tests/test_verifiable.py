"""Final-answer extraction and comparison on hand-written cases, including answers that must not
match: a longer number that contains the right digits, and a right number that is not the final one."""

from __future__ import annotations

from fractions import Fraction

import pytest

from lora_ppo.verifiable import answers_match, final_answer, last_boxed, states_answer_in_format, to_number


@pytest.mark.parametrize("text, expected", [
    ("Natalia sold 48 clips in April and 24 in May.\n#### 72", "72"),
    ("First 12, then 30.\n####  1,000 ", "1,000"),
    ("#### 5\nLater text ####  6", "6"),  # the last #### line wins
    ("So the answer is \\boxed{42}.", "42"),
    ("Try \\boxed{1} first, then \\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
    ("It costs 3 dollars, so 5 cost 15 dollars.", "15"),
    ("The result is -7.", "-7"),
    ("47 - 38 = 9", "9"),
    ("I get 1,250.5 in total", "1,250.5"),
    ("no digits here", None),
])
def test_final_answer(text, expected):
    assert final_answer(text) == expected


@pytest.mark.parametrize("answer, number", [
    ("1,000", Fraction(1000)), ("1000.0", Fraction(1000)), ("-3/4", Fraction(-3, 4)), ("\\frac{3}{4}", Fraction(3, 4)),
    ("$42.", Fraction(42)), ("42%", Fraction(42)), ("0.5", Fraction(1, 2)), ("  7 ", Fraction(7)),
    ("seven", None), ("3/0", None), ("1,00", None),
])
def test_to_number(answer, number):
    assert to_number(answer) == number


@pytest.mark.parametrize("response, reference", [
    ("The answer is 72.", "72"),
    ("#### 1,000", "1000"),
    ("So we get 1000.0", "1,000"),
    ("The answer is \\boxed{-3/4}", "-0.75"),
    ("She has 5 apples.", "Natalia has 2 + 3 = 5 apples.\n#### 5"),  # a GSM8K worked solution
    ("#### Paris", "paris"),  # not numbers: compared as text, case ignored
])
def test_answers_that_match(response, reference):
    assert answers_match(response, reference)


@pytest.mark.parametrize("response, reference", [
    ("The answer is 420.", "42"),  # the right digits inside a longer number
    ("The answer is 4.2", "42"),
    ("42 is close, but the total is 43.", "42"),  # the right number, but not the final one
    ("#### 42\nActually #### 41", "42"),
    ("I don't know.", "42"),
    ("The answer is -42", "42"),
    ("", "#### 7"),
])
def test_answers_that_must_not_match(response, reference):
    assert not answers_match(response, reference)


def test_boxed_with_nested_braces_and_format_marks():
    assert last_boxed("x = \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{unclosed") is None
    assert states_answer_in_format("so #### 12") and states_answer_in_format("\\boxed{3}")
    assert not states_answer_in_format("the answer is 12")


# ---- answer forms: LaTeX fractions, numbers glued to text, signs, which answer is final ---------


@pytest.mark.parametrize("response, reference", [
    ("So the answer is \\boxed{\\dfrac{1}{2}}", "0.5"),
    ("#### \\tfrac{3}{4}", "0.75"),
    ("\\boxed{\\frac{-1}{2}}", "-0.5"),
    ("x=42", "42"),  # glued to '=': still a number
    ("It costs$1,000", "1000"),  # glued to '$'
    ("It costs$1,000.", "1,000"),
    ("#### $1,000", "1000"),
    ("\\boxed{1,000}", "1000.0"),
    ("The temperature fell to -12 degrees.", "-12"),
    ("x = -0.5", "-1/2"),
    ("#### -1,234.5", "-1234.5"),
    ("It went up by 12.5%", "12.5"),
])
def test_answer_forms_that_match(response, reference):
    assert answers_match(response, reference)


@pytest.mark.parametrize("text, expected", [
    ("x=42", "42"),
    ("I ate 42apples", None),  # digits glued to letters are not a separate number
    ("42apples and 7 pears", "7"),
    ("the 42nd time", None),
    ("It costs$1,000", "1,000"),
    ("5-3=2", "2"),  # '-3' glued to a digit is a minus, not a sign
    ("Step 1: 3 apples. Step 2: 4 apples.", "4"),  # the last number wins...
    ("#### 72\nI also counted 5 ducks.", "72"),  # ...unless a #### line states the answer
    ("\\boxed{7} because 3 + 4 = 7, not 9", "7"),  # ...or a \boxed{} does
    ("#### 1\n\\boxed{2}", "1"),  # #### before \boxed
    ("(42)", "42"),
    ("[-7]", "-7"),
])
def test_final_answer_forms(text, expected):
    assert final_answer(text) == expected


@pytest.mark.parametrize("answer, number", [
    ("\\dfrac{1}{2}", Fraction(1, 2)), ("\\tfrac{3}{4}", Fraction(3, 4)), ("1,000,000", Fraction(10**6)),
    ("-1,234.5", Fraction(-2469, 2)), ("$1,000", Fraction(1000)), ("12.5\\%", Fraction(25, 2)),
])
def test_to_number_more_forms(answer, number):
    assert to_number(answer) == number


@pytest.mark.parametrize("response, reference", [
    ("I ate 42apples", "42"),
    ("The answer is 12", "-12"),
    ("The answer is -12", "12"),
    ("It costs $1,000", "100"),
    ("It costs $1,0000", "1000"),
    # digits after a comma or a point are part of the number before them, never one of their own
    ("The answer is 1,2345", "2345"),
    ("It costs .5 dollars", "5"),
    ("Version 3.14.15 of it", "15"),
    ("The answer is 12,34", "34"),
])
def test_answer_forms_that_must_not_match(response, reference):
    assert not answers_match(response, reference)


def test_a_bare_latex_fraction_is_the_last_number():
    # The module normalises `\frac{a}{b}` as a number, so a response ending in one states that number.
    assert answers_match("Dividing both sides, x = \\frac{1}{2}", "0.5")
    assert not answers_match("Dividing both sides, x = \\frac{1}{2}", "2")


@pytest.mark.parametrize("answer, number", [
    ("-\\frac{3}{4}", Fraction(-3, 4)), ("\\frac{3}{1}", Fraction(3)), ("\\frac{3}{0}", None),
    ("\\frac{1,2}{3}", None), ("\\frac{3}{x}", None),
])
def test_latex_fractions_signs_and_bad_parts(answer, number):
    assert to_number(answer) == number


def test_an_answer_that_is_a_number_on_one_side_only_is_compared_as_text():
    # A tab inside "1\t000" keeps it from parsing as a number; as text (runs of white space
    # ignored) it is still "1 000".
    assert answers_match("#### 1\t000", "1 000")
