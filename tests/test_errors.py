"""The one way an exception becomes a line of text (errors.py): a list cut to its first names and
a count, an exception's first line (or its type), and the user's own frames of a reward's error."""

from __future__ import annotations

import pytest

from lora_ppo.errors import first_line, named_first_line, some_of, user_frames


@pytest.mark.parametrize("names, shown, expected", [
    (["a", "b", "c"], 3, "a, b, c"),
    (["a", "b", "c", "d", "e"], 3, "a, b, c and 2 more"),
    (["a", "b"], 1, "a and 1 more"),
    ([], 3, ""),
])
def test_some_of_names_the_first_and_counts_the_rest(names, shown, expected):
    assert some_of(names, shown) == expected


def test_three_names_by_default_and_the_documented_exit_codes():
    from lora_ppo.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED

    assert some_of(["a", "b", "c", "d"]) == "a, b, c and 1 more"
    # README: bad input exits 2; docs/resume.md: Ctrl-C exits 130 (128 + SIGINT, as shells report it).
    assert (EXIT_BAD_INPUT, EXIT_INTERRUPTED) == (2, 130)


def test_the_first_non_empty_line_or_the_type_name():
    assert first_line(ValueError("\n  shape mismatch\nat layer 3\n")) == "shape mismatch"
    assert first_line(KeyError()) == "KeyError"
    assert first_line(RuntimeError("   ")) == "RuntimeError"
    assert named_first_line(RuntimeError("no C++ compiler\nfound in PATH")) == "RuntimeError: no C++ compiler"
    assert named_first_line(OSError()) == "OSError"


def _raise_in_user_code():
    raise ZeroDivisionError("division by zero in my reward")


def test_user_frames_are_the_causes_frames_outside_the_package(tmp_path):
    """A reward function's own error: its frames (this test file's, as a user's file) and its type
    and message, never the package's frames that wrapped it."""
    try:
        try:
            _raise_in_user_code()
        except ZeroDivisionError as cause:
            raise RuntimeError("reward function raised") from cause
    except RuntimeError as err:
        wrapped = err
    frames = user_frames(wrapped, str(tmp_path))  # the "package" is elsewhere: every frame is the user's
    assert frames.splitlines()[-1] == "ZeroDivisionError: division by zero in my reward"
    assert "in _raise_in_user_code" in frames and 'raise ZeroDivisionError("division by zero in my reward")' in frames
    assert not frames.endswith("\n")
    # This file standing for the package: no frame is left, so nothing is shown.
    assert user_frames(wrapped, __file__) == ""
    assert user_frames(RuntimeError("no cause"), str(tmp_path)) == ""
