"""Reward functions named in test recipes as `tests.reward_fns:<name>`."""


def count_letter_e(prompts, completions):
    """A cheap, learnable reward: how many 'e' characters the completion has."""
    return [float(c.count("e")) for c in completions]


def wrong_count(prompts, completions):
    return [1.0]


def raises(prompts, completions):
    raise RuntimeError("reward server is down")
