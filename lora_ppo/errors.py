"""The one exception type for bad user input: the CLI prints it on one line and exits 2."""


class RecipeError(ValueError):
    """A recipe, override, dataset or model path that cannot be used, with the field named."""
