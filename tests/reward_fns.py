"""Reward functions named in test recipes as `tests.reward_fns:<name>`."""


def count_letter_e(prompts, completions):
    """A cheap, learnable reward: how many 'e' characters the completion has."""
    return [float(c.count("e")) for c in completions]


def wrong_count(prompts, completions):
    return [1.0]


def raises(prompts, completions):
    raise RuntimeError("reward server is down")


# TRL-style functions: keywords, dataset columns as keyword arguments.
SEEN: list[dict] = []


def records_columns(prompts, completions, completion_ids, key, label, **kwargs):
    """Records what it was given; the score is the key column, so tests can also check order."""
    SEEN.append({"prompts": list(prompts), "completions": list(completions), "ids": list(completion_ids),
                 "key": list(key), "label": list(label), "extra": sorted(kwargs)})
    return [float(k) for k in key]


def needs_solution(prompts, completions, solution):
    return [0.0] * len(completions)


def trl_style(completions, **kwargs):
    """As TRL's own reward functions are written: completions, and everything else in kwargs."""
    return [float(len(c[0]["content"] if isinstance(c, list) else c)) for c in completions]


def hangs(prompts, completions):
    """Never returns: waits on an event nobody sets (reward.timeout_s must end the run)."""
    import threading

    threading.Event().wait()


def numeric_strings(prompts, completions):
    return ["0.5" for _ in completions]


def one_string(prompts, completions):
    return "1" * len(completions)


MESSAGES_SEEN: list = []


def records_messages(completions, messages, **kwargs):
    """Records the episodes it was given (`messages`); scores 0."""
    MESSAGES_SEEN.append(messages)
    return [0.0] * len(completions)
