"""The environment protocol, checked call by call (lora_ppo.agents.environment): which row
columns a factory gets, what `reset()` and `step()` may return, and the one line that names the
environment, the row and what was wrong when they return something else. No model is loaded."""

from __future__ import annotations

import math

import pytest
import torch

from lora_ppo.agents.environment import EnvironmentSession, EpisodeError, Observation, load_environment
from lora_ppo.data import PromptRow
from lora_ppo.errors import RecipeError

NAME = "my_env:Game"
ROW = PromptRow("What is 2 plus 3?", "", (1, 2), {"target": "5", "level": 2})


def session(env, row: PromptRow = ROW, index: int = 3) -> EnvironmentSession:
    return EnvironmentSession(lambda **columns: env, NAME, row, index)


class Answers:
    """An environment whose step() returns what it was given; reset() returns `first`."""

    def __init__(self, answer=None, first=None):
        self.answer, self.first = answer, first

    def reset(self):
        return self.first

    def step(self, message):
        return self.answer


# ---- the row's columns reach the factory -------------------------------------------------------


def test_a_factory_gets_the_columns_it_names_and_one_with_kwargs_gets_them_all():
    got = {}

    def named(prompt, target):
        got["named"] = (prompt, target)
        return Answers()

    def everything(**columns):
        got["everything"] = columns
        return Answers()

    EnvironmentSession(named, NAME, ROW, 0)
    EnvironmentSession(everything, NAME, ROW, 0)
    assert got["named"] == ("What is 2 plus 3?", "5")
    assert got["everything"] == {"prompt": "What is 2 plus 3?", "target": "5", "level": 2}


def test_a_factory_whose_signature_cannot_be_read_gets_every_column():
    """Builtins such as dict have no signature Python can read: they get everything offered."""
    created = EnvironmentSession(dict, NAME, ROW, 0).env
    assert created == {"prompt": "What is 2 plus 3?", "target": "5", "level": 2}


def test_a_class_factory_gets_the_columns_its_init_names():
    class Game:
        def __init__(self, target, level=0):
            self.target, self.level = target, level

    env = EnvironmentSession(Game, NAME, ROW, 0).env
    assert (env.target, env.level) == ("5", 2)


def test_prompts_without_a_column_the_factory_requires_are_refused_naming_it():
    """Checked before an episode starts: the first episode failed with Python's "missing 1
    required positional argument"."""
    from lora_ppo.agents.environment import check_environment_columns

    class Game:
        def __init__(self, prompt, target, level=0, *, seed, **rest):
            pass

    check_environment_columns(Game, NAME, ["target", "seed"], "'p.jsonl'")  # optional ones may be absent
    with pytest.raises(RecipeError) as err:
        check_environment_columns(Game, NAME, ["level", "seed"], "'p.jsonl'", "; a hint")
    assert str(err.value) == ("rollout.environment: my_env:Game takes the column 'target', which 'p.jsonl' does not "
                              "have (columns besides the prompt: level, seed); a hint")
    with pytest.raises(RecipeError, match="takes the column 'seed', .* \\(columns besides the prompt: none\\)"):
        check_environment_columns(lambda prompt, *, seed: None, NAME, [], "x")
    check_environment_columns(lambda **columns: None, NAME, [], "x")  # takes whatever there is
    check_environment_columns(dict, NAME, [], "x")  # no signature to read: as EnvironmentSession, everything


# ---- what reset() and step() may return ----------------------------------------------------------


def test_reset_is_optional_and_its_messages_are_returned_as_given():
    class NoReset:
        def step(self, message):
            return Observation(done=True)

    assert session(NoReset()).reset() is None
    assert session(Answers(first=None)).reset() is None
    first = [{"role": "system", "content": "Play."}, {"role": "user", "content": "Go."}]
    assert session(Answers(first=first)).reset() == first


@pytest.mark.parametrize("answer, observation", [
    (Observation([{"role": "user", "content": "higher"}], 0.5, False),
     Observation([{"role": "user", "content": "higher"}], 0.5, False)),
    (([{"role": "user", "content": "lower"}], None, 0), Observation([{"role": "user", "content": "lower"}], None, False)),
    ((None, 1.0, "yes"), Observation([], 1.0, True)),  # no messages; done as any truthy value
    (Observation(reward=torch.tensor(0.25)), Observation(reward=torch.tensor(0.25))),  # a 0-d tensor is a number
])
def test_step_returns_an_observation_or_a_tuple_of_three(answer, observation):
    got = session(Answers(answer)).step("5")
    assert (got.messages, got.done) == (observation.messages, observation.done)
    assert got.reward == observation.reward or (got.reward is None and observation.reward is None)


