"""The pipeline's builtin sets: builtin:arithmetic's questions as demonstrations and as preference
pairs, with the same splits (no test question is trained on) and answers that are right (chosen)
or wrong in the same format (rejected)."""

from __future__ import annotations

import re

from lora_ppo.data import load_rows


def _worked(text: str) -> tuple[int, str, int, int, int]:
    """(a, op, b, worked result, #### result) of `a op b = r` then `#### r`."""
    a, op, b, result, final = re.fullmatch(r"(\d+) ([+-]) (\d+) = (-?\d+)\n#### (-?\d+)", text).groups()
    return int(a), op, int(b), int(result), int(final)


def _true(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def test_demonstrations_are_the_arithmetic_questions_with_their_worked_answers():
    for split in ("train", "test"):
        questions, _ = load_rows("builtin:arithmetic", split, name="addsub12")
        rows, columns = load_rows("builtin:arithmetic_sft", split, name="addsub12")
        assert columns == ["messages", "answer"] and len(rows) == len(questions)
        for question, row in zip(questions, rows):
            user, assistant = row["messages"]
            assert (user["role"], user["content"], assistant["role"]) == ("user", question["prompt"], "assistant")
            a, op, b, result, final = _worked(assistant["content"])
            assert result == final == _true(a, op, b) == int(question["answer"]) == int(row["answer"])


def test_preference_pairs_hold_the_right_marked_answer_against_a_wrong_or_an_unmarked_one():
    train, _ = load_rows("builtin:arithmetic_preferences", "train", name="addsub12")
    test, columns = load_rows("builtin:arithmetic_preferences", "test", name="addsub12")
    questions, _ = load_rows("builtin:arithmetic", "train", name="addsub12")
    assert columns == ["prompt", "chosen", "rejected", "answer"] and len(train) == 2 * len(questions)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    for wrong_row, unmarked_row in zip(train[::2] + test[::2], train[1::2] + test[1::2]):
        assert wrong_row["prompt"] == unmarked_row["prompt"] and wrong_row["chosen"] == unmarked_row["chosen"]
        a, op, b, right, right_final = _worked(wrong_row["chosen"])
        assert right == right_final == _true(a, op, b) == int(wrong_row["answer"])
        a2, op2, b2, wrong, wrong_final = _worked(wrong_row["rejected"])
        assert (a, op, b) == (a2, op2, b2) and wrong == wrong_final != right and wrong >= 0
        assert unmarked_row["rejected"] == f"{a} {op} {b} is {right}."
    assert load_rows("builtin:arithmetic_preferences", "test", name="addsub12")[0] == test  # seeded
