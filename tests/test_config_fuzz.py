"""Hostile recipes: random YAML structures, values and text given to `lora-ppo validate` end in
either a valid recipe (exit 0) or one `error: ` line (exit 2), never a traceback."""

from __future__ import annotations

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from lora_ppo.cli import app
from lora_ppo.config import Recipe, leaf_fields

runner = CliRunner()

SECTIONS = list(Recipe.model_fields)
# Every name below a section, nested ones included (adapters.policy.r gives policy and r).
FIELD_NAMES = sorted({part for path, _ in leaf_fields(Recipe) for part in path.split(".")[1:]})

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["4bit", "all-linear", "gae", "rloo", "nf4", "auto", "function", "a:b", "eos", "", "1e-4"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(FIELD_NAMES), st.text(max_size=6), st.integers()), inner,
                        max_size=4),
    ),
    max_leaves=12,
)
# Mostly recipe-shaped: known sections and fields with random values, so the validators run.
sections = st.dictionaries(
    st.sampled_from(SECTIONS),
    st.one_of(st.dictionaries(st.sampled_from(FIELD_NAMES), values, max_size=5), values),
    max_size=4,
)
documents = st.one_of(sections, values)


def _check(tmp_path, text: str, overrides: list[str] = ()) -> None:
    path = tmp_path / "fuzz.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    result = runner.invoke(app, ["validate", str(path), *overrides])
    assert result.exit_code in (0, 2), (text, result.output, result.exception)
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    else:
        assert result.exception is None


FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(documents)
@example({"ppo": {"target_kl": float("inf")}})
@example({"ppo": {"length_penalty": float("nan")}})
@example({"train": {"seed": 10**30}})
@example({1: 2})
@example({"\r": None})
@example({"train": {"a\u2028b": 1}})
@example({"adapters": {"policy": {"rr": 1}}})
@example({"rollout": {"stop_token": None, "missing_eos_penalty": 1.0}})
def test_random_yaml_structures(tmp_path, data):
    _check(tmp_path, yaml.safe_dump(data, allow_unicode=True))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=200))
def test_random_text(tmp_path, text):
    _check(tmp_path, text)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.text(max_size=30), max_size=3))
def test_random_overrides(tmp_path, overrides):
    _check(tmp_path, "{}\n", [o for o in overrides if not o.startswith("-")])


def test_non_finite_and_huge_values_are_refused(tmp_path):
    for text, expected in [
        ("ppo: {target_kl: .inf}", "error: ppo.target_kl: Input should be a finite number (got inf)"),
        ("ppo: {length_penalty: .nan}", "error: ppo.length_penalty: Input should be a finite number (got nan)"),
        ("train: {seed: 100000000000000000000}", "error: train.seed: Input should be less than"),
    ]:
        (tmp_path / "r.yaml").write_text(text)
        result = runner.invoke(app, ["validate", str(tmp_path / "r.yaml")])
        assert result.exit_code == 2 and result.stderr.startswith(expected), result.stderr
