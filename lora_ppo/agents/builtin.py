"""Environments that ship with lora_ppo, for the offline multi-turn task (`recipes/agent.yaml`)."""

from __future__ import annotations

from lora_ppo.agents.environment import Observation
from lora_ppo.verifiable import answers_match

RETRY_MESSAGE = "That is not right, try again."


class RetryArithmetic:
    """An arithmetic question (`builtin:arithmetic`) with a second chance: a wrong answer gets
    "That is not right, try again." and another turn, up to `attempts` answers. The reward, 1 for
    the right answer at any attempt and 0 otherwise, arrives on the turn that ends the episode."""

    def __init__(self, answer: str, attempts: int = 2):
        self.answer, self.attempts, self.answered = answer, attempts, 0

    def reset(self) -> None:
        return None  # the row's own prompt (and the recipe's system prompt) opens the episode

    def step(self, assistant_message: str) -> Observation:
        self.answered += 1
        if answers_match(assistant_message, self.answer):
            return Observation(reward=1.0, done=True)
        if self.answered >= self.attempts:
            return Observation(reward=0.0, done=True)
        return Observation([{"role": "user", "content": RETRY_MESSAGE}])
