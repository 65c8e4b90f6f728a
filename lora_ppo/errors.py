"""The one exception type for bad user input (the CLI prints it on one line and exits 2), and
the one way an exception is turned into a line of text."""


# The CLI's exit codes besides 0 and 1 (a failure at run time): bad input, and Ctrl-C.
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class RecipeError(ValueError):
    """A recipe, override, dataset or model path that cannot be used, with the field named."""


def first_line(err: BaseException) -> str:
    """The first non-empty line of an exception's message, or its type name when it has none:
    library errors often carry pages of context that would bury a one-line error."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
