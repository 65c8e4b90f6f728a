"""The environment protocol: what a multi-turn episode talks to.

An environment is a Python class (or any callable) named in the recipe as
`rollout.environment: my_env:Factory`. For each episode it is called with the dataset row's
columns as keyword arguments (`prompt`, then every other column, as reward functions get them;
a factory takes the ones it names, or all with `**kwargs`). Then:

- `reset()` returns the episode's first messages (a list of `{"role", "content"}` dicts), or
  None to start from the row's own prompt;
- `step(assistant_message)` gets the text the policy just wrote and returns an `Observation`
  (or a tuple `(messages, reward, done)`): the messages the policy reads next (as `user`, `tool`
  or `system` turns), an optional reward for that turn, and whether the episode is over.

Nothing else is needed. An environment runs in the training process, with the user's
permissions; an exception in it stops the run with one line naming it and the row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from lora_ppo.data import PromptRow
from lora_ppo.errors import RecipeError
from lora_ppo.rewards import USER_CODE, RewardError, import_function, required_by_name, signature_parameters

Messages = list[dict[str, Any]]
OBSERVATION_ROLES = ("user", "tool", "system")


@dataclass(frozen=True)
class Observation:
    """What an environment answers to one assistant message."""

    messages: Messages = field(default_factory=list)
    reward: Optional[float] = None  # this turn's reward, on the turn's last action token
    done: bool = False


class EpisodeError(RewardError):
    """An environment that raised or answered something unusable, named with the row it was on."""


def load_environment(spec: str) -> Callable[..., Any]:
    """The factory `module:Name` (or `path/file.py:Name`) names, as `rollout.environment`."""
    try:
        return import_function(spec)
    except RecipeError as err:
        raise RecipeError(str(err).replace("reward.function", "rollout.environment")) from None


def _row_arguments(factory: Callable[..., Any], row: PromptRow) -> dict[str, Any]:
    offered = {"prompt": row.prompt, **row.columns}
    params = signature_parameters(factory)
    if params is None or any(p.kind is p.VAR_KEYWORD for p in params):
        return offered
    return {p.name: offered[p.name] for p in params if p.name in offered}


def check_environment_columns(factory: Callable[..., Any], name: str, columns: list[str], source: str,
                              hint: str = "") -> None:
    """Refuse, before an episode starts (and where it can, before the weights load), prompts
    without a column the environment's factory requires by name: it failed at the first episode
    with Python's "missing 1 required positional argument"."""
    params = signature_parameters(factory)
    missing = [name for name in required_by_name(params or []) if name != "prompt" and name not in columns]
    if missing:
        raise RecipeError(f"rollout.environment: {name} takes the column {missing[0]!r}, which {source} does not have "
                          f"(columns besides the prompt: {', '.join(columns) or 'none'}){hint}")


def describe_row(row: PromptRow) -> str:
    text = row.prompt if isinstance(row.prompt, str) else (row.prompt[-1].get("content", "") if row.prompt else "")
    return repr(text if len(text) <= 60 else text[:57] + "...")


class EnvironmentSession:
    """One episode's environment, with every call checked: errors name the environment and the row."""

    def __init__(self, factory: Callable[..., Any], name: str, row: PromptRow, index: int):
        self.name, self.row, self.index = name, row, index
        self.env = self._call("creating it", lambda: factory(**_row_arguments(factory, row)))

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            with USER_CODE.running(f"environment {self.name}"):
                return fn()
        except Exception as err:
            raise EpisodeError(f"environment {self.name} raised {type(err).__name__} while {what} for row {self.index} "
                               f"(prompt {describe_row(self.row)}): {err}") from err

    def _fail(self, what: str) -> None:
        raise EpisodeError(f"environment {self.name}: {what} for row {self.index} (prompt {describe_row(self.row)})")

    def reset(self) -> Optional[Messages]:
        messages = self._call("resetting", self.env.reset) if hasattr(self.env, "reset") else None
        if messages is not None:
            self._check_messages(messages, "reset()")
        return messages

    def step(self, assistant_message: str) -> Observation:
        out = self._call("stepping", lambda: self.env.step(assistant_message))
        if isinstance(out, tuple) and len(out) == 3:
            out = Observation(list(out[0] or []), out[1], bool(out[2]))
        if not isinstance(out, Observation):
            self._fail(f"step() returned {type(out).__name__}, not an Observation or (messages, reward, done)")
        self._check_messages(out.messages, "step()")
        if out.reward is not None:
            # text is refused even where float() reads it, as reward functions' is; booleans too (a done
            # flag in the reward's place, most likely)
            try:
                reward = math.nan if isinstance(out.reward, (str, bytes, bool)) else float(out.reward)
            except (TypeError, ValueError):
                reward = math.nan
            if not math.isfinite(reward):
                self._fail(f"step() returned the reward {out.reward!r}, not a finite number")
        return out

    def _check_messages(self, messages: Any, where: str) -> None:
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            self._fail(f"{where} must return a list of {{'role', 'content'}} messages, got {messages!r:.80}")
