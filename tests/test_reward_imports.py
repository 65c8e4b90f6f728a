"""How a recipe's reward function is found, and how a run records one given from Python: a module
beside the recipe (which the `lora-ppo` command does not search, as `python` would), a module found
elsewhere whose own import fails, a Python file named by its path, and the names a run can import
back later."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lora_ppo.errors import RecipeError
from lora_ppo.rewards import import_function, importable_name

SCORE_TWO = "def score(prompts, completions):\n    return [2.0] * len(completions)\n"


@pytest.fixture
def console_path(monkeypatch, tmp_path):
    """sys.path as the `lora-ppo` console script has it: neither the current folder nor '' on it;
    the test's own modules (under tmp_path) are forgotten after it."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(Path.cwd()))])
    yield sys.path
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def test_a_module_in_the_current_folder_is_found(tmp_path, monkeypatch, console_path):
    (tmp_path / "beside_the_recipe.py").write_text(SCORE_TWO, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert import_function("beside_the_recipe:score")(["p"], ["c", "d"]) == [2.0, 2.0]
    assert console_path[-1] == str(tmp_path)


def test_a_module_found_elsewhere_whose_own_import_fails_is_that_failure(tmp_path, monkeypatch, console_path):
    """The named module is installed (here: on the path); what it imports is missing there and
    lies in the current folder by chance. The failure is reported, and the folder stays off the path."""
    site, work = tmp_path / "site", tmp_path / "work"
    site.mkdir()
    work.mkdir()
    (site / "installed_rewards.py").write_text("import only_in_the_folder\n" + SCORE_TWO, encoding="utf-8")
    (work / "only_in_the_folder.py").write_text("", encoding="utf-8")
    console_path.append(str(site))
    monkeypatch.chdir(work)
    with pytest.raises(RecipeError, match="^reward.function: cannot import module 'installed_rewards': "
                                          "No module named 'only_in_the_folder'$"):
        import_function("installed_rewards:score")
    assert str(work) not in console_path


def test_a_python_file_is_imported_by_its_path(tmp_path):
    path = tmp_path / "scoring.py"
    path.write_text(SCORE_TWO, encoding="utf-8")
    assert import_function(f"{path}:score")(["p"], ["c"]) == [2.0]
    missing = tmp_path / "nowhere.py"
    with pytest.raises(RecipeError, match=f"^reward.function: cannot import module '{missing}': "
                                          f"no Python file {missing}$"):
        import_function(f"{missing}:score")


def test_a_python_file_fixed_after_a_failed_import_imports_in_the_same_process(tmp_path):
    """In a notebook: the file raised while importing, the user mends it and runs again."""
    path = tmp_path / "mended.py"
    path.write_text("raise ValueError('not finished')\n", encoding="utf-8")
    with pytest.raises(RecipeError, match="not finished"):
        import_function(f"{path}:score")
    path.write_text(SCORE_TWO, encoding="utf-8")
    assert import_function(f"{path}:score")(["p"], ["c"]) == [2.0]


def test_a_run_records_a_function_by_the_name_that_imports_it_back(monkeypatch):
    from tests.reward_fns import count_letter_e

    assert importable_name(count_letter_e) == "tests.reward_fns:count_letter_e"

    def local(prompts, completions):
        return [0.0] * len(completions)

    assert importable_name(local) is None  # a closure: "...<locals>.local"
    assert importable_name(lambda p, c: [0.0]) is None

    # A script's own function: `__main__:name` would import another script's main, or nothing.
    def in_a_script(prompts, completions):
        return [0.0] * len(completions)

    monkeypatch.setattr(in_a_script, "__module__", "__main__")
    monkeypatch.setattr(in_a_script, "__qualname__", "in_a_script")
    monkeypatch.setattr(sys.modules["__main__"], "in_a_script", in_a_script, raising=False)
    assert importable_name(in_a_script) is None

    # The module's attribute of that name is another object (the function was replaced since).
    monkeypatch.setattr(local, "__module__", "tests.reward_fns")
    monkeypatch.setattr(local, "__qualname__", "count_letter_e")
    assert importable_name(local) is None
