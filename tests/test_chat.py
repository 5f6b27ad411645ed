import pytest

from llamagym.agent.chat import ChatFormatter, supports_system_role


def history(n):
    messages = []
    for i in range(n):
        messages += [{"role": "user", "content": f"observation {i}"}, {"role": "assistant", "content": f"reply {i}"}]
    return messages + [{"role": "user", "content": "latest"}]


def test_prompt_is_the_tokenizers_own_chat_template(tokenizer):
    formatter = ChatFormatter(tokenizer)
    ids, dropped = formatter.prompt_ids("SYS", history(1))
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "SYS"}, *history(1)], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert ids == list(expected) and dropped == 0


def test_over_budget_drops_oldest_exchanges_but_keeps_system_and_latest(tokenizer):
    full, _ = ChatFormatter(tokenizer).prompt_ids("SYS", history(5))
    formatter = ChatFormatter(tokenizer, max_prompt_tokens=len(full) - 1)
    ids, dropped = formatter.prompt_ids("SYS", history(5))
    text = tokenizer.decode(ids)
    assert dropped == 2 and len(ids) <= len(full) - 1
    assert text.startswith("<|system|>SYS") and "observation 0" not in text and "observation 1" in text
    assert text.endswith("<|user|>latest<|end|><|assistant|>")


def test_budget_smaller_than_system_plus_latest_raises_with_advice(tokenizer):
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        ChatFormatter(tokenizer, max_prompt_tokens=5).prompt_ids("a long system prompt", history(0))


def test_template_without_system_role_folds_it_into_the_first_user_message(tokenizer):
    gemma_like = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    original = tokenizer.chat_template
    try:
        tokenizer.chat_template = gemma_like
        assert not supports_system_role(tokenizer)
        ids, _ = ChatFormatter(tokenizer).prompt_ids("SYS", history(0))
        assert tokenizer.decode(ids) == "<|user|>SYS\n\nlatest<|end|><|assistant|>"
    finally:
        tokenizer.chat_template = original


def test_history_must_end_with_a_user_message(tokenizer):
    with pytest.raises(ValueError, match="user message"):
        ChatFormatter(tokenizer).prompt_ids("SYS", history(1)[:-1])


@pytest.mark.parametrize("turns, kept", [(0, []), (1, ["observation 2"]), (None, ["observation 0", "observation 2"])])
def test_context_turns_limits_the_exchanges_a_prompt_keeps(tokenizer, turns, kept):
    ids, _ = ChatFormatter(tokenizer, context_turns=turns).prompt_ids("SYS", history(3))
    text = tokenizer.decode(ids)
    assert text.startswith("<|system|>SYS") and text.endswith("<|user|>latest<|end|><|assistant|>")
    for i in range(3):
        assert (f"observation {i}" in text) == (f"observation {i}" in kept or (turns is None))


def test_negative_context_turns_is_refused(tokenizer):
    with pytest.raises(ValueError, match="context_turns"):
        ChatFormatter(tokenizer, context_turns=-1)
