"""The one exception type for bad user input (the CLI prints it on one line and exits 2), and
the one way an exception is turned into a line of text."""


# The CLI's exit codes besides 0 and 1 (a failure at run time): bad input, and Ctrl-C.
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class RecipeError(ValueError):
    """A recipe, override, dataset or model path that cannot be used, with the field named."""


def some_of(names: list[str], shown: int = 3) -> str:
    """The first `shown` names of a list for a one-line error, and how many more there are."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def first_line(err: BaseException) -> str:
    """The first non-empty line of an exception's message, or its type name when it has none:
    library errors often carry pages of context that would bury a one-line error."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def named_first_line(err: BaseException) -> str:
    """`first_line` after the exception's type ("RuntimeError: no C++ compiler found"), or the type
    alone when the message is empty."""
    message = first_line(err)
    return message if message == type(err).__name__ else f"{type(err).__name__}: {message}"


def user_frames(err: BaseException, package_dir: str) -> str:
    """Where user code raised `err`'s cause (a reward function's own error): its traceback's
    frames outside `package_dir` (lora_ppo) and the standard library's threading, formatted as
    Python does. Empty when there is no cause or no such frame."""
    import traceback

    cause = err.__cause__
    if cause is None or cause.__traceback__ is None:
        return ""
    frames = [f for f in traceback.extract_tb(cause.__traceback__)
              if not f.filename.startswith(package_dir) and not f.filename.endswith("threading.py")]
    if not frames:
        return ""
    lines = traceback.format_list(frames) + traceback.format_exception_only(type(cause), cause)
    return "".join(lines).rstrip("\n")