@pytest.mark.parametrize("answer, what", [
    ("done", "step() returned str, not an Observation or (messages, reward, done)"),
    (([], 1.0), "step() returned tuple, not an Observation or (messages, reward, done)"),
    (([], 1.0, True, {}), "step() returned tuple, not an Observation or (messages, reward, done)"),
    (None, "step() returned NoneType, not an Observation or (messages, reward, done)"),
    (Observation(reward=math.nan), "step() returned the reward nan, not a finite number"),
    (Observation(reward=math.inf), "step() returned the reward inf, not a finite number"),
    (Observation(reward="high"), "step() returned the reward 'high', not a finite number"),
    (Observation(reward="0.5"), "step() returned the reward '0.5', not a finite number"),  # text, as from rewards
    (Observation(reward=True), "step() returned the reward True, not a finite number"),
    (Observation(reward=[1.0]), "step() returned the reward [1.0], not a finite number"),
    (Observation({"role": "user", "content": "hi"}),
     "step() must return a list of {'role', 'content'} messages, got {'role': 'user', 'content': 'hi'}"),
    (Observation([{"content": "no role"}]),
     "step() must return a list of {'role', 'content'} messages, got [{'content': 'no role'}]"),
    (Observation(["hi"]), "step() must return a list of {'role', 'content'} messages, got ['hi']"),
])
def test_an_unusable_step_answer_is_one_line_naming_the_environment_and_the_row(answer, what):
    with pytest.raises(EpisodeError) as caught:
        session(Answers(answer)).step("5")
    assert str(caught.value) == f"environment {NAME}: {what} for row 3 (prompt 'What is 2 plus 3?')"


def test_long_messages_are_quoted_to_80_characters():
    messages = "x" * 200
    with pytest.raises(EpisodeError) as caught:
        session(Answers(first=messages)).reset()
    assert str(caught.value) == (f"environment {NAME}: reset() must return a list of {{'role', 'content'}} messages, "
                                 f"got {repr(messages)[:80]} for row 3 (prompt 'What is 2 plus 3?')")


@pytest.mark.parametrize("prompt, shown", [
    ("x" * 60, "'" + "x" * 60 + "'"),  # 60 characters: whole
    ("x" * 61, "'" + "x" * 57 + "...'"),  # longer: 57 and an ellipsis
    ([{"role": "system", "content": "Play."}, {"role": "user", "content": "Guess a number."}], "'Guess a number.'"),
    ([{"role": "user"}], "''"),
    ([], "''"),
])
def test_errors_show_the_rows_prompt_or_its_last_message_cut_to_60_characters(prompt, shown):
    with pytest.raises(EpisodeError, match=r"^environment my_env:Game: step\(\) returned int, .* for row 7 "
                                           rf"\(prompt {shown}\)$"):
        session(Answers(1), PromptRow(prompt, "", (1,)), index=7).step("5")


@pytest.mark.parametrize("broken, what", [
    ("init", "creating it"), ("reset", "resetting"), ("step", "stepping"),
])
def test_an_environment_that_raises_is_one_line_naming_what_it_was_doing(broken, what):
    class Broken:
        def __init__(self, **columns):
            if broken == "init":
                raise KeyError("target")

        def reset(self):
            if broken == "reset":
                raise ValueError("no board")

        def step(self, message):
            raise RuntimeError("server down")

    reason = {"init": "KeyError while creating it", "reset": "ValueError while resetting",
              "step": "RuntimeError while stepping"}[broken]
    with pytest.raises(EpisodeError) as caught:
        created = EnvironmentSession(Broken, NAME, ROW, 3)
        created.reset()
        created.step("5")
    assert str(caught.value).startswith(f"environment {NAME} raised {reason} for row 3 (prompt 'What is 2 plus 3?'): ")
    assert what in str(caught.value) and caught.value.__cause__ is not None


def test_an_environment_that_cannot_be_imported_names_rollout_environment():
    with pytest.raises(RecipeError, match=r"^rollout.environment: cannot import module 'no_such_module_here'"):
        load_environment("no_such_module_here:Game")
    with pytest.raises(RecipeError, match=r"^rollout.environment: 'tests.agent_envs' has no callable named 'Nothing'$"):
        load_environment("tests.agent_envs:Nothing")
    assert load_environment("tests.agent_envs:Again").__name__ == "Again"
