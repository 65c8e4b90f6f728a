"""Multi-turn episodes (lora_ppo.agents): a one-turn episode is today's step, observation tokens
are never actions, the limits truncate and count, an environment that raises stops the run in one
line, `step()` on a train() rollout's tokens takes the same update, and resume is exact."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import yaml
from transformers import AutoConfig
from typer.testing import CliRunner

import lora_ppo
from lora_ppo.cli import app
from lora_ppo.config import recipe_from_dict
from lora_ppo.ppo_math import gae, kl_shaped_rewards
from lora_ppo.roles import POLICY, VALUE
from tests import agent_envs, reward_fns
from tests.conftest import TIMING_PREFIXES, adapter_tensors, tiny_recipe_dict

EPISODES = {"chat_template": True}


def trainer(tmp_path, tiny_model_dir, rollout=None, name="run", **sections):
    sections = {"data": EPISODES, "train": {"eval": False, "steps": 2, "save_every": 0}, **sections}
    recipe = tiny_recipe_dict(tiny_model_dir, tmp_path / name, **sections)
    recipe["rollout"].update(rollout or {})
    return lora_ppo.PPOTrainer(recipe_from_dict(recipe), progress=False)


def trained_tensors(t) -> list[torch.Tensor]:
    return [p.detach().clone() for p in t.roles.policy_parameters() + t.roles.value_parameters()]


# ---- the math: observation tokens are skipped, never actions ----------------------------------


def test_gae_over_an_episode_equals_gae_over_its_actions_alone():
    """Columns that are not actions (observations) are skipped: the advantages of the action
    tokens are those of the same episode with the observation columns removed."""
    g = torch.Generator().manual_seed(0)
    values, rewards = torch.randn(2, 7, generator=g, dtype=torch.float64), torch.randn(2, 7, generator=g,
                                                                                      dtype=torch.float64)
    actions = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 1, 0, 0, 1, 1]], dtype=torch.bool)
    advantages, returns = gae(values, rewards, actions, gamma=0.9, lam=0.8)
    for i in range(2):
        kept = actions[i]
        alone_adv, alone_ret = gae(values[i : i + 1, kept], rewards[i : i + 1, kept],
                                   torch.ones(1, int(kept.sum()), dtype=torch.bool), gamma=0.9, lam=0.8)
        torch.testing.assert_close(advantages[i, kept], alone_adv[0], atol=1e-12, rtol=0)
        torch.testing.assert_close(returns[i, kept], alone_ret[0], atol=1e-12, rtol=0)
        assert advantages[i, ~kept].abs().max() == 0 and returns[i, ~kept].abs().max() == 0


def test_the_score_sits_on_the_last_action_token_and_turn_rewards_on_theirs():
    # row: action action | obs obs | action | pad ; the score 2.0 lands on column 4, not 3 (count - 1)
    actions = torch.tensor([[True, True, False, False, True, False]])
    turns = torch.tensor([[0.0, 0.5, 9.0, 9.0, 0.25, 9.0]])  # 9.0 where no action is: never counted
    zeros = torch.zeros(1, 6)
    rewards, kl = kl_shaped_rewards(torch.tensor([2.0]), zeros, zeros, actions, 0.1, "k1", turns)
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 0.5, 0.0, 0.0, 2.25, 0.0]]))


def test_logits_at_observation_positions_change_neither_the_loss_nor_the_gradients():
    """The stand-in policy of the absolute update tests, with one observation token inside row 0:
    whatever logprobs the model gives there, the update (parameters and every stat) is the same."""
    from tests import test_update_absolute as absolute

    class NoisyAtObservations(absolute.TableRoles):
        def __init__(self, noise: float):
            super().__init__()
            self.noise = noise

        def logprobs_from_hidden(self, hidden, input_ids, response_start, temperature):
            lp, ent = super().logprobs_from_hidden(hidden, input_ids, response_start, temperature)
            at_observation = torch.zeros_like(lp)
            # rollout row 0 (its response tokens [0, 1, 2]) wherever the micro-batch holds it (a micro-batch
            # that holds it keeps all 3 response columns; others may be trimmed to fewer)
            response, row_0 = input_ids[:, response_start:], torch.tensor(absolute.TOKENS[0])
            is_row_0 = (response == row_0[: response.shape[1]]).all(dim=1) & (response.shape[1] == len(row_0))
            at_observation[is_row_0, 1] = 1.0
            # a value and a gradient path (through theta) that only the observation position has
            return lp + self.noise * at_observation * self.theta.sum(), ent + self.noise * at_observation * self.theta[0, 0]

    rollout = absolute.make_rollout()
    actions = rollout.response_mask.clone()
    actions[0, 1] = False
    observation = torch.zeros_like(actions)
    observation[0, 1] = True
    rollout = dataclasses.replace(rollout, response_mask=actions, observation_mask=observation)
    cfg = absolute.PPOConfig(**{**absolute.BASE, "entropy_coef": 0.3, "kl_penalty": "loss", "kl_coef": 0.2,
                                "dual_clip": 3.0})
    results = []
    for noise in (0.0, 7.0):
        roles = NoisyAtObservations(noise)
        stats = absolute.run_update(roles, rollout, absolute.make_advantages(), cfg, cfg.kl_coef, micro=2)
        results.append((roles.theta.detach().clone(), roles.w.detach().clone(), stats))
    torch.testing.assert_close(results[0][0], results[1][0], atol=0, rtol=0)
    torch.testing.assert_close(results[0][1], results[1][1], atol=0, rtol=0)
    assert results[0][2] == results[1][2]
    # and the observation token is really inside the sequence the model reads
    assert rollout.attention_mask[0].tolist() == [1, 1, 1, 1]


# ---- episodes on the tiny model ---------------------------------------------------------------


def test_a_one_turn_environment_is_todays_single_turn_step_bit_for_bit(tmp_path, tiny_model_dir):
    single = trainer(tmp_path, tiny_model_dir, name="single")
    metrics_single, rollout_single = single.train_step()
    episodic = trainer(tmp_path, tiny_model_dir, {"environment": "tests.agent_envs:OneTurn"}, name="episodic")
    metrics_episodic, rollout_episodic = episodic.train_step()

    for name in ("query_ids", "response_ids", "response_mask", "old_logprobs", "ref_logprobs", "values", "scores"):
        assert torch.equal(getattr(rollout_single, name), getattr(rollout_episodic, name)), name
    assert not rollout_episodic.observation_mask.any()
    for a, b in zip(trained_tensors(single), trained_tensors(episodic)):
        assert torch.equal(a, b)
    same = {k: v for k, v in metrics_single.items() if not k.startswith(TIMING_PREFIXES)}
    assert same == {k: metrics_episodic[k] for k in same}
    assert metrics_episodic["episode/turns"] == 1.0 and metrics_episodic["episode/truncated_frac"] == 0.0


def test_turns_observations_and_turn_rewards_of_an_episode(tmp_path, tiny_model_dir):
    """Three turns, each answered "again" with a reward of 0.5: the observation tokens decode to
    the template's user turn, each turn's reward sits on its last action token, and the episode
    reads as a transcript."""
    t = trainer(tmp_path, tiny_model_dir, {"environment": "tests.agent_envs:Again", "max_turns": 3})
    metrics, rollout = t.train_step()
    tokenizer = t.parts.tokenizer
    assert metrics["episode/turns"] == 3.0 and metrics["episode/truncated_frac"] == 0.0
    assert metrics["episode/env_reward"] == pytest.approx(1.5)
    for i in range(rollout.response_ids.shape[0]):
        ids, actions, observation = rollout.response_ids[i], rollout.response_mask[i], rollout.observation_mask[i]
        assert not (actions & observation).any()
        # the two observations, between three runs of action tokens
        runs = torch.diff(actions.int(), prepend=torch.tensor([0])).eq(1).sum()
        assert int(runs) == 3
        text = tokenizer.decode(ids[observation])
        assert text.count("<|im_start|>user\nagain<|im_end|>") == 2 and text.count("<|im_start|>assistant\n") == 2
        last_of_turn = actions & ~torch.cat([actions[1:], torch.tensor([False])])
        torch.testing.assert_close(rollout.turn_rewards[i][last_of_turn], torch.full((3,), 0.5))
        assert rollout.turn_rewards[i][~last_of_turn].abs().sum() == 0
        roles = [m["role"] for m in rollout.transcripts[i]]
        assert roles == ["user", "assistant", "user", "assistant", "user", "assistant"]


def test_an_episode_step_without_a_reference_gives_its_transcripts_to_the_reward_and_times_its_phases(
        tmp_path, tiny_model_dir):
    """A KL-free run (adapters.reference: none) with a critic: the values are scored, the reward
    function gets each episode as `messages`, and generation's time and memory are the step's."""
    reward_fns.MESSAGES_SEEN.clear()
    t = trainer(tmp_path, tiny_model_dir, {"environment": "tests.agent_envs:Again", "max_turns": 2},
                adapters={"reference": "none"}, ppo={"kl_coef": 0.0},
                reward={"kind": "function", "function": "tests.reward_fns:records_messages"})
    metrics, rollout = t.train_step()
    assert reward_fns.MESSAGES_SEEN == [rollout.transcripts]
    assert rollout.values is not None and torch.equal(rollout.ref_logprobs, rollout.old_logprobs)  # no KL
    assert 0 < metrics["time/generate"] <= metrics["time/step"]
    assert "memory/generate_gb" in metrics and "memory/score_gb" in metrics


def test_the_budget_truncates_an_episode_and_counts_it(tmp_path, tiny_model_dir):
    t = trainer(tmp_path, tiny_model_dir, {"environment": "tests.agent_envs:Endless", "max_turns": 4,
                                            "max_episode_tokens": 20})
    metrics, rollout = t.train_step()
    assert metrics["episode/truncated_frac"] == 1.0
    assert int(rollout.context_mask.sum(dim=1).max()) <= 20
    assert metrics["episode/turns"] < 4  # the budget, not the turn limit, ended them


def test_the_turn_limit_truncates_an_episode_and_counts_it(tmp_path, tiny_model_dir):
    t = trainer(tmp_path, tiny_model_dir, {"environment": "tests.agent_envs:Endless", "max_turns": 2})
    metrics, _ = t.train_step()
    assert metrics["episode/turns"] == 2.0 and metrics["episode/truncated_frac"] == 1.0
    assert metrics["episode/turn_limit_frac"] == 1.0


def test_environment_rewards_show_as_the_episode_return_and_one_turn_of_three_is_warned(
        tmp_path, tiny_model_dir, caplog, capsys):
    """`reward.kind: none` and the default max_turns (1) against an environment of three turns
    (reward 0.5 each): the score reads 0 but the return, on the progress line and in the
    metrics, is 0.5; step 1 warns once that the turn limit cut every episode."""
    t = trainer(tmp_path, tiny_model_dir, {"environment": "tests.agent_envs:Again"},
                reward={"kind": "none", "function": None}, train={"eval": False, "steps": 2, "save_every": 0})
    with caplog.at_level("WARNING", logger="lora_ppo.step_log"):
        t.train()
    first, second = [__import__("json").loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert first["objective/scores"] == 0.0 and first["episode/return"] == 0.5 == second["episode/return"]
    assert first["episode/turn_limit_frac"] == 1.0
    warned = [r.getMessage() for r in caplog.records if "max_turns" in r.getMessage()]
    assert warned == ["step 1: rollout.max_turns (1) ended 100% of the episodes before the environment did "
                      "(episode/turn_limit_frac): it expects more turns; raise rollout.max_turns"]
    assert "step 1/2  return 0.500  score 0.000  kl " in capsys.readouterr().err


def test_generate_on_an_environment_recipe_plays_episodes_that_step_takes_back(tmp_path, tiny_model_dir):
    """`trainer.generate()` plays the recipe's episodes (the environment answers); queries(),
    completion_ids() and action_mask() go back to step(), which trains on the action tokens only."""
    t = trainer(tmp_path, tiny_model_dir, {"environment": "tests.agent_envs:Again", "max_turns": 2})
    played = t.generate(["The film was", "I hated"])
    assert [[m["role"] for m in messages] for messages in played.transcripts] == [
        ["user", "assistant", "user", "assistant"]] * 2
    assert played.env_rewards() == [1.0, 1.0]  # Again rewards each of the two turns 0.5
    masks = played.action_mask()
    assert all(len(m) == len(ids) and False in m for m, ids in zip(masks, played.completion_ids()))
    metrics = t.step(played.queries(), played.completion_ids(), [1.0, 0.0], played.action_mask())
    assert metrics["response/length"] == pytest.approx(sum(map(sum, masks)) / 2)


def test_prompts_without_a_column_the_environment_takes_are_refused_before_an_episode(tmp_path, tiny_model_dir,
                                                                                      monkeypatch):
    """An environment that takes `answer`: training data without it is refused before the weights
    load, and so are prompts given to generate() or `lora-ppo generate` (they have no columns) and an
    `eval --prompts` file without it. Each failed at the first episode, with Python's "missing 1
    required positional argument"."""
    from lora_ppo import parts
    from lora_ppo.errors import RecipeError
    from tests.sft_helpers import write_jsonl

    env = {"environment": "tests.agent_envs:NeedsAnswer"}
    with monkeypatch.context() as patched:
        patched.setattr(parts, "load_base_model", lambda cfg: pytest.fail("the weights loaded"))
        with pytest.raises(RecipeError) as err:
            trainer(tmp_path, tiny_model_dir, env)
    assert str(err.value) == ("rollout.environment: tests.agent_envs:NeedsAnswer takes the column 'answer', which "
                              "'builtin:movie_review_openers' does not have (columns besides the prompt: none)")

    answered = write_jsonl(tmp_path / "answered.jsonl", [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(8)])
    bare = write_jsonl(tmp_path / "bare.jsonl", [{"prompt": "2 + 2 ="}])
    with pytest.raises(RecipeError, match=f"which '{bare}' does not have"):  # the held-out prompts too
        trainer(tmp_path, tiny_model_dir, env, data={**EPISODES, "source": str(answered), "eval_source": str(bare)})
    t = trainer(tmp_path, tiny_model_dir, env, data={**EPISODES, "source": str(answered)}, train={"steps": 1})
    with pytest.raises(ValueError, match="which a prompt given to generate\\(\\) does not have"):
        t.generate(["3 + 3 ="])
    t.train()

    run = str(tmp_path / "run")
    given = CliRunner().invoke(app, ["generate", run, "3 + 3 ="])
    assert given.exit_code == 2 and given.stderr.strip().endswith(
        "which a prompt given on the command line does not have (columns besides the prompt: none); "
        "`lora-ppo eval RUN --prompts FILE` takes prompts with their columns")
    filed = CliRunner().invoke(app, ["eval", run, "--prompts", str(bare)])
    assert filed.exit_code == 2 and f"takes the column 'answer', which '{bare}' does not have" in filed.stderr
    assert CliRunner().invoke(app, ["eval", run, "--prompts", str(answered), "--samples", "1"]).exit_code == 0


