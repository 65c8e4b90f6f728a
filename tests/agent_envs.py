"""Environments named in test recipes as `tests.agent_envs:<Name>`."""

from lora_ppo.agents.environment import Observation

CREATED: list[str] = []  # prompts of the episodes created in this process, in order


class OneTurn:
    """Ends the episode after the policy's first turn, with no reward of its own."""

    def __init__(self, prompt):
        CREATED.append(prompt)

    def reset(self):
        return None

    def step(self, message):
        return Observation(done=True)


class Again:
    """Answers every turn with "again" and a reward of 0.5, for `turns` turns."""

    def __init__(self, turns: int = 3, **columns):
        self.turns, self.seen = turns, 0

    def step(self, message):
        self.seen += 1
        return Observation([{"role": "user", "content": "again"}], reward=0.5, done=self.seen >= self.turns)


class Endless:
    """Never ends an episode: only the limits do."""

    def __init__(self, **columns):
        pass

    def step(self, message):
        return [{"role": "user", "content": "go on, say more about it"}], None, False


class NeedsAnswer:
    """Takes the row's `answer` column, which it requires (no default, no **columns)."""

    def __init__(self, prompt, answer):
        self.answer = answer

    def step(self, message):
        return Observation(reward=float(self.answer in message), done=True)


class BreaksAtEpisode5:
    """Raises in step() from the fifth episode this process creates (the second step of a batch of 4)."""

    def __init__(self, prompt):
        CREATED.append(prompt)
        self.number = len(CREATED)

    def step(self, message):
        if self.number >= 5:
            raise ValueError("the game server is down")
        return Observation(done=True)


def add(a: int, b: int) -> int:
    """Add two numbers (a tool named in test recipes as `tests.agent_envs:add`).

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b
