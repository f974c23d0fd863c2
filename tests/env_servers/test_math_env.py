"""MathEnv played through EnvRunner by scripted policies."""

import asyncio
import json

import pytest

from env_servers.math_env import MathEnv
from envhub import EnvRunner
from envhub.errors import ActionValidationError, EpisodeStateError


async def play(answer_text, env=None, **task):
    runner = EnvRunner(env or MathEnv())
    first = await runner.reset(**task)
    return first, await runner.step({"text": answer_text})


async def test_first_observation_is_the_whole_prompt():
    first = (await EnvRunner(MathEnv()).reset(seed=3, kind="add", difficulty=1)).observation
    assert first.text.startswith("What is ") and r"\boxed{}" in first.text
    assert len(first.text) < 80
    meta = first.metadata
    assert r"\boxed{}" in meta["system_prompt"]
    assert (meta["split"], meta["kind"], meta["difficulty"]) == ("train", "add", 1)
    assert meta["task_id"].startswith("add-d1-")


@pytest.mark.parametrize("response", [
    r"\boxed{\frac{1}{2}}", r"\boxed{0.5}", r"\boxed{1/2}", r"\boxed{50\%}", r"\boxed{\dfrac12}", r"$\boxed 0.5$",
])
async def test_right_answers_in_many_notations_earn_reward_one(response):
    _, result = await play(f"Let me think. {response}", problem="Half of one?", answer=r"\frac{1}{2}")
    assert result.done and result.reward == 1.0
    assert result.info["correct"] is True and result.info["ground_truth"] == r"\frac{1}{2}"


@pytest.mark.parametrize("response, parsed", [(r"\boxed{\frac{1}{3}}", r"\frac{1}{3}"), (r"\boxed{5}", "5"),
                                              ("0.5 without a box", None)])
async def test_wrong_or_missing_answers_earn_nothing(response, parsed):
    _, result = await play(response, problem="Half of one?", answer=r"\frac{1}{2}")
    assert result.done and result.reward == 0.0
    assert result.info["correct"] is False and result.info["parsed_answer"] == parsed


async def test_equation_and_tuple_answers():
    _, result = await play(r"\boxed{x = 3}", problem="Solve x - 3 = 0.", answer="3")
    assert result.reward == 1.0
    _, result = await play(r"\boxed{(2, -1)}", problem="Point?", answer="(2,-1)")
    assert result.reward == 1.0
    _, result = await play(r"\boxed{(-1, 2)}", problem="Point?", answer="(2,-1)")
    assert result.reward == 0.0


async def test_configurable_format_and_missing_answer_rewards():
    env = MathEnv(format_reward=0.1, no_answer_reward=-1.0, incorrect_reward=0.0)
    _, right = await play(r"\boxed{4}", env, problem="2+2?", answer="4")
    assert right.reward == pytest.approx(1.1)
    assert right.info["rewards"] == {"correctness": 1.0, "format": 0.1}
    _, wrong = await play(r"\boxed{5}", MathEnv(format_reward=0.1), problem="2+2?", answer="4")
    assert wrong.reward == pytest.approx(0.1)
    _, missing = await play("four", MathEnv(no_answer_reward=-1.0), problem="2+2?", answer="4")
    assert missing.reward == -1.0


async def test_scripted_solver_scores_full_marks_on_the_easy_family():
    for index in range(20):
        runner = EnvRunner(MathEnv())
        first = await runner.reset(split="validation", kind="add", difficulty=1, index=index)
        a, op, b = first.observation.text.split("?")[0].removeprefix("What is ").split()
        value = int(a) + int(b) if op == "+" else int(a) - int(b)
        result = await runner.step({"text": f"\\boxed{{{value}}}"})
        assert result.reward == 1.0, first.observation.text


async def test_index_is_deterministic_and_splits_differ():
    texts = [(await EnvRunner(MathEnv()).reset(split="test", index=4)).observation.text for _ in range(2)]
    assert texts[0] == texts[1]
    first = await EnvRunner(MathEnv()).reset(split="validation", index=4, kind="fraction")
    assert first.observation.metadata["split"] == "validation"


@pytest.mark.parametrize("task", [dict(kind="calculus"), dict(split="dev"), dict(problem="only a problem"),
                                  dict(difficulty=9), dict(colour="blue")])
async def test_bad_reset_arguments_are_validation_errors(task):
    with pytest.raises(ActionValidationError):
        await EnvRunner(MathEnv()).reset(**task)


def test_stepping_an_env_used_directly_before_reset_says_to_reset():
    # an env driven without EnvRunner (an adapter, a test) gets the reason, not an AttributeError on None
    with pytest.raises(EpisodeStateError, match="reset"):
        MathEnv().on_text("\\boxed{4}")
    with pytest.raises(EpisodeStateError, match="reset"):
        MathEnv().task_metadata()


def test_unknown_config_option_names_the_valid_ones():
    with pytest.raises(TypeError, match="format_reward"):
        MathEnv(formt_reward=0.1)


async def test_dataset_files_replace_the_generator(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text(json.dumps({"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"}))
    env = MathEnv(data_files={"test": str(path)})
    first, result = await play(r"\boxed{7}", env, split="test", index=0)
    assert first.observation.text.startswith("Tom has 3 apples") and result.reward == 1.0
    with pytest.raises(ActionValidationError, match="data_files"):
        await EnvRunner(MathEnv(data_files={"test": str(path)})).reset(split="train")


async def test_many_concurrent_episodes_through_runners():
    async def episode(i):
        runner = EnvRunner(MathEnv())
        first = await runner.reset(seed=i, kind="add", difficulty=2)
        a, op, b = first.observation.text.split("?")[0].removeprefix("What is ").split()
        value = int(a) + int(b) if op == "+" else int(a) - int(b)
        return (await runner.step({"text": f"\\boxed{{{value}}}"})).reward
    rewards = await asyncio.gather(*(episode(i) for i in range(256)))
    assert rewards == [1.0] * 256


async def test_datasets_cache_source_never_downloads_and_explains_itself():
    try:
        import datasets  # noqa: F401
    except ImportError:
        expected = "needs the 'datasets' package"
    else:
        expected = "not in the local datasets cache"
    with pytest.raises(ActionValidationError, match=expected):
        await EnvRunner(MathEnv(hf_dataset="envhub-test/definitely-not-cached")).reset(split="test")


async def test_metadata_tells_the_size_of_a_listed_split_and_index_walks_it():
    runner = EnvRunner(MathEnv())
    first = await runner.reset(split="validation", kind="add", difficulty=1, index=0)
    n = first.observation.metadata["split_size"]
    texts = {(await EnvRunner(MathEnv()).reset(split="validation", kind="add", difficulty=1, index=i)).observation.text
             for i in range(n)}
    assert len(texts) == n  # every problem of the split once
    drawn = await EnvRunner(MathEnv()).reset(split="validation", kind="fraction", seed=3)
    assert "split_size" not in drawn.observation.metadata  # a generated family has no fixed list