def test_an_environment_that_raises_stops_the_run_in_one_line_and_keeps_the_checkpoint(tmp_path, tiny_model_dir):
    agent_envs.CREATED.clear()
    recipe = tiny_recipe_dict(tiny_model_dir, tmp_path / "run", data=EPISODES,
                              rollout={"environment": "tests.agent_envs:BreaksAtEpisode5"},
                              train={"eval": False, "steps": 3, "save_every": 1})
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    result = CliRunner().invoke(app, ["train", str(path), "--no-progress"])
    assert result.exit_code == 1
    line = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert len(line) == 1
    assert line[0].startswith("error: environment tests.agent_envs:BreaksAtEpisode5 raised ValueError while "
                              "stepping for row 0 (prompt ")
    assert line[0].endswith("): the game server is down")
    assert "Traceback" not in result.output
    assert (tmp_path / "run" / "checkpoints" / "step-1" / "manifest.json").is_file()
    assert not (tmp_path / "run" / "checkpoints" / "step-2").exists()


def test_resume_mid_run_with_an_environment_equals_an_uninterrupted_run(tmp_path, tiny_model_dir):
    """Environments are made per episode, so a run keeps no environment state between steps:
    the checkpoint's prompt position and random streams are all a resume needs."""
    rollout = {"environment": "tests.agent_envs:Again", "max_turns": 2}
    whole = trainer(tmp_path, tiny_model_dir, rollout, name="whole", train={"eval": False, "steps": 3, "save_every": 0})
    whole.train()
    first = trainer(tmp_path, tiny_model_dir, rollout, name="parts", train={"eval": False, "steps": 2, "save_every": 0})
    first.train()
    recipe = tiny_recipe_dict(tiny_model_dir, tmp_path / "parts", data=EPISODES, rollout=rollout,
                              train={"eval": False, "steps": 3, "save_every": 0})
    lora_ppo.PPOTrainer(recipe_from_dict(recipe), progress=False, resume="auto").train()
    for role in (POLICY, VALUE):
        a, b = adapter_tensors(tmp_path / "whole" / "final" / role), adapter_tensors(tmp_path / "parts" / "final" / role)
        assert all(torch.equal(a[k], b[k]) for k in a), role


