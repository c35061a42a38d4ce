"""env_space game logic, table-driven: Wordle feedback (repeated letters), win/loss, rewards; `repeat`."""

from __future__ import annotations

import pytest

from env_space import repeat, wordle
from env_space.wordle import INVALID_PENALTY, WIN_BONUS, WordleGame, feedback, turn_reward


@pytest.mark.parametrize(("guess", "answer", "expected"), [
    ("crane", "crane", "GGGGG"),
    ("crane", "bumpy", "-----"),
    ("crane", "nacre", "YYYYG"),
    # repeated letters in the guess: only as many Y/G as the answer has copies
    ("speed", "abide", "--Y-Y"),   # one 'e' in the answer: the first 'e' is yellow, the second gray
    ("eerie", "there", "Y-Y-G"),   # 'there' has two e's: the final green takes one, the first 'e' the other
    ("geese", "eerie", "-GY-G"),   # greens claim copies before yellows do
    ("lolly", "hello", "-YGG-"),   # three l's, two in 'hello', both green: the first 'l' is gray
    ("allee", "eagle", "YY-YG"),
    # repeated letters in the answer
    ("apple", "paper", "YYG-Y"),
    ("mamma", "maxim", "GGY--"),
    ("array", "radar", "YYYG-")  # two r's left for the two guessed,
])
def test_feedback_repeated_letters(guess, answer, expected):
    assert feedback(guess, answer) == expected


def test_feedback_length_mismatch_is_an_error():
    with pytest.raises(ValueError):
        feedback("abc", "abcde")


@pytest.mark.parametrize(("fb", "won", "expected"), [
    ("-----", False, 0.0),
    ("GGGGG", True, 1.0 + WIN_BONUS),
    ("YYYYG", False, (1 + 0.5 * 4) / 5),
    ("G-Y--", False, (1 + 0.5) / 5),
    (None, False, INVALID_PENALTY),
])
def test_turn_reward(fb, won, expected):
    assert turn_reward(fb, won) == pytest.approx(expected)


def test_win_ends_the_game_with_bonus():
    g = WordleGame(answer="crane")
    t1 = g.guess("slate")
    assert t1.feedback == "--G-G" and not g.done
    t2 = g.guess("  CRANE.\n")  # whitespace, case and trailing punctuation are forgiven
    assert t2.feedback == "GGGGG" and g.won and g.done
    assert t2.reward == pytest.approx(1.0 + WIN_BONUS)
    with pytest.raises(RuntimeError):
        g.guess("crane")


def test_loss_after_six_turns_invalid_ones_included():
    g = WordleGame(answer="crane")
    plays = ["slate", "zzzzz", "crank", "abc", "house", "crate"]
    rewards = [g.guess(p).reward for p in plays]
    assert g.done and not g.won and len(g.turns) == 6
    assert rewards[1] == INVALID_PENALTY and rewards[3] == INVALID_PENALTY  # not a word / not 5 letters
    assert rewards[2] == pytest.approx(4 / 5)  # crank: GGGG-
    assert "the word was crane" in g.prompt()


def test_seed_picks_the_answer_reproducibly():
    assert WordleGame.from_seed(7).answer == WordleGame.from_seed(7).answer
    assert len({WordleGame.from_seed(s).answer for s in range(50)}) > 30
    assert all(WordleGame.from_seed(s).answer in wordle.answers() for s in range(20))


def test_word_lists_ship_with_the_package():
    assert len(wordle.answers()) > 400 and set(wordle.answers()) <= wordle.allowed()
    assert len(wordle.allowed()) > 9000
    assert wordle.is_valid_guess("crane") and not wordle.is_valid_guess("zzzzz")


@pytest.mark.parametrize(("completion", "target", "expected"), [
    ("", "a", 0.0),
    ("a", "a", 1.0),
    ("aaaa", "a", 1.0),
    ("abab", "a", 0.5),
    (" aaa", "a", 0.75),  # no stripping: the space is a miss
    ("AAAA", "a", 0.0),  # no case folding
    ("a" * 16 + "b" * 100, "a", 1.0),  # only the first 16 characters count
    ("b" * 8 + "a" * 100, "a", 0.5),
    ("cccbbb", "c", 0.5),
])
def test_repeat_reward(completion, target, expected):
    assert repeat.reward(completion, target) == expected


def test_repeat_episode_is_single_step_and_seeded():
    g = repeat.RepeatGame.from_seed(3)
    assert g.target in repeat.LETTERS and g.prompt() == f"Repeat the letter {g.target}:"
    assert repeat.RepeatGame.from_seed(3).target == g.target
    assert {repeat.target_for_seed(s) for s in range(100)} == set(repeat.LETTERS)
    assert g.play(g.target * 3) == 1.0 and g.done
    with pytest.raises(RuntimeError):
        g.play("x")
