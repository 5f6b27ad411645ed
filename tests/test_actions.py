import gymnasium as gym
import pytest

from llamagym.agent.parsing import json_action, parse_action


def words(text):
    return {"stick": 0, "hit": 1}.get(text.strip().lower())


def raises(text):
    raise RuntimeError("boom")


@pytest.mark.parametrize(
    "reply, expected, valid",
    [
        ('{"action": 1}', 1, True),
        ('I will {"action": "1"} now', 1, True),  # JSON first, coerced for a Discrete space
        ('{"action": "hit"}', 1, True),  # a JSON string goes through extract_action
        ("stick", 0, True),  # no JSON: the user's extract_action
        ("", 0, False),  # empty reply
        ("\ufffd\x00 garbage", 0, False),  # undecodable bytes: fallback
        ('{"action": 7}', 0, False),  # outside the action space
        ('{"action": [1, 2]}', 0, False),  # JSON of the wrong type
        ('{"action": 1', 0, False),  # broken JSON, and extract_action finds nothing
    ],
)
def test_parse_action_json_first_then_hook_then_fallback(reply, expected, valid):
    parsed = parse_action(reply, words, fallback_action=0, action_space=gym.spaces.Discrete(2))
    assert parsed.action == expected and parsed.valid is valid and type(parsed.action) is int


def test_raising_hook_falls_back_and_says_why():
    parsed = parse_action("hit", raises, fallback_action=0)
    assert parsed == (0, False, "extract_action raised RuntimeError: boom")


def test_json_action_finds_the_first_object_with_an_action_key():
    assert json_action('{"x": 1} then {"action": "go"}') == (True, "go")
    assert json_action("no json here") == (False, None)