# ---- step(): rollouts the caller made ---------------------------------------------------------


def test_step_on_the_tokens_of_a_train_rollout_takes_the_same_update(tmp_path, tiny_model_dir):
    """The same recipe and seed: `train_step()` samples and updates; a fresh trainer's `step()` on
    that rollout's tokens and scores lands on the same adapters. Old logprobs from a scoring pass
    on both sides (`logprobs_from_generation: false`): recorded at sampling they differ by ~1e-6,
    which Adam's first step turns into ~3e-5 on a weight whose gradient is near 0."""
    scored = {"logprobs_from_generation": False}
    sampled = trainer(tmp_path, tiny_model_dir, scored, name="sampled")
    metrics_sampled, rollout = sampled.train_step()
    given = trainer(tmp_path, tiny_model_dir, scored, name="given")
    queries = [ids[mask.bool()].tolist() for ids, mask in zip(rollout.query_ids, rollout.query_mask)]
    responses = [ids[mask].tolist() for ids, mask in zip(rollout.response_ids, rollout.response_mask)]
    metrics_given = given.step(queries, responses, rollout.raw_scores.tolist())

    for a, b in zip(trained_tensors(sampled), trained_tensors(given)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    moved = [not torch.equal(a, b) for a, b in zip(trained_tensors(given), trained_tensors(trainer(
        tmp_path, tiny_model_dir, name="untouched")))]
    assert any(moved)
    for key in ("objective/scores", "objective/kl", "loss/value", "policy/clipfrac"):
        assert metrics_given[key] == pytest.approx(metrics_sampled[key], rel=1e-5, abs=1e-7), key
    assert (tmp_path / "given" / "metrics.jsonl").read_text(encoding="utf-8").count("\n") == 1


def test_step_on_the_tokens_of_an_episode_rollout_takes_the_same_update(tmp_path, tiny_model_dir):
    """Two turns with an observation between them (an environment that gives no reward, so the
    score is the whole return): `step()` on the episode's tokens, with its action mask, lands on
    the adapters `train_step()` reached, its observations read as context, not as actions."""
    episodes = {"logprobs_from_generation": False, "environment": "tests.agent_envs:Endless", "max_turns": 2}
    sampled = trainer(tmp_path, tiny_model_dir, episodes, name="sampled")
    metrics_sampled, rollout = sampled.train_step()
    assert rollout.observation_mask.any()
    given = trainer(tmp_path, tiny_model_dir, episodes, name="given")
    context = rollout.response_mask | rollout.observation_mask
    queries = [ids[mask.bool()].tolist() for ids, mask in zip(rollout.query_ids, rollout.query_mask)]
    responses = [ids[mask].tolist() for ids, mask in zip(rollout.response_ids, context)]
    actions = [acts[mask].tolist() for acts, mask in zip(rollout.response_mask, context)]
    metrics_given = given.step(queries, responses, rollout.raw_scores.tolist(), action_mask=actions)

    for a, b in zip(trained_tensors(sampled), trained_tensors(given)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    # Every number of the step, the entropy (read at action tokens, after the observations) among them:
    # Adam's first step moves each weight by about the learning rate whatever its gradient's size.
    shared = [k for k in metrics_given if k in metrics_sampled and not k.startswith((*TIMING_PREFIXES, "memory/"))]
    assert {"policy/entropy", "objective/kl", "loss/value", "response/length"} <= set(shared)
    for key in shared:
        assert metrics_given[key] == pytest.approx(metrics_sampled[key], rel=1e-5, abs=1e-7), key
    assert "memory/score_gb" in metrics_given and "memory/update_gb" in metrics_given


def test_step_takes_queries_and_responses_as_2d_tensors(tmp_path, tiny_model_dir):
    """Rows of one length, as a tokenizer's batch or TRL's rollouts hand them over: a [B, T]
    tensor steps exactly as the same rows in lists."""
    queries, responses, scores = [[5, 6], [6, 7]], [[7, 8, 2], [9, 10, 11]], [1.0, 0.0]
    as_lists = trainer(tmp_path, tiny_model_dir, name="lists")
    as_lists.step(queries, responses, scores)
    as_tensors = trainer(tmp_path, tiny_model_dir, name="tensors")
    as_tensors.step(torch.tensor(queries), torch.tensor(responses), torch.tensor(scores))
    for a, b in zip(trained_tensors(as_lists), trained_tensors(as_tensors)):
        assert torch.equal(a, b)


def test_a_given_response_that_ends_without_the_stop_token_gets_the_missing_eos_penalty(tmp_path, tiny_model_dir):
    """As a sampled one does: of three responses scored 1.0, the two ending in the stop token (id 2)
    keep their score, the other gets 1.0 - 3.0, whatever token it starts with."""
    t = trainer(tmp_path, tiny_model_dir, {"missing_eos_penalty": 3.0})
    metrics = t.step([[5, 6], [6], [7]], [[2, 8, 2], [6, 2], [2, 10, 11]], [1.0, 1.0, 1.0])
    assert metrics["objective/raw_scores"] == 1.0
    assert metrics["objective/scores"] == pytest.approx((1.0 + 1.0 + (1.0 - 3.0)) / 3)


def test_step_samples_show_the_decoded_query_and_the_action_tokens_alone(tmp_path, tiny_model_dir):
    """samples.jsonl of a step: the prompt is the query's text and the completion the response's
    action tokens' text (the observation between them left out), special tokens skipped."""
    t = trainer(tmp_path, tiny_model_dir, train={"eval": False, "steps": 2, "save_every": 0, "sample_every": 1})
    tokenizer = t.parts.tokenizer
    query = tokenizer("<|im_start|>user\nThe film was<|im_end|>\n", add_special_tokens=False)["input_ids"]
    good, observed, more = (tokenizer(text, add_special_tokens=False)["input_ids"]
                            for text in (" good", " (a reply)", " and long"))
    response = good + observed + more + [tokenizer.eos_token_id]
    mask = [True] * len(good) + [False] * len(observed) + [True] * (len(more) + 1)
    t.step([query], [response], [0.5], action_mask=[mask])
    (sample,) = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").open(encoding="utf-8")]
    assert sample["prompt"] == "user\nThe film was\n"
    assert sample["completion"] == " good and long"


def test_step_with_an_action_mask_trains_only_on_the_marked_tokens(tmp_path, tiny_model_dir):
    """A two-token observation in the middle of each response: it is attended to, but carries no
    logprob, KL or value in the step's metrics (response/length counts action tokens)."""
    t = trainer(tmp_path, tiny_model_dir)
    queries = [[5, 6, 7], [8, 9]]
    responses = [[10, 11, 12, 13, 14], [15, 16, 17, 18]]
    mask = [[True, False, False, True, True], [True, True, False, False]]
    metrics = t.step(queries, responses, [1.0, -1.0], action_mask=mask)
    assert metrics["response/length"] == pytest.approx((3 + 2) / 2)
    with pytest.raises(ValueError, match="action_mask row 1 has 3 entries for a response of 4 tokens"):
        t.step(queries, responses, [1.0, 0.0], action_mask=[mask[0], [True] * 3])


def test_generate_returns_the_policys_samples_for_text_and_conversations(tmp_path, tiny_model_dir):
    t = trainer(tmp_path, tiny_model_dir)
    samples = t.generate(["The film was", [{"role": "user", "content": "Tell me about the plot."}]],
                         max_new_tokens=5)
    assert len(samples.completions) == 2 and samples.response_ids.shape[1] <= 5
    assert samples.completions == t.parts.tokenizer.batch_decode(samples.response_ids, skip_special_tokens=True)
    assert t.parts.tokenizer.decode(samples.queries()[1]).endswith("<|im_start|>assistant\n")


def test_an_episode_budget_past_the_models_context_is_refused_before_loading(tmp_path, tiny_model_dir):
    recipe = tiny_recipe_dict(tiny_model_dir, tmp_path / "run", data=EPISODES,
                              rollout={"environment": "tests.agent_envs:Again", "max_turns": 3,
                                       "max_episode_tokens": 250})
    with pytest.raises(lora_ppo.RecipeError, match=r"^rollout.max_episode_tokens: prompts of up to 64 tokens .* "
                                                   r"plus 250 new ones exceed the model's context of 256 tokens"):
        lora_ppo.PPOTrainer(recipe_from_dict(recipe), progress=False)


def test_step_refuses_mismatched_inputs_in_one_line(tmp_path, tiny_model_dir):
    t = trainer(tmp_path, tiny_model_dir)
    with pytest.raises(ValueError, match="step: got 2 queries, 1 responses and 2 scores"):
        t.step([[5], [6]], [[7]], [1.0, 2.0])
    with pytest.raises(ValueError, match="step: response 0 must be a non-empty sequence of token ids"):
        t.step([[5]], [[]], [1.0])


@pytest.mark.parametrize("change, message", [
    ({"scores": ["0.1", "0.2"]}, r"step: scores\[0\] is text \('0.1'\); give one finite number per response"),
    ({"scores": [1.0, float("nan")]}, r"step: scores\[1\] is not a finite number \(nan\)"),
    ({"action_mask": [[True, True], [False, False, False]]},
     r"step: action_mask row 1 marks no token as the policy's: a response needs at least one action token"),
    ({"action_mask": True}, r"step: action_mask must be one list of booleans per response \(2\), got True"),
    ({"action_mask": [[True, True]]}, r"step: action_mask must be one list of booleans per response \(2\), got 1 rows"),
    ({"action_mask": [[True, True], "TTF"]}, r"step: action_mask row 1 must be a list of booleans, got 'TTF'"),
    ({"responses": [[7, 8], [9, 100_000, 2]]},
     r"step: response 1 has the token id 100000 at position 1, outside the model's vocabulary \(ids 0 to \d+\)"),
    ({"queries": [[5, -1], [6]]}, r"step: query 0 has the token id -1 at position 1, outside the model's vocabulary"),
    # what is not a sequence is quoted to 20 characters
    ({"queries": "a text where token ids belong"}, r"step: got 'a text where token  queries, 2 responses and 2 scores"),
    ({"queries": [[5, True], [6]]}, r"step: query 0 must be a non-empty sequence of token ids, got '\[5, True\]'$"),
    # what is not a list is quoted to 60 characters
    ({"action_mask": "T" * 100},
     r"step: action_mask must be one list of booleans per response \(2\), got '" + "T" * 59 + "$"),
])
def test_step_refuses_each_bad_argument_with_one_line_naming_it_and_the_row(tmp_path, tiny_model_dir, change, message):
    """Caught before anything is scored: the step counter stays, and right input then steps."""
    t = trainer(tmp_path, tiny_model_dir)
    given = {"queries": [[5, 6], [6]], "responses": [[7, 8], [9, 10, 2]], "scores": [1.0, 0.0], "action_mask": None,
             **change}
    with pytest.raises(ValueError, match=f"^{message}"):
        t.step(**given)
    assert t.steps_done == 0
    accepted = t.step([[5, 6], [6]], [[7, 8], [9, 10, 2]], [torch.tensor(1.0), 0], action_mask=[[1, 0], [True] * 3])
    assert accepted["step"] == 1


def test_step_takes_the_first_and_last_ids_of_the_vocabulary_and_refuses_the_one_past_it(tmp_path, tiny_model_dir):
    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    t = trainer(tmp_path, tiny_model_dir)
    with pytest.raises(ValueError, match=rf"^step: response 0 has the token id {vocab} at position 0, outside the "
                                         rf"model's vocabulary \(ids 0 to {vocab - 1}\)$"):
        t.step([[5]], [[vocab, 2]], [1.0])
    assert t.step([[0, 5]], [[vocab - 1, 0, 2]], [1.0])["step"] == 1


def test_step_takes_numpy_arrays_as_it_takes_lists(tmp_path, tiny_model_dir):
    """Token ids, scores and action masks as numpy arrays (what a data pipeline hands over) step
    exactly as the same values in lists."""
    import numpy as np

    queries, responses = [[5, 6], [6]], [[7, 8], [9, 10, 2]]
    mask = [[True, False], [True, True, True]]
    as_lists = trainer(tmp_path, tiny_model_dir, name="lists")
    as_lists.step(queries, responses, [1.0, 0.0], action_mask=mask)
    as_arrays = trainer(tmp_path, tiny_model_dir, name="arrays")
    as_arrays.step([np.array(q) for q in queries], [np.array(r, dtype=np.int32) for r in responses],
                   np.array([1.0, 0.0], dtype=np.float32), action_mask=[np.array(row) for row in mask])
    for a, b in zip(trained_tensors(as_lists), trained_tensors(as_arrays)):
        assert torch.equal(a, b)


def test_generate_on_a_run_with_an_environment_plays_its_episodes(tmp_path, tiny_model_dir):
    """`lora-ppo generate` on a multi-turn run prints each episode's turns after the prompt:
    the policy's two turns and the environment's "again" between them."""
    recipe = tiny_recipe_dict(tiny_model_dir, tmp_path / "run", data=EPISODES,
                              rollout={"environment": "tests.agent_envs:Again", "max_turns": 2},
                              train={"eval": False, "steps": 1, "save_every": 0})
    lora_ppo.PPOTrainer(recipe_from_dict(recipe), progress=False).train()
    result = CliRunner().invoke(app, ["generate", str(tmp_path / "run"), "The film was", "--json"])
    assert result.exit_code == 0, result.output
    record = [__import__("json").loads(line) for line in result.stdout.splitlines() if line.startswith("{")][0]
    text = record["policy"]
    assert text.startswith("[assistant] ") and text.count("\n[user] again\n[assistant] ") == 1


def test_the_generate_step_loop_trains_on_each_responses_tokens_not_the_padding_after_its_stop(tmp_path,
                                                                                               tiny_model_dir):
    """Samples whose first row stopped after 2 tokens: completion_ids() hands step() 2 + 4 real
    tokens, so a step counts 3 per response, not the padded width of 4."""
    from tests.test_rollout import _samples_with_a_stop_before_the_end

    t = trainer(tmp_path, tiny_model_dir)
    samples = _samples_with_a_stop_before_the_end()
    metrics = t.step(samples.queries(), samples.completion_ids(), [1.0, 0.0], samples.action_mask())
    assert metrics["response/length"] == 3.0 and metrics["response/stopped_frac"] == 0.5
